# s43's device calls: bash docs/bench/cpu-s43/call.sh PART. On an H200: bench/h200_owed.sh PART (issues 15/16's owed
# figures, parts 1-3). On an H100, PART 1: questions after one 8192-token system prompt, one by one and in a burst of
# eight (the prefix cache's branch points at a long system prompt, cache on / off alternated), then the Triton cache.
PART=${1:-1}
name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $name; $(date -u)"  # (the device copy's git metadata is stale: no tree hash)
if [[ $name == *H200* ]]; then exec bash bench/h200_owed.sh "$OUT" "$PART"; fi
if [[ $PART == 1 ]]; then
  TURNS_ARGS="--prompt-len 8192 --repeats 2" LIMIT_SYSTEM=200 FORKS_ARGS="--prompt-len 8192 --repeats 2" LIMIT_BURST=240 \
    bash bench/gpu_checks.sh $OUT system burst savecache
  grep -vE "^\s*$|Warn|warn" $OUT/log.txt | tail -24
  exit
fi
echo "unknown part $PART"; exit 2
