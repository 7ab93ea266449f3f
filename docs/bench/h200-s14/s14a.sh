#!/usr/bin/env bash
# session 14 call A: a closed wave of 64 target-only requests (HEAD vs 430eac4), step times split by kind; e2e pair at len 320
OUT=$1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export TRITON_CACHE_DIR=/tmp/triton-cache PYTHONUNBUFFERED=1
mkdir -p $TRITON_CACHE_DIR; cat .tcache/triton-cache.tgz.part-* | tar xzf - -C $TRITON_CACHE_DIR
T0=$(date +%s)
for tree in $PWD .old/430eac4; do n=$(basename $tree)
  echo "=== [$(( $(date +%s) - T0 )) s] prof $n"; PYTHONPATH=$tree:/tmp/site timeout 150 python3 .old/prof_c64.py 64 128 cuda > $OUT/prof-$n.txt 2>&1; echo "exit $?"; grep "^rep" $OUT/prof-$n.txt
done
for tree in $PWD .old/430eac4; do n=$(basename $tree); len=; [ $tree = $PWD ] && len="--max-model-len 320"
  echo "=== [$(( $(date +%s) - T0 )) s] e2e $n"
  (cd $tree && PYTHONPATH=$PWD:/tmp/site timeout 170 python3 -m deltaflash bench e2e --workload demo --prompts 16 --concurrency 4 16 64 --no-profile --quiet $len --out /tmp/e2e-$n > $OUT/e2e-$n.txt 2>&1; echo "exit $?"; cp /tmp/e2e-$n/e2e-demo.json $OUT/e2e-$n.json)
done
echo "=== done $(( $(date +%s) - T0 )) s"
