cd /work/main && source .venv/bin/activate
for b in 0 8 16 32; do
  python -m deltaflash bench e2e --workload demo --device cpu --prompts 16 --concurrency 1 4 16 --max-new-tokens 64 --tree-budget $b --tree-max-lanes 0 --speculation fixed --no-profile --out /tmp/sweep/tree$b --quiet > /tmp/sweep/tree$b.log 2>&1
  echo "budget $b exit $?" >> /tmp/sweep/done.txt
done
