#!/usr/bin/env bash
# session 17, call 3: piece programs reverted + dead pieces return at once: attention / graph tests on CUDA,
# paged flatness, 16-lane rounds at 32k / 128k (unwritten), attention kernel table, graph launch costs,
# adaptive demo e2e in a steady state (last: may be cut by the session's device time)
OUT=$1
T0=$(date +%s)
DELTAFLASH_TEST_DEVICE=cuda PYTEST_ARGS="-n 8 -p no:cacheprovider" LIMIT_TESTS=110 LIMIT_PAGED=160 \
  TESTS="tests/test_ops_attention.py tests/test_gpu_graphs.py" bash bench/gpu_checks.sh $OUT tests paged > /dev/null 2>&1
grep -E "passed|failed|^FAILED|^=== |round/at|^ *[0-9]+ +[0-9]+ " $OUT/log.txt | cut -c1-200 | tail -12
export TRITON_CACHE_DIR=/tmp/triton-cache PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
for ctx in 32768 131072; do
  echo "=== [$(( $(date +%s) - T0 )) s] round 16 lanes context $ctx unwritten"
  timeout 60 python3 -m deltaflash bench round --lanes 16 --routes fused --rounds 6 --prompt-len $ctx \
    --max-model-len $(( ctx + 256 )) --unwritten-context 2>&1 | tail -1
done
echo "=== [$(( $(date +%s) - T0 )) s] attention"
timeout 70 python3 -m deltaflash bench attention --max-model-len 262144 --contexts 32768 131072 \
  --key-tiles 64:64:2:64:v2 2>&1 | tail -9
echo "=== [$(( $(date +%s) - T0 )) s] graph launch"
timeout 60 python3 bench/graph_launch.py --lanes 8 > $OUT/graph-launch.txt 2>&1; echo "exit $?"
grep -v Warn $OUT/graph-launch.txt | cut -c1-220 | tail -24
echo "=== [$(( $(date +%s) - T0 )) s] e2e steady state, adaptive"
timeout 300 python3 -m deltaflash bench e2e --workload demo --prompts 16 --requests 256 --concurrency 1 16 64 \
  --no-profile --quiet --speculation adaptive --out $OUT/e2e-adaptive > $OUT/e2e-adaptive.txt 2>&1; echo "exit $?"
grep -E "^(1|16|64) |spec_over|by round width" $OUT/e2e-adaptive.txt | cut -c1-330
echo "=== done $(( $(date +%s) - T0 )) s"
