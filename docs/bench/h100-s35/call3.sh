# s35 call 3 (any card): CUDA tests of the one-launch prefill conv and the one-where gates (conv ops, prefill graphs,
# target vs transformers); the conv's time per 9B layer, HEAD's row loop against 6f70bca's 2D tile; the 2048-token
# TTFT alternated, HEAD against 6f70bca; cuBLASLt's prefill GEMMs captured alone (memset nodes?).
name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "card: $name"; date -u
export PYTHONUNBUFFERED=1
R=$PWD
DELTAFLASH_TEST_DEVICE=cuda PYTEST_ARGS="-n 8" LIMIT_TESTS=240 TESTS="tests/test_ops_gpu.py::test_conv_extend_heads_equals_ref tests/test_ops_gpu.py::test_conv_extend_bitwise_equals_ref tests/test_prefill_graphs.py tests/test_gpu_target.py" bash bench/gpu_checks.sh $OUT tests
export TRITON_CACHE_DIR=/tmp/triton-cache
echo "== HEAD" > $OUT/conv.txt
PYTHONPATH=/tmp/site:$R timeout 60 python3 bench/tune_conv.py >> $OUT/conv.txt 2>&1
echo "== 6f70bca (2D tile, two launches)" >> $OUT/conv.txt
PYTHONPATH=/tmp/site:$R/.out/old timeout 50 python3 .out/old/bench/tune_conv.py --configs 32x4 >> $OUT/conv.txt 2>&1
for i in 1 2; do
  for tree in HEAD old; do
    d=$R; [ $tree = old ] && d=$R/.out/old
    echo "== $tree $i" >> $OUT/ttft.txt
    PYTHONPATH=/tmp/site:$d timeout 70 python3 bench/step_profile.py --shape 9b --ttft 2048 --steps 8 --split >> $OUT/ttft.txt 2>&1
  done
done
PYTHONPATH=/tmp/site:$R TORCH_BLAS_PREFER_CUBLASLT=1 timeout 50 python3 bench/graph_launch.py --gemms 2048 > $OUT/gemms-lt.txt 2>&1
tail -4 $OUT/log.txt
grep -v Warn $OUT/conv.txt
grep -E "^== |TTFT|p50" $OUT/ttft.txt | head -30
grep -v Warn $OUT/gemms-lt.txt
