#!/usr/bin/env bash
# session 15 call B: decode graph (verify + commit at W=1): GPU tests; transfers; wave HEAD vs 430eac4; split; e2e pair
OUT=$1
T0=$(date +%s)
DELTAFLASH_TEST_DEVICE=cuda PYTEST_ARGS="-n 8 -p no:cacheprovider" LIMIT_TESTS=200 \
  TESTS="tests/test_gpu_graphs.py tests/test_spec.py tests/test_engine.py tests/test_policy.py tests/test_tree.py tests/test_pages.py" \
  bash bench/gpu_checks.sh $OUT tests > /dev/null 2>&1
cp $OUT/log.txt $OUT/tests.txt; rm $OUT/log.txt; grep -E "passed|failed|=== tests" $OUT/tests.txt | tail -3; grep -E "^FAILED|^ERROR" $OUT/tests.txt | head
export TRITON_CACHE_DIR=/tmp/triton-cache PYTHONUNBUFFERED=1
echo "=== [$(( $(date +%s) - T0 )) s] transfers"; timeout 30 python3 .old/xfer.py
for tree in .old/430eac4 $PWD; do n=$(basename $tree)
  echo "=== [$(( $(date +%s) - T0 )) s] wave $n"; PYTHONPATH=$tree:/tmp/site timeout 90 python3 .old/prof_c64.py 64 128 cuda > $OUT/prof-$n.txt 2>&1; echo "exit $?"; grep "^rep" $OUT/prof-$n.txt
done
echo "=== [$(( $(date +%s) - T0 )) s] split"
PYTHONPATH=$PWD:/tmp/site timeout 80 python3 .old/host_split.py 64 cuda 300 2>&1 | tail -22
for tree in $PWD .old/430eac4; do n=$(basename $tree); len=; [ $tree = $PWD ] && len="--max-model-len 320"
  left=$(( 570 - ($(date +%s) - T0) )); [ $left -lt 20 ] && break
  echo "=== [$(( $(date +%s) - T0 )) s] e2e $n (limit $left)"
  (cd $tree && PYTHONPATH=$PWD:/tmp/site timeout $left python3 -m deltaflash bench e2e --workload demo --prompts 16 --concurrency 4 16 64 --no-profile --quiet $len --out /tmp/e2e-$n > /tmp/e2e-$n.txt 2>&1; echo "exit $?"; tail -12 /tmp/e2e-$n.txt | cut -c1-200; cp /tmp/e2e-$n/e2e-demo.json $OUT/e2e-$n.json)
done
echo "=== done $(( $(date +%s) - T0 )) s"
