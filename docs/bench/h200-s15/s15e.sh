#!/usr/bin/env bash
# session 15 call E: 16-row sub-tiles: attention bits and losslessness on CUDA; attention bench new vs old tiles
OUT=$1
T0=$(date +%s)
DELTAFLASH_TEST_DEVICE=cuda PYTEST_ARGS="-n 8 -p no:cacheprovider" LIMIT_TESTS=170 \
  TESTS="tests/test_ops_attention.py tests/test_spec.py tests/test_tree.py tests/test_gpu_graphs.py" bash bench/gpu_checks.sh $OUT tests > /dev/null 2>&1
cp $OUT/log.txt $OUT/tests.txt; rm $OUT/log.txt; grep -E "passed|failed|=== tests" $OUT/tests.txt | tail -3; grep -E "^FAILED|^ERROR" $OUT/tests.txt | head
export TRITON_CACHE_DIR=/tmp/triton-cache PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
left=$(( 330 - ($(date +%s) - T0) ))
echo "=== [$(( $(date +%s) - T0 )) s] attention (limit $left)"
timeout $left python3 -m deltaflash bench attention --max-model-len 262144 --contexts 32768 131072 --key-tiles 64:64:2 16:64:2:32 --json $OUT/attention.json > $OUT/attention.txt 2>&1; echo "exit $?"; tail -12 $OUT/attention.txt | cut -c1-400
echo "=== done $(( $(date +%s) - T0 )) s"
