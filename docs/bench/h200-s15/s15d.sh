#!/usr/bin/env bash
# session 15 call D: every GPU suite at HEAD; host split at 64 lanes
OUT=$1
T0=$(date +%s)
DELTAFLASH_TEST_DEVICE=cuda PYTEST_ARGS="-n 8 -p no:cacheprovider" LIMIT_TESTS=250 \
  TESTS="tests/test_ops_*.py tests/test_gpu_*.py tests/test_prefill_graphs.py tests/test_spec*.py tests/test_engine.py tests/test_pages.py tests/test_tree.py tests/test_policy.py" \
  bash bench/gpu_checks.sh $OUT tests > /dev/null 2>&1
cp $OUT/log.txt $OUT/suites.txt; rm $OUT/log.txt; grep -E "passed|failed|=== tests" $OUT/suites.txt | tail -4; grep -E "^FAILED|^ERROR" $OUT/suites.txt | head
export TRITON_CACHE_DIR=/tmp/triton-cache PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
echo "=== [$(( $(date +%s) - T0 )) s] split"; timeout 100 python3 .old/host_split.py 64 cuda 300 > $OUT/split.txt 2>&1; echo "exit $?"; tail -18 $OUT/split.txt
echo "=== done $(( $(date +%s) - T0 )) s"
