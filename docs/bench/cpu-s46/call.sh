# The forty-sixth session's device calls (carry [".whl", ".out", ".tcache"]):
#   bash docs/bench/cpu-s46/call.sh PART
# PART 1: docs/bench/cpu-s45/call.sh 1 (the CUDA suites of s44 / s45's code; the Triton cache on an H200).
# PART 2: issue 15's streams and the demo pair: 2048-token prompts at C = 8 and 32 with the default budget (512) and
#   with 384 - a shape of its own since this session (graphs.prefill_shapes), where it padded to 512 before; then,
#   as the ten minutes allow, the demo pair at every load, part 5 and at C = 8 the tree of 5ca6853 (.out/s45-base: lm_head
#   in every prefill step) at 512.
# PART 3: the demo pair at every load (issue 16's C = 64 point) and the TTFT table (issue 15).
# PART 4: bench/h200_owed.sh 1 on an H200 (the skinny table and the one-lane round).
# PART 5: bench/stream_overlap.py: a 512 / 256-row prefill graph and the decode graph one after the other and on
#   two streams (whether a step's chunk and round should overlap).
PART=${1:-1}
name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $name; $(date -u)"
checks() { bash bench/gpu_checks.sh "$OUT" "$@"; }
summary() {
  for f in "$@"; do
    python3 -c "import json, sys; d = json.load(open(sys.argv[1])); print(sys.argv[1]); [print(' ', p['concurrency'],
      p['mode'], round(p['tokens_per_s']), 'ITL p50/p90/p99', round(p['itl_p50_ms'], 2), round(p['itl_p90_ms'], 2),
      round(p['itl_p99_ms'], 2), 'gap p99/p50', round(p['gap_p99_ms'] / p['gap_p50_ms'], 2), 'prefill step p50',
      p['prefill_steps']['step_p50_ms'], 'TTFT p50', round(p['ttft_p50_ms'], 1)) for p in d['points']]" "$f"
  done
}
case $PART in
  1) exec bash docs/bench/cpu-s45/call.sh 1 ;;
  2) ITL_BUDGETS="512 384" ITL_CONCURRENCY=${ITL_CONCURRENCY:-8 32} LIMIT_ITL2K=150 checks itl2k
     summary "$OUT"/itl2k-*/e2e-scripted.json
     # then, as the call allows (DEADLINE: its limit): part 5, the demo pair (part 3), the lm_head comparison
     end=${DEADLINE:-580}  # (the call's limit, seconds)
     (( SECONDS < end - 100 )) && LIMIT_STREAMOVERLAP=90 checks streamoverlap
     (( SECONDS < end - 160 )) && LIMIT_DEMODEFAULT=150 checks demodefault
     (( SECONDS < end - 110 )) && (cd .out/s45-base && ln -sfn ../../.whl .whl && ln -sfn ../../.tcache .tcache && \
        ITL_CONCURRENCY=8 LIMIT_ITL2K=100 bash bench/gpu_checks.sh "$OUT/base" itl2k)
     summary "$OUT"/base/itl2k-*/e2e-scripted.json 2>/dev/null
     grep -E "^=== " "$OUT/log.txt" | tail -8 ;;
  3) LIMIT_DEMODEFAULT=150 checks demodefault
     LIMIT_TTFTTABLE=200 checks ttfttable
     grep -E "^=== " "$OUT/log.txt" | tail -8 ;;
  4) [[ $name == *H200* ]] && exec bash bench/h200_owed.sh "$OUT" 1
     echo "not an H200: the skinny table is the H200's" ;;
  5) checks streamoverlap; grep -E "rows|engine" "$OUT/log.txt" | tail -6 ;;
  *) echo "unknown part $PART"; exit 2 ;;
esac
