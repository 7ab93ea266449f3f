#!/usr/bin/env bash
# session 18, call 1: full GPU suites at HEAD, the greedy round graphs' GPU test, a verify-block tile sweep
OUT=$1
T0=$(date +%s)
DELTAFLASH_TEST_DEVICE=cuda PYTEST_ARGS="-n 8 -p no:cacheprovider" LIMIT_TESTS=230 \
  TESTS="tests/test_ops_*.py tests/test_gpu_*.py tests/test_prefill_graphs.py tests/test_spec*.py tests/test_engine.py tests/test_pages.py tests/test_tree.py tests/test_policy.py" \
  bash bench/gpu_checks.sh $OUT tests > /dev/null 2>&1
grep -E "passed|failed|^FAILED|^ERROR|^=== " $OUT/log.txt | cut -c1-250 | tail -20
export TRITON_CACHE_DIR=/tmp/triton-cache PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
echo "=== [$(( $(date +%s) - T0 )) s] greedy round graphs test"
DELTAFLASH_TEST_DEVICE=cuda timeout 110 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_graphs.py -k greedy_round 2>&1 | tail -15 | cut -c1-300
echo "=== [$(( $(date +%s) - T0 )) s] attention verify-block tile sweep"
timeout 200 python3 -m deltaflash bench attention --max-model-len 262144 --contexts 32768 --lanes 16 --rows 16 \
  --key-tiles 64:64:2:64:v2 64:64:3:64:v2 64:32:3:64:v2 64:32:4:64:v2 64:64:2:64:v2:w4 64:32:3:64:v2:w4 \
  64:64:2:64:v2:w16 64:64:2:64 64:64:3:64 16:64:2:64:dotsum --json $OUT/sweep.json 2>&1 | grep -v Warn | tail -8 | cut -c1-900
echo "=== done $(( $(date +%s) - T0 )) s"
