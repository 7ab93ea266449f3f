# s38's device call, waiting for a machine: bash docs/bench/cpu-s38/call1.sh [full|short|ttft] (what fits the device
# time left). An H200 in full: issue 15's TTFT table (bench model, both compute limits). Otherwise: the 2048-token
# TTFT at HEAD (each lane's last row alone past the last layer's K/V) against 85e3987 (exported to .out/old, carried
# with .out), alternated; then (full, short) the GPU tests of the changed prefill and of prompt logprobs; then (full) the residual-epilogue
# lever and the conv's rows a loop step, in isolation.
MODE=${1:-full}
name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "card: $name, $MODE"; date -u
if [[ $name == *H200* && $MODE == full ]]; then
  bash bench/gpu_checks.sh "$OUT" ttfttable; grep -E "^=== " "$OUT/log.txt" | tail -3; exit
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>&1 | tail -1
mkdir -p /tmp/triton-cache && cat .tcache/triton-cache.tgz.part-* | tar xzf - -C /tmp/triton-cache
export TRITON_CACHE_DIR=/tmp/triton-cache PYTHONUNBUFFERED=1
for i in 1 2; do
  for tree in . .out/old; do
    echo "== $tree 2048 $i" >> $OUT/ttft.txt
    (cd $tree && PYTHONPATH=/tmp/site:$PWD timeout 45 python3 bench/step_profile.py --shape 9b --ttft 2048 --steps 4 >> $OUT/ttft.txt 2>&1)
  done
done
grep -E "^== |TTFT by CUDA|TTFT of one" $OUT/ttft.txt | cut -c1-220
[[ $MODE == ttft ]] && exit
DELTAFLASH_TEST_DEVICE=cuda PYTEST_ARGS="-n 8" LIMIT_TESTS=150 TESTS="tests/test_gpu_target.py tests/test_prefill_graphs.py tests/test_ops_gpu.py::test_conv_extend_tilings_agree_bit_for_bit tests/test_prompt_logprobs.py" bash bench/gpu_checks.sh $OUT tests
grep -E "passed|failed|=== " $OUT/log.txt | tail -3
[[ $MODE == short ]] && exit
export PYTHONPATH=/tmp/site:$PWD
timeout 30 python3 bench/prefill_levers.py --only-residual --residual-rows 2048 2>&1 | tee $OUT/levers.txt | cut -c1-400
timeout 25 python3 bench/tune_conv.py --tokens 2048 --configs 16x1 16x1x2 2>&1 | tee $OUT/tune_conv.txt
