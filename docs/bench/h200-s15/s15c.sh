#!/usr/bin/env bash
# session 15 call C: the decode-graph test; first requests of `deltaflash serve`; the serve-default e2e sweep
OUT=$1
T0=$(date +%s)
DELTAFLASH_TEST_DEVICE=cuda PYTEST_ARGS="-n 4 -p no:cacheprovider" LIMIT_TESTS=150 \
  TESTS="tests/test_gpu_graphs.py" bash bench/gpu_checks.sh $OUT tests > /dev/null 2>&1
cp $OUT/log.txt $OUT/tests.txt; rm $OUT/log.txt; grep -E "passed|failed|=== tests" $OUT/tests.txt | tail -3; grep -E "^FAILED|^ERROR|^E  " $OUT/tests.txt | head
export TRITON_CACHE_DIR=/tmp/triton-cache PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
echo "=== [$(( $(date +%s) - T0 )) s] split"; timeout 60 python3 .old/host_split.py 64 cuda 300 2>&1 | tail -16
echo "=== [$(( $(date +%s) - T0 )) s] first"; timeout 200 python3 bench/first_requests.py --out $OUT/first.json > $OUT/first.txt 2>&1; echo "exit $?"; tail -15 $OUT/first.txt
left=$(( 560 - ($(date +%s) - T0) ))
echo "=== [$(( $(date +%s) - T0 )) s] e2e serve defaults (limit $left)"
timeout $left python3 -m deltaflash bench e2e --workload demo --prompts 16 --concurrency 1 4 16 64 --no-profile --quiet --out /tmp/e2e-sd > $OUT/e2e-sd.txt 2>&1; echo "exit $?"; tail -14 $OUT/e2e-sd.txt | cut -c1-220; cp /tmp/e2e-sd/e2e-demo.json $OUT/e2e-serve-defaults.json
echo "=== done $(( $(date +%s) - T0 )) s"
