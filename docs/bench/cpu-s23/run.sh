# The trees-or-chains choice on this 2-core CPU (where every verify row costs compute, as the 9B shape's
# rounds do under load): the default choice against trees at every load and the chain, tree of 16.
cd /work/main && source .venv/bin/activate
for lanes in default 0 chain; do
  case $lanes in
    default) flags="--tree-budget 16" ;;
    0) flags="--tree-budget 16 --tree-max-lanes 0" ;;
    chain) flags="--tree-budget 0" ;;
  esac
  python -m deltaflash bench e2e --workload demo --device cpu --prompts 16 --concurrency 1 4 16 --max-new-tokens 64 \
      $flags --speculation fixed --no-profile --out /tmp/sweep23/$lanes --quiet > /tmp/sweep23/$lanes.log 2>&1
  echo "$lanes exit $?" >> /tmp/sweep23/done.txt
done
