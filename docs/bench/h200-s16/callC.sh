#!/usr/bin/env bash
# session 16 call C: attention GPU tests after the combine change; paged flatness rerun; demo e2e in a steady state
# (256 requests per point) with fixed and adaptive widths; where a spec step's time goes at 16 lanes
OUT=$1
T0=$(date +%s)
DELTAFLASH_TEST_DEVICE=cuda PYTEST_ARGS="-n 8 -p no:cacheprovider" LIMIT_TESTS=150 \
  TESTS="tests/test_ops_attention.py tests/test_gpu_graphs.py tests/test_gpu_target.py" \
  LIMIT_PAGED=190 bash bench/gpu_checks.sh $OUT tests paged > /dev/null 2>&1
grep -E "passed|failed|^FAILED|^ERROR|^=== |round/at|^ *[0-9]+ +[0-9]+ " $OUT/log.txt | cut -c1-200 | tail -24
export TRITON_CACHE_DIR=/tmp/triton-cache PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
for spec in fixed adaptive; do
  echo "=== [$(( $(date +%s) - T0 )) s] e2e steady state, speculation $spec"
  timeout 110 python3 -m deltaflash bench e2e --workload demo --prompts 16 --requests 256 --concurrency 16 64 \
    --no-profile --quiet --speculation $spec --out /tmp/e2e-$spec > $OUT/e2e-$spec.txt 2>&1; echo "exit $?"
  grep -E "^(16|64) |spec_over|by round width" $OUT/e2e-$spec.txt | cut -c1-330
done
left=$(( 560 - ($(date +%s) - T0) ))
echo "=== [$(( $(date +%s) - T0 )) s] step profile, 16 lanes spec (limit $left)"
timeout $left python3 bench/step_profile.py --lanes 16 --steps 60 --rows 24 > $OUT/profile16.txt 2>&1
head -c 5000 $OUT/profile16.txt | tail -c 2500
echo "=== done $(( $(date +%s) - T0 )) s"
