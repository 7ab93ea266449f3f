#!/usr/bin/env bash
# session 14 call E: tiles by rows (16 for a decode row, 64 for a verify block): bits on the GPU, then the attention table
OUT=$1
T0=$(date +%s)
DELTAFLASH_TEST_DEVICE=cuda PYTEST_ARGS="-n 8 -p no:cacheprovider" LIMIT_TESTS=120 TESTS="tests/test_ops_attention.py" \
  bash bench/gpu_checks.sh $OUT tests > /dev/null 2>&1
mv $OUT/log.txt $OUT/tests.txt; grep -E "passed|failed|=== tests" $OUT/tests.txt | tail -3; grep -E "^FAILED|^ERROR|Mismatch|assert" $OUT/tests.txt | head
export TRITON_CACHE_DIR=/tmp/triton-cache PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
echo "=== [$(( $(date +%s) - T0 )) s] attention"
timeout 100 python3 -m deltaflash bench attention --max-model-len 262144 --json $OUT/attention.json > $OUT/attention.txt 2>&1; echo "exit $?"; tail -14 $OUT/attention.txt | cut -c1-200
echo "=== done $(( $(date +%s) - T0 )) s"
