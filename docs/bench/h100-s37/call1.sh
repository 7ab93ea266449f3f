# s37 call A: on an H200, part 1 of the owed figures (issue 16); on an H100, the GPU tests the s36/s37 code never
# ran on, then the 2048-token TTFT at HEAD (the state sink) against c1934f6 (.out/old), alternated.
name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "card: $name"; date -u; git log -1 --format=%h 2>/dev/null
case $name in
  *H200*) DELTAFLASH_TEST_DEVICE=cuda PYTEST_ARGS="-n 8" LIMIT_TESTS=150 TESTS="tests/test_ops_prefill_gates.py tests/test_prefill_graphs.py" bash bench/gpu_checks.sh $OUT tests
     export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-cache
     timeout 200 python3 -m deltaflash bench model --decode-batches 1 --ttft-tokens 256 2048 --json $OUT/model.json > $OUT/model.txt 2>&1; echo "model exit $?"
     tail -12 $OUT/model.txt | cut -c1-250
     timeout 230 python3 -m deltaflash bench e2e --workload scripted --tau 6 --prompts 16 --concurrency 1 64 --no-profile --speculation adaptive --out $OUT/tau6 --quiet > $OUT/tau6.txt 2>&1; echo "e2e exit $?"
     tail -12 $OUT/tau6.txt | cut -c1-250
     grep -E "passed|failed|=== " $OUT/log.txt | tail -4 ;;
  *) DELTAFLASH_TEST_DEVICE=cuda PYTEST_ARGS="-n 8" LIMIT_TESTS=240 TESTS="tests/test_ops_prefill_gates.py tests/test_fla_launch.py tests/test_prefill_graphs.py tests/test_gpu_graphs.py" bash bench/gpu_checks.sh $OUT tests
     grep -E "passed|failed|=== " $OUT/log.txt | tail -4
     export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-cache
     for i in 1 2; do
       for tree in . .out/old; do
         echo "== $tree $i" >> $OUT/ttft.txt
         (cd $tree && PYTHONPATH=/tmp/site:$PWD timeout 60 python3 bench/step_profile.py --shape 9b --ttft 2048 --steps 8 --rows 24 >> $OUT/ttft.txt 2>&1)
       done
     done
     grep -E "^== |TTFT by CUDA|TTFT of one" $OUT/ttft.txt | cut -c1-200 ;;
esac
