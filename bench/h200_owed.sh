#!/usr/bin/env bash
# The figures issues 15 and 16 still owe on the H200, in three device calls of under ten minutes each, sized for a
# fresh machine without a Triton cache (the first e2e compiles every kernel: over 150 s on the thirty-sixth
# session's H100). Each part's output lands in OUT (gpu_checks.sh's log.txt and JSON files).
#   bash bench/h200_owed.sh "$OUT" 1   # issue 16: scripted tau 6 at every load; the skinny table and the one-lane
#                                      # round with it; then the Triton cache (copy OUT/triton-cache.tgz.part-* to
#                                      # .tcache/ and carry .tcache in the next calls)
#   bash bench/h200_owed.sh "$OUT" 2   # issue 15: bench model's TTFT table; 2048-token prompts at C = 8 / 32; the demo
#                                      # pair at every load (issue 16 too)
#   bash bench/h200_owed.sh "$OUT" 3   # issue 16: tau 3, a useless drafter; fla-core's launch configs on this card
set -u
OUT=${1:?usage: bench/h200_owed.sh OUT PART}
PART=${2:?usage: bench/h200_owed.sh OUT PART (1, 2 or 3)}
echo "card: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); $(date -u)"
checks() { bash bench/gpu_checks.sh "$OUT" "$@"; }
case $PART in
    1) SPECULATION=adaptive TAUS=6 LIMIT_E2ETAU=280 checks e2etau
       SKINNY_ARGS="--quick --shapes 9b" LIMIT_SKINNY=80 LIMIT_SKINNYROUND=150 LIMIT_SKINNYPROFILE=60 checks skinny skinnyround
       checks savecache ;;
    2) checks ttfttable
       ITL_CONCURRENCY="8 32" LIMIT_ITL2K=150 checks itl2k demodefault ;;
    3) SPECULATION=adaptive TAUS=3 LIMIT_E2ETAU=150 LIMIT_RANDOMDRAFT=150 checks e2etau randomdraft
       LIMIT_TUNEFLA=200 checks tunefla ;;
    *) echo "unknown part $PART (1, 2 or 3)"; exit 2 ;;
esac
grep -E "^=== " "$OUT/log.txt" | tail -8
