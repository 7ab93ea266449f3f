python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_DIR=/tmp/triton-cache; mkdir -p $TRITON_CACHE_DIR; cat .tcache/triton-cache.tgz.part-* | tar xzf - -C $TRITON_CACHE_DIR
for n in 256 2048; do
  for ws in default ":0:0"; do
    echo "== $n CUBLAS_WORKSPACE_CONFIG=$ws" >> $OUT/ttft-ws.txt
    if [ "$ws" = default ]; then timeout 70 python3 bench/step_profile.py --shape 9b --ttft $n --steps 10 --split >> $OUT/ttft-ws.txt 2>&1
    else CUBLAS_WORKSPACE_CONFIG=$ws timeout 70 python3 bench/step_profile.py --shape 9b --ttft $n --steps 10 --split >> $OUT/ttft-ws.txt 2>&1; fi
  done
done
grep -E "^== |TTFT by|p50|^ +[0-9.]+ us +(CUDAGraph.replay)" $OUT/ttft-ws.txt | sed 's/.*TTFT of one/TTFT/'
