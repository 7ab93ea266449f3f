#!/usr/bin/env bash
# session 19, call 3: scripted tau 6 e2e on 430eac4 (before the serving-core redesign and paged K/V), then HEAD
# with adaptive widths, C 1-64
OUT=$1
T0=$(date +%s)
bash bench/gpu_checks.sh $OUT > /dev/null 2>&1  # wheels into /tmp/site
rm -f $OUT/log.txt
export TRITON_CACHE_DIR=/tmp/triton-cache PYTHONUNBUFFERED=1
echo "=== [$(( $(date +%s) - T0 )) s] e2e scripted tau 6, 430eac4"
(cd .old/430eac4 && PYTHONPATH=$PWD:/tmp/site timeout 330 python3 -m deltaflash bench e2e --workload scripted --tau 6 \
  --prompts 16 --concurrency 1 4 16 64 --no-profile --quiet --out $OUT/e2e-430eac4 > $OUT/e2e-430eac4.txt 2>&1; echo "exit $?")
grep -v Warn $OUT/e2e-430eac4.txt | grep -E "^(1|4|16|64) |spec_over" | cut -c1-200
echo "=== [$(( $(date +%s) - T0 )) s] e2e scripted tau 6, HEAD, adaptive"
PYTHONPATH=$PWD:/tmp/site timeout $(( 560 - $(date +%s) + T0 )) python3 -m deltaflash bench e2e --workload scripted --tau 6 \
  --prompts 16 --concurrency 1 4 16 64 --no-profile --quiet --speculation adaptive --out $OUT/e2e-adaptive \
  > $OUT/e2e-adaptive.txt 2>&1; echo "exit $?"
grep -v Warn $OUT/e2e-adaptive.txt | grep -E "^(1|4|16|64) |spec_over" | cut -c1-200
echo "=== done $(( $(date +%s) - T0 )) s"
