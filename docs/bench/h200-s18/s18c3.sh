#!/usr/bin/env bash
# session 18, call 3: one row tile per program, committed key tiles unmasked first, K/V offsets shared, page size
# a constant: GPU suites, bits one-pass vs default, attention table (both), flatness, long rounds, step profiles
OUT=$1
T0=$(date +%s)
DELTAFLASH_TEST_DEVICE=cuda PYTEST_ARGS="-n 8 -p no:cacheprovider" LIMIT_TESTS=200 \
  TESTS="tests/test_ops_*.py tests/test_gpu_*.py tests/test_prefill_graphs.py tests/test_spec*.py tests/test_engine.py tests/test_pages.py tests/test_tree.py tests/test_policy.py" \
  bash bench/gpu_checks.sh $OUT tests > /dev/null 2>&1
grep -E "passed|failed|^FAILED|^ERROR|^=== " $OUT/log.txt | cut -c1-250 | tail -12
export TRITON_CACHE_DIR=/tmp/triton-cache PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
echo "=== [$(( $(date +%s) - T0 )) s] bits"
timeout 60 python3 .old/bits18.py 2>&1 | grep -v Warn | tail -4
echo "=== [$(( $(date +%s) - T0 )) s] attention table"
timeout 100 python3 -m deltaflash bench attention --max-model-len 262144 --contexts 32768 131072 \
  --key-tiles 64:64:2:v2:w4:onepass 16:64:2:dotsum:onepass --json $OUT/attention.json > $OUT/attention.txt 2>&1
grep -v Warn $OUT/attention.txt | tail -8 | cut -c1-400
echo "=== [$(( $(date +%s) - T0 )) s] flatness"
timeout 150 python3 -m deltaflash bench round --lanes 1 16 --routes fused --rounds 8 --max-model-len 1024 32768 262144 \
  --json $OUT/round-paged.json 2>&1 | grep -v Warn | tail -7 | cut -c1-300
for ctx in 32768 131072; do
  echo "=== [$(( $(date +%s) - T0 )) s] round 16 lanes context $ctx unwritten"
  timeout 50 python3 -m deltaflash bench round --lanes 16 --routes fused --rounds 6 --prompt-len $ctx \
    --max-model-len $(( ctx + 256 )) --unwritten-context 2>&1 | tail -1 | cut -c1-300
done
for flag in "" --round-graphs; do
  echo "=== [$(( $(date +%s) - T0 )) s] step profile 8 lanes $flag"
  timeout 45 python3 bench/step_profile.py --lanes 8 --steps 60 $flag > $OUT/step$flag.txt 2>&1; echo "exit $?"
  grep -v Warn $OUT/step$flag.txt | grep -iE "wall|busy|GraphLaunch|LaunchKernel" | head -5 | cut -c1-250
done
echo "=== done $(( $(date +%s) - T0 )) s"
