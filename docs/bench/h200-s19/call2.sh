#!/usr/bin/env bash
# session 19, call 2: GPU suites with the decode tile in four warps; bits of a block's rows vs rows alone; the
# attention table at the new default; scripted tau 6 e2e at the serve defaults (HEAD; 430eac4 in call 3)
OUT=$1
T0=$(date +%s)
DELTAFLASH_TEST_DEVICE=cuda PYTEST_ARGS="-n 8 -p no:cacheprovider" LIMIT_TESTS=200 \
  TESTS="tests/test_ops_*.py tests/test_gpu_*.py tests/test_prefill_graphs.py tests/test_spec*.py tests/test_engine.py tests/test_pages.py tests/test_tree.py tests/test_policy.py" \
  bash bench/gpu_checks.sh $OUT tests > /dev/null 2>&1
mv $OUT/log.txt $OUT/suites.txt
grep -E "passed|failed|^FAILED|^ERROR|^=== " $OUT/suites.txt | cut -c1-250 | tail -12
export TRITON_CACHE_DIR=/tmp/triton-cache PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
echo "=== [$(( $(date +%s) - T0 )) s] bits"
timeout 40 python3 .old/bits18.py 2>&1 | grep -v Warn | tail -4
echo "=== [$(( $(date +%s) - T0 )) s] attention table"
timeout 60 python3 -m deltaflash bench attention --max-model-len 262144 --contexts 32768 131072 \
  --json $OUT/attention.json > $OUT/attention.txt 2>&1; echo "exit $?"
grep -v Warn $OUT/attention.txt | tail -9 | cut -c1-300
echo "=== [$(( $(date +%s) - T0 )) s] e2e scripted tau 6, HEAD, serve defaults"
timeout $(( 570 - $(date +%s) + T0 )) python3 -m deltaflash bench e2e --workload scripted --tau 6 --prompts 16 \
  --concurrency 1 4 16 64 --no-profile --quiet --out $OUT/e2e-head > $OUT/e2e-head.txt 2>&1; echo "exit $?"
grep -v Warn $OUT/e2e-head.txt | tail -14 | cut -c1-330
echo "=== done $(( $(date +%s) - T0 )) s"
