#!/usr/bin/env bash
# next session call A (prepared in session 15): GPU suites at HEAD; demo e2e at serve defaults, fixed vs adaptive; capacity
OUT=$1
T0=$(date +%s)
DELTAFLASH_TEST_DEVICE=cuda PYTEST_ARGS="-n 8 -p no:cacheprovider" LIMIT_TESTS=200 \
  TESTS="tests/test_ops_*.py tests/test_gpu_*.py tests/test_prefill_graphs.py tests/test_spec*.py tests/test_engine.py tests/test_pages.py tests/test_tree.py tests/test_policy.py" \
  bash bench/gpu_checks.sh $OUT tests > /dev/null 2>&1
cp $OUT/log.txt $OUT/suites.txt; rm $OUT/log.txt; grep -E "passed|failed|=== tests" $OUT/suites.txt | tail -3; grep -E "^FAILED|^ERROR" $OUT/suites.txt | head
export TRITON_CACHE_DIR=/tmp/triton-cache PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
for spec in fixed adaptive; do
  echo "=== [$(( $(date +%s) - T0 )) s] e2e serve defaults, speculation $spec"
  timeout 130 python3 -m deltaflash bench e2e --workload demo --prompts 16 --concurrency 1 4 16 64 --no-profile --quiet \
    --speculation $spec --out /tmp/e2e-$spec > $OUT/e2e-$spec.txt 2>&1; echo "exit $?"; tail -8 $OUT/e2e-$spec.txt | cut -c1-200
  cp /tmp/e2e-$spec/e2e-demo.json $OUT/e2e-$spec.json
done
left=$(( 570 - ($(date +%s) - T0) ))
echo "=== [$(( $(date +%s) - T0 )) s] capacity (limit $left)"
timeout $left python3 bench/capacity.py --json $OUT/capacity.json 2>&1 | tail -4
echo "=== done $(( $(date +%s) - T0 )) s"
