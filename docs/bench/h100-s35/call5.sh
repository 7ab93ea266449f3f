# s35 call 5: HEAD's conv (64-bit row pointer): the conv op tests, prefill graphs and the engine suite on CUDA.
nvidia-smi --query-gpu=name --format=csv,noheader | head -1; date -u
DELTAFLASH_TEST_DEVICE=cuda PYTEST_ARGS="-n 8" LIMIT_TESTS=170 TESTS="tests/test_ops_gpu.py::test_conv_extend_heads_equals_ref tests/test_ops_gpu.py::test_conv_extend_bitwise_equals_ref tests/test_prefill_graphs.py tests/test_engine.py" bash bench/gpu_checks.sh $OUT tests
tail -6 $OUT/log.txt
