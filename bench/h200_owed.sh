#!/usr/bin/env bash
# The figures issues 15 and 16 still owe on the H200 (the forty-fourth session measured the rest: docs/benchmarks.md
# "H200, forty-fourth session"), in two device calls of under ten minutes each, sized for a fresh machine without a
# Triton cache. Each part's output lands in OUT (gpu_checks.sh's log.txt and JSON files).
#   bash bench/h200_owed.sh "$OUT" 1   # issue 16: the skinny GEMM table tuned on the H200 and the one-lane round with
#                                      # it (<= 1.5x the weight-read limit); then the Triton cache (copy
#                                      # OUT/triton-cache.tgz.part-* to .tcache/ and carry .tcache in the next calls)
#   bash bench/h200_owed.sh "$OUT" 2   # issue 15: bench model's TTFT table again (the long chunks' eager-or-graph rule
#                                      # of 035dc52: 8192 tokens took 315 ms at a64b103); the demo pair at every load
#                                      # (its C = 64 point ran one 44.5 ms eager prefill step); fla-core's launch
#                                      # configs on this card (no H200 table ships: fla-core autotunes there)
set -u
OUT=${1:?usage: bench/h200_owed.sh OUT PART}
PART=${2:?usage: bench/h200_owed.sh OUT PART (1 or 2)}
echo "card: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); $(date -u)"
checks() { bash bench/gpu_checks.sh "$OUT" "$@"; }
case $PART in
    1) SKINNY_ARGS="--quick --shapes 9b" LIMIT_SKINNY=120 LIMIT_SKINNYROUND=150 LIMIT_SKINNYPROFILE=60 checks skinny skinnyround
       checks savecache ;;
    2) LIMIT_TTFTTABLE=220 checks ttfttable
       LIMIT_DEMODEFAULT=150 checks demodefault
       LIMIT_TUNEFLA=200 checks tunefla ;;
    *) echo "unknown part $PART (1 or 2)"; exit 2 ;;
esac
grep -E "^=== " "$OUT/log.txt" | tail -8
