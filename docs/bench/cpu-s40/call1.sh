# s40's device call: bash docs/bench/cpu-s40/call1.sh [full|short|ttft]. An H200 in full: issue 15's TTFT table (bench
# model, both compute limits), then the 2048-token TTFT with the H100's fla-core launch table against fla-core's
# autotuner (this card has no table of its own yet), alternated. Otherwise the thirty-eighth session's call
# (docs/bench/cpu-s38/call1.sh: HEAD against 85e3987, the GPU tests of the changed prefill and of prompt logprobs, the
# residual-epilogue lever and the conv step). First, on any card: the host path of a first token on this machine's
# CPU (bench/host_path.py, a toy engine without the model): is the VM's ~1.4 ms before a prefill's replay its Python
# (this box: ~0.2 ms) or its CUDA calls?
MODE=${1:-full}
name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
CUDA_VISIBLE_DEVICES= PYTHONPATH=$PWD timeout 60 python3 bench/host_path.py --requests 200 2>&1 | tail -3 | tee $OUT/host-path.txt
if [[ $name != *H200* || $MODE != full ]]; then
  exec bash docs/bench/cpu-s38/call1.sh "$MODE"
fi
echo "card: $name, $MODE"; date -u
bash bench/gpu_checks.sh "$OUT" ttfttable; grep -E "^=== " "$OUT/log.txt" | tail -3
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-cache
for t in $PWD/deltaflash/ops/gdn/tiles/nvidia-h100-80gb-hbm3.json auto; do
  (( SECONDS > 480 )) && break
  echo "== $t" >> $OUT/fla-tiles-2048.txt
  DELTAFLASH_FLA_TILES=$([ $t = auto ] && echo "" || echo $t) timeout 50 python3 bench/step_profile.py --shape 9b \
    --ttft 2048 --steps 8 --rows 14 >> $OUT/fla-tiles-2048.txt 2>&1
done
grep -E "^== |TTFT by CUDA|TTFT of one|fwd_kernel_h" $OUT/fla-tiles-2048.txt | cut -c1-200
