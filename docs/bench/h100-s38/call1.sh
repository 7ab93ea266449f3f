# s38 call 1: on an H200, part 2 of the owed figures (issue 15: bench model's TTFT table, 2048-token prompts at
# C = 8 / 32, the demo pair at every load); on an H100: two prefill levers in isolation (the residual add in the
# GEMM epilogue, the conv's rows a loop step), the GPU tests the session's changes touch, then the TTFT at HEAD
# (each lane's last row alone past the last layer's mixer) against 85e3987 (.out/old), alternated.
name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "card: $name"; date -u; git log -1 --format=%h 2>/dev/null
case $name in
  *H200*) bash bench/h200_owed.sh "$OUT" 2 ;;
  *) DELTAFLASH_TEST_DEVICE=cuda PYTEST_ARGS="-n 8" LIMIT_TESTS=200 TESTS="tests/test_ops_gpu.py tests/test_gpu_target.py tests/test_prefill_graphs.py tests/test_target.py" bash bench/gpu_checks.sh $OUT tests
     grep -E "passed|failed|=== " $OUT/log.txt | tail -4
     export PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_DIR=/tmp/triton-cache PYTHONUNBUFFERED=1
     timeout 100 python3 bench/prefill_levers.py --only-residual --residual-rows 256 2048 8192 2>&1 | tee $OUT/levers.txt | cut -c1-400
     timeout 100 python3 bench/tune_conv.py --tokens 2048 512 --configs 8x1 16x1 16x1x2 32x1x2 8x1x2 64x1x2 16x2x2 2>&1 | tee $OUT/tune_conv.txt
     for i in 1 2; do
       for tree in . .out/old; do
         for n in 2048 256; do
           echo "== $tree $n $i" >> $OUT/ttft.txt
           (cd $tree && PYTHONPATH=/tmp/site:$PWD timeout 45 python3 bench/step_profile.py --shape 9b --ttft $n --steps 8 >> $OUT/ttft.txt 2>&1)
         done
       done
     done
     grep -E "^== |TTFT by CUDA|TTFT of one" $OUT/ttft.txt | cut -c1-220 ;;
esac
