# (run as: sed -i ... (the limits below); bash .out/callA.sh, on the same warm H100 after call 1; then call 3, inline:
#  `export PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_DIR=/tmp/triton-cache; timeout 100 python3 -m pytest -q tests/test_fla_launch.py`: 5 passed)
# s36 call A: fla-core's chunked kernels under other launch configs (a table from the 2048-row shape), then the
# 2048 / 256-token TTFT with that table and with fla-core's autotuner, alternated; the new tests on CUDA.
name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "card: $name"; date -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_DIR=/tmp/triton-cache
mkdir -p $TRITON_CACHE_DIR
timeout 190 python3 bench/tune_fla.py --quick --shapes 1x2048 16x64 --out $OUT/fla-tiles.json > $OUT/tune-fla.txt 2>&1; echo "tune_fla exit $?"
grep -v "all:" $OUT/tune-fla.txt | grep -v Warn | tail -14 | cut -c1-330
cat $OUT/fla-tiles.json 2>/dev/null | tr -d ' \n'; echo
if [ -f $OUT/fla-tiles.json ]; then
  for i in 1 2; do
    for t in $OUT/fla-tiles.json off; do
      for n in 2048; do
        echo "== $t $i $n" >> $OUT/ttft.txt
        DELTAFLASH_FLA_TILES=$t timeout 50 python3 bench/step_profile.py --shape 9b --ttft $n --steps 8 --split >> $OUT/ttft.txt 2>&1
      done
    done
  done
  grep -E "^== |TTFT by CUDA" $OUT/ttft.txt | cut -c1-160
fi
DELTAFLASH_TEST_DEVICE=cuda PYTEST_ARGS="-n 8" LIMIT_TESTS=70 TESTS="tests/test_fla_launch.py tests/test_gpu_graphs.py tests/test_tree.py" bash bench/gpu_checks.sh $OUT tests
grep -E "passed|failed" $OUT/log.txt | tail -3
