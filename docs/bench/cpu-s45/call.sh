# The forty-fifth session had no device (loans paused): what it owes, for the next session's calls.
#   bash docs/bench/cpu-s45/call.sh PART   (OUT set by the device tool; carry [".whl", ".out", ".tcache"])
# PART 1 (either card): the suites that exercise this session's code on CUDA - the plan's graph choice
# (StepPlan.prefill_graph, ea63c2f), the eager cost timed with the draft context's append (5ca6853), logits of the
# sampled rows alone (f692a04; prompt logprobs' path too), the padded-graph and long-chunk rules of s44 (035dc52,
# 49d5008) - then, on an H200, the Triton cache for the next calls.
# PART 2 / 3: on an H200, bench/h200_owed.sh 1 / 2 (issue 16's skinny table and one-lane round; issue 15's TTFT
# table, the demo pair at every load - its JSON now names each slow eager step's chunks and the engine's eager cost -
# and fla-core's configs on the H200). On an H100, PART 2: the demo pair at every load and the TTFT table.
# PART 4 (either card): 2048-token prompts at C = 8 (issue 15's ITL p99 / p50), HEAD - whose prefill steps project
# only the rows that sample a token to logits - against 5ca6853 (exported to .out/s45-base: lm_head in every prefill
# step), same call: the steps whose chunks end no prompt should be ~0.5 ms shorter on the 9B shape. (To export it
# again: mkdir -p .out/s45-base && git archive 5ca6853 deltaflash bench ':(exclude)deltaflash/assets' | tar -x -C
# .out/s45-base)
PART=${1:-1}
name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $name; $(date -u)"
checks() { bash bench/gpu_checks.sh "$OUT" "$@"; }
if [[ $PART == 1 ]]; then
  DELTAFLASH_TEST_DEVICE=cuda PYTEST_ARGS="-n 8" LIMIT_TESTS=420 TESTS="tests/test_prefill_graphs.py tests/test_engine.py \
    tests/test_prefix_cache.py tests/test_shares.py tests/test_prompt_logprobs.py" checks tests
  grep -E "passed|failed|=== " "$OUT/log.txt" | tail -3
  [[ $name == *H200* ]] && checks savecache
  exit 0
fi
if [[ $PART == 4 ]]; then
  ITL_CONCURRENCY=8 LIMIT_ITL2K=240 checks itl2k
  (cd .out/s45-base && ln -sfn ../../.whl .whl && ln -sfn ../../.tcache .tcache && \
     ITL_CONCURRENCY=8 LIMIT_ITL2K=240 bash bench/gpu_checks.sh "$OUT/base" itl2k)
  for f in "$OUT"/itl2k-*/e2e-scripted.json "$OUT"/base/itl2k-*/e2e-scripted.json; do
    python3 -c "import json, sys; d = json.load(open(sys.argv[1])); print(sys.argv[1]); [print(' ', p['mode'],
      round(p['tokens_per_s']), 'ITL p50/p99', round(p['itl_p50_ms'], 2), round(p['itl_p99_ms'], 2), 'prefill step p50',
      p['prefill_steps']['step_p50_ms']) for p in d['points']]" "$f"
  done
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
