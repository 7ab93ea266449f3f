# s43's device calls: bash docs/bench/cpu-s43/call.sh PART. On an H200: bench/h200_owed.sh PART (issues 15/16's owed
# figures, parts 1-3). On an H100, PART 1: chat turns that send the answer back (2048-token first prompt, 256-token
# answers, 128 new tokens a turn; HEAD, whose finished requests' states are kept, against the session's first tree
# in .out/old, with the cache on / off alternated in each); questions after one 8192-token system prompt, one by one
# and in a burst of eight; the Triton cache; the prefix-cache suite on CUDA. PART 2 (either card): bench model's TTFT
# table (64 to 32k tokens, transformers + fla-core beside, the compute limit).
PART=${1:-1}
name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $name; $(date -u)"  # (the device copy's git metadata is stale: no tree hash)
if [[ $PART == 2 ]]; then  # either card: issue 15's TTFT table alone (bench model, transformers + fla-core beside)
  LIMIT_TTFTTABLE=330 bash bench/gpu_checks.sh "$OUT" ttfttable; grep -vE "^\s*$|Warn|warn" $OUT/log.txt | tail -30
  exit
fi
if [[ $name == *H200* ]]; then exec bash bench/h200_owed.sh "$OUT" "$PART"; fi
if [[ $PART == 1 ]]; then
  checks() { bash bench/gpu_checks.sh "$OUT" "$@"; }
  TURNS_ARGS="--new 256 --repeats 2" LIMIT_ANSWERS=200 checks answers savecache
  grep -vE "^\s*$|Warn|warn" $OUT/log.txt | tail -6
  cp -r bench .out/old/ && ln -sfn ../../.whl .out/old/.whl && (cd .out/old && TURNS_ARGS="--new 256 --repeats 2" LIMIT_ANSWERS=120 \
    bash bench/gpu_checks.sh "$OUT/old" answers; grep -vE "^\s*$|Warn|warn" $OUT/old/log.txt | tail -5)
  TURNS_ARGS="--prompt-len 8192 --repeats 2" LIMIT_SYSTEM=100 FORKS_ARGS="--prompt-len 8192 --repeats 2" \
    LIMIT_BURST=100 checks system burst
  grep -vE "^\s*$|Warn|warn" $OUT/log.txt | tail -14
  DELTAFLASH_TEST_DEVICE=cuda PYTEST_ARGS="-n 8" LIMIT_TESTS=120 TESTS="tests/test_prefix_cache.py" checks tests
  grep -E "passed|failed|=== " $OUT/log.txt | tail -3
  exit
fi
echo "unknown part $PART"; exit 2
