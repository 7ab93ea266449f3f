# (asked for nvidia-h200; ran on an NVIDIA H100 80GB HBM3)
# s36 call 1: issue 16's figures owed on the H200 first (scripted tau 6 at every load; the skinny table on this
# card and the one-lane round with it against cuBLAS), then issue 15's TTFT table; the Triton cache for later calls.
name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "card: $name"; date -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_DIR=/tmp/triton-cache
mkdir -p $TRITON_CACHE_DIR
T0=$(date +%s)
step() { local lim=$1; shift; echo "=== [$(( $(date +%s) - T0 )) s] $*" | tee -a $OUT/log.txt; timeout -s INT -k 10 $lim "$@" >> $OUT/log.txt 2>&1; echo "=== exit $?" | tee -a $OUT/log.txt; }
step 150 python3 -m deltaflash bench e2e --workload scripted --tau 6 --prompts 16 --concurrency 1 4 16 64 --no-profile --speculation adaptive --out $OUT/tau6 --quiet
step 80 python3 bench/tune_skinny.py --out $OUT/skinny-tiles.json --report $OUT/skinny.json --quick --shapes 9b
step 110 python3 -m deltaflash bench round --lanes 1 4 --routes fused --rounds 6 --skinny-gemm off $OUT/skinny-tiles.json --json $OUT/skinny-round.json
step 170 python3 -m deltaflash bench model --decode-batches 1 --ttft-tokens 64 256 1024 2048 8192 32768 --json $OUT/model.json
bash bench/gpu_checks.sh $OUT savecache > /dev/null 2>&1
echo "=== done in $(( $(date +%s) - T0 )) s"
grep -A12 "time to first token" $OUT/log.txt | head -16
tail -60 $OUT/log.txt | grep -v "^=== \[" | cut -c1-220
