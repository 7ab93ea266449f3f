#!/usr/bin/env bash
# session 18, call 2: verify blocks on 64-row mma.sync tiles in four warps (default now): GPU suites (the
# bits of a verify block's rows against decode rows alone), the attention table, flatness, long rounds,
# the step with and without round graphs
OUT=$1
T0=$(date +%s)
DELTAFLASH_TEST_DEVICE=cuda PYTEST_ARGS="-n 8 -p no:cacheprovider" LIMIT_TESTS=200 \
  TESTS="tests/test_ops_*.py tests/test_gpu_*.py tests/test_prefill_graphs.py tests/test_spec*.py tests/test_engine.py tests/test_pages.py tests/test_tree.py tests/test_policy.py" \
  bash bench/gpu_checks.sh $OUT tests > /dev/null 2>&1
grep -E "passed|failed|^FAILED|^ERROR|^=== " $OUT/log.txt | cut -c1-250 | tail -12
export TRITON_CACHE_DIR=/tmp/triton-cache PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
echo "=== [$(( $(date +%s) - T0 )) s] attention table"
timeout 110 python3 -m deltaflash bench attention --max-model-len 262144 --contexts 32768 131072 \
  --key-tiles 16:64:2:64:w8 64:64:3:64:v2:w4 64:32:2:64:v2:w4 16:64:2:64:dotsum:w4 --json $OUT/attention.json 2>&1 \
  | grep -v Warn | tail -7 | cut -c1-600
echo "=== [$(( $(date +%s) - T0 )) s] flatness"
timeout 150 python3 -m deltaflash bench round --lanes 1 16 --routes fused --rounds 8 --max-model-len 1024 32768 262144 \
  --json $OUT/round-paged.json 2>&1 | grep -v Warn | tail -8 | cut -c1-300
for ctx in 32768 131072; do
  echo "=== [$(( $(date +%s) - T0 )) s] round 16 lanes context $ctx unwritten"
  timeout 50 python3 -m deltaflash bench round --lanes 16 --routes fused --rounds 6 --prompt-len $ctx \
    --max-model-len $(( ctx + 256 )) --unwritten-context 2>&1 | tail -1 | cut -c1-300
done
for flag in "" --round-graphs; do
  echo "=== [$(( $(date +%s) - T0 )) s] step profile 8 lanes $flag"
  timeout 50 python3 bench/step_profile.py --lanes 8 --steps 60 $flag 2>&1 | grep -E "step wall|device busy|cudaGraphLaunch|cudaLaunchKernel" | head -4 | cut -c1-250
done
echo "=== done $(( $(date +%s) - T0 )) s"
