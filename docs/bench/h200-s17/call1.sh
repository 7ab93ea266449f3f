#!/usr/bin/env bash
# prepared in session 16 for the next session's first call: GPU suites at HEAD (the attention's piece programs,
# the chain commit before the read, the drafter's fused norms / RoPE), paged flatness, demo e2e in a steady state
# fixed vs adaptive, a speculative step's profile
OUT=$1
T0=$(date +%s)
DELTAFLASH_TEST_DEVICE=cuda PYTEST_ARGS="-n 8 -p no:cacheprovider" LIMIT_TESTS=200 LIMIT_PAGED=170 \
  TESTS="tests/test_ops_*.py tests/test_gpu_*.py tests/test_prefill_graphs.py tests/test_spec*.py tests/test_engine.py tests/test_pages.py tests/test_tree.py tests/test_policy.py" \
  bash bench/gpu_checks.sh $OUT tests paged > /dev/null 2>&1
grep -E "passed|failed|^FAILED|^ERROR|^=== |round/at|^ *[0-9]+ +[0-9]+ " $OUT/log.txt | cut -c1-200 | tail -24
export TRITON_CACHE_DIR=/tmp/triton-cache PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
for spec in adaptive fixed; do
  echo "=== [$(( $(date +%s) - T0 )) s] e2e steady state, speculation $spec"
  timeout $([ $spec = adaptive ] && echo 135 || echo 110) python3 -m deltaflash bench e2e --workload demo --prompts 16 --requests 256 --concurrency 1 16 64 \
    --no-profile --quiet --speculation $spec --out /tmp/e2e-$spec > $OUT/e2e-$spec.txt 2>&1; echo "exit $?"
  grep -E "^(1|16|64) |spec_over|by round width" $OUT/e2e-$spec.txt | cut -c1-330
done
left=$(( 570 - ($(date +%s) - T0) ))
echo "=== [$(( $(date +%s) - T0 )) s] step profile, 8 lanes spec (limit $left)"
timeout $left python3 bench/step_profile.py --lanes 8 --steps 60 > $OUT/profile8.txt 2>&1
grep -E "step wall|device busy" $OUT/profile8.txt | head -3
echo "=== done $(( $(date +%s) - T0 )) s"
