# s38 call 3 (the last ~4 device minutes): the 2048-token TTFT at HEAD against 85e3987 (.out/old), alternated.
name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "card: $name"; date -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>&1 | tail -1
mkdir -p /tmp/triton-cache && cat .tcache/triton-cache.tgz.part-* | tar xzf - -C /tmp/triton-cache
export TRITON_CACHE_DIR=/tmp/triton-cache PYTHONUNBUFFERED=1
for i in 1 2; do
  for tree in . .out/old; do
    echo "== $tree 2048 $i" >> $OUT/ttft.txt
    (cd $tree && PYTHONPATH=/tmp/site:$PWD timeout 42 python3 bench/step_profile.py --shape 9b --ttft 2048 --steps 4 >> $OUT/ttft.txt 2>&1)
  done
done
grep -E "^== |TTFT by CUDA|TTFT of one" $OUT/ttft.txt | cut -c1-220
