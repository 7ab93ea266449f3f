# The forty-fifth session had no device (loans paused): what it owes, for the next session's calls.
#   bash docs/bench/cpu-s45/call.sh PART   (OUT set by the device tool; carry [".whl", ".out", ".tcache"])
# PART 1 (either card): the suites that exercise this session's code on CUDA - the plan's graph choice
# (StepPlan.prefill_graph, ea63c2f), the eager cost timed with the draft context's append (5ca6853), the padded-graph
# and long-chunk rules of s44 (035dc52, 49d5008) - then, on an H200, the Triton cache for the next calls.
# PART 2 / 3: on an H200, bench/h200_owed.sh 1 / 2 (issue 16's skinny table and one-lane round; issue 15's TTFT
# table, the demo pair at every load - its JSON now names each slow eager step's chunks and the engine's eager cost -
# and fla-core's configs on the H200). On an H100, PART 2: the demo pair at every load and the TTFT table.
PART=${1:-1}
name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $name; $(date -u)"
checks() { bash bench/gpu_checks.sh "$OUT" "$@"; }
if [[ $PART == 1 ]]; then
  DELTAFLASH_TEST_DEVICE=cuda PYTEST_ARGS="-n 8" LIMIT_TESTS=300 \
    TESTS="tests/test_prefill_graphs.py tests/test_engine.py tests/test_prefix_cache.py tests/test_shares.py" checks tests
  grep -E "passed|failed|=== " "$OUT/log.txt" | tail -3
  [[ $name == *H200* ]] && checks savecache
  exit 0
fi
if [[ $name == *H200* ]]; then exec bash bench/h200_owed.sh "$OUT" "$((PART - 1))"; fi
if [[ $PART == 2 ]]; then
  LIMIT_DEMODEFAULT=150 checks demodefault
  LIMIT_TTFTTABLE=300 checks ttfttable
  grep -E "=== " "$OUT/log.txt" | tail -4
  exit 0
fi
echo "unknown part $PART"; exit 2
