# s42's device calls: bash docs/bench/cpu-s42/call.sh PART. On an H200: bench/h200_owed.sh PART (issues 15/16's owed
# figures). On an H100, PART 1: every kernel of a 2048-token prefill (9B shape, serve defaults) with its launches,
# and the TTFT's host split with the collector frozen.
PART=${1:-1}
name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $name; $(date -u)"  # (the device copy's git metadata is stale: no tree hash)
if [[ $name == *H200* ]]; then exec bash bench/h200_owed.sh "$OUT" "$PART"; fi
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_DIR=/tmp/triton-cache
mkdir -p $TRITON_CACHE_DIR && cat .tcache/triton-cache.tgz.part-* | tar xzf - -C $TRITON_CACHE_DIR
if [[ $PART == 1 ]]; then
  timeout 300 python3 bench/step_profile.py --shape 9b --ttft 2048 --steps 8 --rows 80 --split --gc-freeze 2>&1 \
    | grep -v Warn | tee $OUT/ttft-kernels.txt | grep -A100 "TTFT by CUDA" | head -120
  exit
fi
if [[ $PART == 2 ]]; then  # the prefix cache's branch points: questions after one system prompt; its tests on CUDA
  TURNS_ARGS="--repeats 2" bash bench/gpu_checks.sh $OUT system burst; grep -vE "^\s*$|Warn|warn" $OUT/log.txt | tail -16
  DELTAFLASH_TEST_DEVICE=cuda PYTEST_ARGS="-n 8" LIMIT_TESTS=200 TESTS="tests/test_prefix_cache.py tests/test_shares.py tests/test_pages.py" \
    bash bench/gpu_checks.sh $OUT tests
  grep -E "passed|failed|=== " $OUT/log.txt | tail -3
  bash bench/gpu_checks.sh $OUT forks; grep -vE "^\s*$|Warn|warn" $OUT/log.txt | tail -8
  exit
fi
