#!/usr/bin/env bash
# session 14 call C: GPU suites; a 64-lane target-only wave 4a59e4d vs working tree; e2e pair vs 430eac4; attention tiles
OUT=$1
T0=$(date +%s)
DELTAFLASH_TEST_DEVICE=cuda PYTEST_ARGS="-n 8 -p no:cacheprovider" LIMIT_TESTS=290 \
  TESTS="tests/test_ops_*.py tests/test_gpu_*.py tests/test_prefill_graphs.py tests/test_spec*.py tests/test_engine.py tests/test_pages.py tests/test_tree.py tests/test_policy.py" \
  bash bench/gpu_checks.sh $OUT tests > /dev/null 2>&1
cp $OUT/log.txt $OUT/suites.txt; rm $OUT/log.txt; grep -E "passed|failed|=== tests" $OUT/suites.txt | tail -4; grep -E "^FAILED|^ERROR" $OUT/suites.txt | head
export TRITON_CACHE_DIR=/tmp/triton-cache PYTHONUNBUFFERED=1
for tree in .old/head4a59 $PWD; do n=$(basename $tree)
  echo "=== [$(( $(date +%s) - T0 )) s] wave $n"; PYTHONPATH=$tree:/tmp/site timeout 80 python3 .old/prof_c64.py 64 128 cuda > $OUT/prof-$n.txt 2>&1; echo "exit $?"; grep "^rep 0" $OUT/prof-$n.txt
done
for tree in $PWD .old/430eac4; do n=$(basename $tree); len=; [ $tree = $PWD ] && len="--max-model-len 320"
  echo "=== [$(( $(date +%s) - T0 )) s] e2e $n"
  (cd $tree && PYTHONPATH=$PWD:/tmp/site timeout 60 python3 -m deltaflash bench e2e --workload demo --prompts 16 --concurrency 4 16 64 --no-profile --quiet $len --out /tmp/e2e-$n > /tmp/e2e-$n.txt 2>&1; echo "exit $?"; cp /tmp/e2e-$n/e2e-demo.json $OUT/e2e-$n.json)
done
left=$(( 545 - ($(date +%s) - T0) ))
echo "=== [$(( $(date +%s) - T0 )) s] attention tiles (limit $left s)"
PYTHONPATH=$PWD:/tmp/site timeout $left python3 -m deltaflash bench attention --max-model-len 262144 --contexts 32768 131072 --key-tiles 16:64:2 16:32:3 32:64:2 --json $OUT/attention.json > $OUT/attention.txt 2>&1; echo "exit $?"; tail -8 $OUT/attention.txt | cut -c1-600
echo "=== done $(( $(date +%s) - T0 )) s"
