# After the DecayedMean fix: the default choice again, then the chain, back to back.
cd /work/main && source .venv/bin/activate
for lanes in default2 chain2; do
  case $lanes in
    default2) flags="--tree-budget 16" ;;
    chain2) flags="--tree-budget 0" ;;
  esac
  python -m deltaflash bench e2e --workload demo --device cpu --prompts 16 --concurrency 1 4 16 --max-new-tokens 64 \
      $flags --speculation fixed --no-profile --out /tmp/sweep23/$lanes --quiet > /tmp/sweep23/$lanes.log 2>&1
  echo "$lanes exit $?" >> /tmp/sweep23/done.txt
done
