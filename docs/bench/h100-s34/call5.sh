export DELTAFLASH_TEST_DEVICE=cuda PYTEST_ARGS="-n 8" TESTS="tests/test_gpu_graphs.py tests/test_prefill_graphs.py tests/test_engine.py tests/test_tree.py tests/test_pages.py tests/test_spec.py"
nvidia-smi --query-gpu=name --format=csv,noheader
LIMIT_TESTS=240 bash bench/gpu_checks.sh $OUT tests
unset DELTAFLASH_TEST_DEVICE
R=$PWD
for i in 1 2; do
  echo "== HEAD $i" >> $OUT/ttft.txt
  PYTHONPATH=/tmp/site:$R timeout 80 python3 bench/step_profile.py --shape 9b --ttft 2048 --steps 10 --split >> $OUT/ttft.txt 2>&1
  echo "== c921d1d $i" >> $OUT/ttft.txt
  PYTHONPATH=/tmp/site:$R/.out/old timeout 80 python3 bench/step_profile.py --shape 9b --ttft 2048 --steps 10 --split >> $OUT/ttft.txt 2>&1
done
for i in 1 2; do
  echo "== HEAD $i" >> $OUT/round.txt
  PYTHONPATH=/tmp/site:$R timeout 100 python3 -m deltaflash bench round --lanes 1 4 --routes fused --rounds 6 >> $OUT/round.txt 2>&1
  echo "== c921d1d $i" >> $OUT/round.txt
  (cd .out/old && PYTHONPATH=/tmp/site:$R/.out/old timeout 100 python3 -m deltaflash bench round --lanes 1 4 --routes fused --rounds 6 >> $OUT/round.txt 2>&1)
done
tail -3 $OUT/log.txt
grep -E "^== |TTFT by|p50|^ +[0-9.]+ us +(runner._prefill_replay|runner.map_pages|LaneGraphs.run|CUDAGraph.replay|add_request|runner.execute)" $OUT/ttft.txt
grep -E "^== |^1024 " $OUT/round.txt
