# s44's device calls: bash docs/bench/cpu-s44/call.sh PART. On an H200: bench/h200_owed.sh PART (issues 15/16's owed
# figures, parts 1-3). On an H100, PART 1: bench model's TTFT table with the prefix cache off (s43's table timed cache
# hits from 1024 tokens), then a probe of kernels hiding under GEMMs on a second stream
# (docs/bench/cpu-s44/overlap.py), then the prefix-cache and sharing suites on CUDA at this tree. PART 2: a request with a prompt
# of its own arriving behind a burst of questions waiting for their branch point (HEAD against s43's first tree in
# .out/old, which queued it behind them).
PART=${1:-1}
name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $name; $(date -u)"  # (the device copy's git metadata is stale: no tree hash)
if [[ $name == *H200* ]]; then exec bash bench/h200_owed.sh "$OUT" "$PART"; fi
checks() { bash bench/gpu_checks.sh "$OUT" "$@"; }
if [[ $PART == 1 ]]; then
  LIMIT_TTFTTABLE=300 checks ttfttable; grep -vE "^\s*$|Warn|warn" $OUT/log.txt | tail -24
  PYTHONPATH=/tmp/site timeout 90 python3 docs/bench/cpu-s44/overlap.py 2>&1 | grep -v arn | tee $OUT/overlap.txt
  DELTAFLASH_TEST_DEVICE=cuda PYTEST_ARGS="-n 8" LIMIT_TESTS=150 TESTS="tests/test_prefix_cache.py tests/test_shares.py" checks tests
  grep -E "passed|failed|=== " $OUT/log.txt | tail -3
  exit
fi
if [[ $PART == 2 ]]; then
  FORKS_ARGS="--prompt-len 8192 --repeats 2" LIMIT_OTHERS=200 checks others
  grep -vE "^\s*$|Warn|warn" $OUT/log.txt | tail -10
  cp -r bench .out/old/ && ln -sfn ../../.whl .out/old/.whl && ln -sfn ../../.tcache .out/old/.tcache && \
    (cd .out/old && FORKS_ARGS="--prompt-len 8192 --repeats 2" LIMIT_OTHERS=200 bash bench/gpu_checks.sh "$OUT/old" others; \
     grep -vE "^\s*$|Warn|warn" $OUT/old/log.txt | tail -10)
  exit
fi
echo "unknown part $PART"; exit 2
