#!/usr/bin/env bash
# session 14 call D: 16-row attention tiles for decode / verify (bits and speed), host split of a 64-lane decode step
OUT=$1
T0=$(date +%s)
DELTAFLASH_TEST_DEVICE=cuda PYTEST_ARGS="-n 8 -p no:cacheprovider" LIMIT_TESTS=200 \
  TESTS="tests/test_ops_attention.py tests/test_ops_gpu.py tests/test_spec.py tests/test_engine.py tests/test_tree.py" \
  bash bench/gpu_checks.sh $OUT tests > /dev/null 2>&1
mv $OUT/log.txt $OUT/tests.txt; grep -E "passed|failed|=== tests" $OUT/tests.txt | tail -3; grep -E "^FAILED|^ERROR" $OUT/tests.txt | head
export TRITON_CACHE_DIR=/tmp/triton-cache PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
echo "=== [$(( $(date +%s) - T0 )) s] attention"
timeout 150 python3 -m deltaflash bench attention --max-model-len 262144 --key-tiles 64:64:2 --json $OUT/attention.json > $OUT/attention.txt 2>&1; echo "exit $?"; tail -14 $OUT/attention.txt | cut -c1-300
echo "=== [$(( $(date +%s) - T0 )) s] split"
timeout 100 python3 .old/host_split.py 64 cuda 300 2>&1 | tail -22
echo "=== done $(( $(date +%s) - T0 )) s"
