# s35 call 4 (any card): CUDA tests of the one-launch prefill conv (16-row tiles); the 2048 / 256-token TTFT
# alternated, HEAD against 6f70bca; HEAD's 2048-token kernel table.
name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "card: $name"; date -u
export PYTHONUNBUFFERED=1
R=$PWD
DELTAFLASH_TEST_DEVICE=cuda PYTEST_ARGS="-n 8" LIMIT_TESTS=200 TESTS="tests/test_ops_gpu.py::test_conv_extend_heads_equals_ref tests/test_ops_gpu.py::test_conv_extend_bitwise_equals_ref tests/test_prefill_graphs.py tests/test_gpu_target.py" bash bench/gpu_checks.sh $OUT tests
export TRITON_CACHE_DIR=/tmp/triton-cache
for i in 1 2; do
  for tree in HEAD old; do
    d=$R; [ $tree = old ] && d=$R/.out/old
    for n in 2048 256; do
      echo "== $tree $i $n" >> $OUT/ttft.txt
      PYTHONPATH=/tmp/site:$d timeout 60 python3 bench/step_profile.py --shape 9b --ttft $n --steps 8 --split >> $OUT/ttft.txt 2>&1
    done
  done
done
PYTHONPATH=/tmp/site:$R timeout 60 python3 bench/step_profile.py --shape 9b --ttft 2048 --steps 6 > $OUT/kernels.txt 2>&1
tail -3 $OUT/log.txt
grep -E "^== |TTFT|p50|Error" $OUT/ttft.txt | head -40
grep -A14 "device kernels by time" $OUT/kernels.txt
