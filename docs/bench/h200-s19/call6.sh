#!/usr/bin/env bash
# session 19, call 6: issue 17's owed figures - a tree round against a chain round of the same rows (9B shape,
# 1 / 16 lanes), and the demo pair's chain (block 8) against trees of 8 / 16 / 32 nodes at C = 1, 4, 16
OUT=$1
T0=$(date +%s)
bash bench/gpu_checks.sh $OUT > /dev/null 2>&1  # wheels into /tmp/site
rm -f $OUT/log.txt
export TRITON_CACHE_DIR=/tmp/triton-cache PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
for budget in 0 16; do
  echo "=== [$(( $(date +%s) - T0 )) s] round, tree budget $budget"
  timeout 70 python3 -m deltaflash bench round --lanes 1 16 --routes fused --rounds 6 --tree-budget $budget \
    --json $OUT/round-tree$budget.json > $OUT/round-tree$budget.txt 2>&1; echo "exit $?"
  grep -v Warn $OUT/round-tree$budget.txt | tail -3 | cut -c1-250
done
for budget in 0 8 16 32; do
  left=$(( 440 - $(date +%s) + T0 )); [ $left -lt 30 ] && break
  echo "=== [$(( $(date +%s) - T0 )) s] demo e2e, tree budget $budget"
  timeout $(( left < 100 ? left : 100 )) python3 -m deltaflash bench e2e --workload demo --prompts 16 --concurrency 1 4 16 \
    --tree-budget $budget --no-profile --quiet --out $OUT/tree$budget > $OUT/tree$budget.txt 2>&1; echo "exit $?"
  rm -f $OUT/tree$budget/*.png
  grep -v Warn $OUT/tree$budget.txt | grep -E "^(1|4|16) |spec_over" | cut -c1-180
done
echo "=== done $(( $(date +%s) - T0 )) s"
