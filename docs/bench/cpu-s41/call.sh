# s41's device calls: bash docs/bench/cpu-s41/call.sh PART. On an H200: bench/h200_owed.sh PART (issues 15/16's owed
# figures). On an H100, PART 1: the host path on the VM's CPU, then the prompt-logprob tests under their CUDA
# tolerance and the prompt-sharing forks' tests on CUDA; PART 2: the speculative and engine suites on CUDA (the
# session's forks run in every engine's warm-up and wherever a test repeats a prompt).
PART=${1:-1}
name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $name; $(date -u)"
if [[ $name == *H200* ]]; then exec bash bench/h200_owed.sh "$OUT" "$PART"; fi
if [[ $PART == 4 ]]; then  # the prefix cache on the 9B shape, then part 3
  bash bench/gpu_checks.sh $OUT turns; grep -vE "^\s*$|Warn|warn" $OUT/log.txt | tail -6
  PART=3
fi
if [[ $PART == 3 ]]; then  # the 2048-token TTFT's host parts with the collector frozen (means without GC pauses)
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
  export PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_DIR=/tmp/triton-cache
  mkdir -p $TRITON_CACHE_DIR && cat .tcache/triton-cache.tgz.part-* | tar xzf - -C $TRITON_CACHE_DIR
  timeout 200 python3 bench/step_profile.py --shape 9b --ttft 2048 --steps 16 --rows 8 --split --gc-freeze 2>&1 \
    | grep -v Warn | grep -A30 "TTFT by CUDA" | grep -v "^ *[0-9]* *[0-9.]* *[a-z_]*kernel\|nvjet\|cudnn" | head -40
  exit
fi
if [[ $PART == 2 ]]; then
  PYTEST_ARGS="-n 8" LIMIT_SPEC=500 bash bench/gpu_checks.sh $OUT spec
  grep -E "passed|failed|=== " $OUT/log.txt | tail -3
  exit
fi
CUDA_VISIBLE_DEVICES= PYTHONPATH=$PWD timeout 60 python3 bench/host_path.py --requests 200 2>&1 | tail -3 | tee $OUT/host-path.txt
DELTAFLASH_TEST_DEVICE=cuda PYTEST_ARGS="-n 8" LIMIT_TESTS=240 TESTS="tests/test_prompt_logprobs.py tests/test_shares.py" \
  bash bench/gpu_checks.sh $OUT tests
grep -E "passed|failed|=== " $OUT/log.txt | tail -3
