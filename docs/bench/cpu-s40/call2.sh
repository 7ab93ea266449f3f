# s40's second call (H100, what the first left): the host path on the machine's CPU, then the prompt-logprob tests
# with the CUDA tolerance.
CUDA_VISIBLE_DEVICES= PYTHONPATH=$PWD timeout 60 python3 bench/host_path.py --requests 200 2>&1 | tail -3 | tee $OUT/host-path.txt
DELTAFLASH_TEST_DEVICE=cuda PYTEST_ARGS="-n 8" LIMIT_TESTS=150 TESTS="tests/test_prompt_logprobs.py" \
  bash bench/gpu_checks.sh $OUT tests
grep -E "passed|failed|=== " $OUT/log.txt | tail -3
