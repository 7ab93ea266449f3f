#!/usr/bin/env bash
# session 15 call A: GPU suites at HEAD; a 64-lane target-only wave HEAD vs 430eac4; host split at 64 lanes
OUT=$1
T0=$(date +%s)
DELTAFLASH_TEST_DEVICE=cuda PYTEST_ARGS="-n 8 -p no:cacheprovider" LIMIT_TESTS=280 \
  TESTS="tests/test_ops_*.py tests/test_gpu_*.py tests/test_prefill_graphs.py tests/test_spec*.py tests/test_engine.py tests/test_pages.py tests/test_tree.py tests/test_policy.py" \
  bash bench/gpu_checks.sh $OUT tests > /dev/null 2>&1
cp $OUT/log.txt $OUT/suites.txt; rm $OUT/log.txt; grep -E "passed|failed|=== tests" $OUT/suites.txt | tail -4; grep -E "^FAILED|^ERROR" $OUT/suites.txt | head
export TRITON_CACHE_DIR=/tmp/triton-cache PYTHONUNBUFFERED=1
for tree in .old/430eac4 $PWD; do n=$(basename $tree)
  echo "=== [$(( $(date +%s) - T0 )) s] wave $n"; PYTHONPATH=$tree:/tmp/site timeout 90 python3 .old/prof_c64.py 64 128 cuda > $OUT/prof-$n.txt 2>&1; echo "exit $?"; grep "^rep 0" $OUT/prof-$n.txt
done
echo "=== [$(( $(date +%s) - T0 )) s] split"
PYTHONPATH=$PWD:/tmp/site timeout 90 python3 .old/host_split.py 64 cuda 300 2>&1 | tail -22
echo "=== done $(( $(date +%s) - T0 )) s"
