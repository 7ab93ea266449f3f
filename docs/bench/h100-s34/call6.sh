export DELTAFLASH_TEST_DEVICE=cuda PYTEST_ARGS="-n 8" TESTS="tests/test_gpu_graphs.py"
nvidia-smi --query-gpu=name --format=csv,noheader
LIMIT_TESTS=200 bash bench/gpu_checks.sh $OUT tests
unset DELTAFLASH_TEST_DEVICE
R=$PWD
for n in 256 2048; do for i in 1 2; do
  for tree in HEAD old; do
    P=$R; [ $tree = old ] && P=$R/.out/old
    echo "== $tree $n $i" >> $OUT/ttft.txt
    PYTHONPATH=/tmp/site:$P timeout 100 python3 bench/step_profile.py --shape 9b --ttft $n --steps 10 --split >> $OUT/ttft.txt 2>&1
  done
done; done
tail -3 $OUT/log.txt
grep -E "^== |TTFT by|p50|^ +[0-9.]+ us +(runner._prefill_replay|runner.map_pages|CUDAGraph.replay)" $OUT/ttft.txt | sed 's/.*TTFT of one/TTFT/'
