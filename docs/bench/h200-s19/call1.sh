#!/usr/bin/env bash
# session 19, call 1: decode-row tile sweep (occupancy: the 16-row tile holds 182 registers x 8 warps, one
# program per SM), issue 14's flatness, 16-lane rounds at 4k (computed) / 32k / 128k (unwritten)
OUT=$1
T0=$(date +%s)
bash bench/gpu_checks.sh $OUT > /dev/null 2>&1  # wheels into /tmp/site
export TRITON_CACHE_DIR=/tmp/triton-cache PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader
echo "=== [$(( $(date +%s) - T0 )) s] attention sweep"
timeout 200 python3 -m deltaflash bench attention --max-model-len 262144 --contexts 32768 131072 \
  --key-tiles 16:64:2:dotsum:r128 16:64:2:dotsum:onepass:r128 16:64:2:dotsum:w4 16:64:2:dotsum:w4:onepass 64:64:2:v2:w4:r240 \
  --json $OUT/attention-sweep.json > $OUT/attention-sweep.txt 2>&1; echo "exit $?"
grep -v Warn $OUT/attention-sweep.txt | tail -9 | cut -c1-600
echo "=== [$(( $(date +%s) - T0 )) s] flatness"
timeout 220 python3 -m deltaflash bench round --lanes 1 16 --routes fused --rounds 8 --max-model-len 1024 32768 262144 \
  --json $OUT/round-paged.json > $OUT/round-paged.txt 2>&1; echo "exit $?"
grep -v Warn $OUT/round-paged.txt | tail -7 | cut -c1-300
for ctx in 4096 32768 131072; do
  echo "=== [$(( $(date +%s) - T0 )) s] round 16 lanes context $ctx"
  flag=--unwritten-context; [ $ctx = 4096 ] && flag=
  timeout 50 python3 -m deltaflash bench round --lanes 16 --routes fused --rounds 6 --prompt-len $ctx \
    --max-model-len $(( ctx + 256 )) $flag --json $OUT/long-$ctx.json 2>&1 | tail -1 | cut -c1-300
done
echo "=== done $(( $(date +%s) - T0 )) s"
