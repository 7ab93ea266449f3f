# (PART 1 ran at a64b103: bench/prefill_halves.py and step_profile --pipelined-prefill existed there; reverted after
# the measurement - two-stream halves did not pay, docs/benchmarks.md "H200, forty-fourth session".)
# s44's device calls: bash docs/bench/cpu-s44/call.sh PART. On an H200: bench/h200_owed.sh PART (issues 15/16's owed
# figures, parts 1-3: call them as 2-4) but PART 1. PART 1 (either card): a 2048-token prefill as two halves
# pipelined on two streams against the whole prompt's forward and the halves one after another
# (bench/prefill_halves.py), a probe of kernels hiding under GEMMs on a second stream
# (docs/bench/cpu-s44/overlap.py), the engine's 2048-token TTFT with --pipelined-prefill off / on.
# On an H100: PART 2: the prefill-graph (pipelined halves among them), prefix-cache and sharing suites on CUDA, then
# bench model's TTFT table with the prefix cache off (s43's table timed cache hits from 1024 tokens). PART 3: a
# request with a prompt of its own arriving behind a burst of questions waiting for their branch point (HEAD against
# s43's first tree in .out/old, which queued it behind them).
PART=${1:-1}
name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $name; $(date -u)"  # (the device copy's git metadata is stale: no tree hash)
if [[ $name == *H200* && $PART != 1 ]]; then exec bash bench/h200_owed.sh "$OUT" "$((PART - 1))"; fi
checks() { bash bench/gpu_checks.sh "$OUT" "$@"; }
show() { grep -vE "^\s*$|Warn|warn" "$@" | tail -${TAIL:-12}; }
if [[ $PART == 1 ]]; then
  bash bench/gpu_checks.sh "$OUT"  # (no step: installs the carried wheels into /tmp/site, unpacks the Triton cache)
  export PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_DIR=/tmp/triton-cache
  timeout 150 python3 bench/prefill_halves.py --tokens 2048 --reps 8 2>&1 | grep -v arn | tee -a $OUT/halves.txt
  timeout 60 python3 docs/bench/cpu-s44/overlap.py 2>&1 | grep -v arn | tee $OUT/overlap.txt
  for flag in "" --pipelined-prefill; do  # the engine's TTFT at the serve defaults, halves off / on
    timeout 130 python3 bench/step_profile.py --shape 9b --ttft 2048 --steps 6 $flag 2>&1 | grep -v arn | \
      tee -a $OUT/ttft.txt | grep -E "TTFT|p50|busy" | head -4
  done
  [[ $name == *H200* ]] && checks savecache
  exit
fi
if [[ $PART == 2 ]]; then
  DELTAFLASH_TEST_DEVICE=cuda PYTEST_ARGS="-n 8" LIMIT_TESTS=240 \
    TESTS="tests/test_prefill_graphs.py tests/test_prefix_cache.py tests/test_shares.py" checks tests
  grep -E "passed|failed|=== " $OUT/log.txt | tail -3
  LIMIT_TTFTTABLE=300 checks ttfttable; TAIL=24 show $OUT/log.txt
  exit
fi
if [[ $PART == 3 ]]; then
  FORKS_ARGS="--prompt-len 8192 --repeats 2" LIMIT_OTHERS=200 checks others; show $OUT/log.txt
  cp -r bench .out/old/ && ln -sfn ../../.whl .out/old/.whl && ln -sfn ../../.tcache .out/old/.tcache && \
    (cd .out/old && FORKS_ARGS="--prompt-len 8192 --repeats 2" LIMIT_OTHERS=200 bash bench/gpu_checks.sh "$OUT/old" others; \
     show $OUT/old/log.txt)
  exit
fi
echo "unknown part $PART"; exit 2
