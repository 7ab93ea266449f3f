# The trees-or-chains choice on this 2-core CPU (where every verify row costs compute, as the 9B shape's
# rounds do under load on a GPU), tree of 16: `bash run.sh default 0 chain` (the choice, trees at every load,
# the chain); after the DecayedMean fix `TAG=2 bash run.sh default chain`. Logs: /tmp/sweep23/CONFIG$TAG.log.
cd /work/main && source .venv/bin/activate
mkdir -p /tmp/sweep23
for config in "$@"; do
  case $config in
    default) flags="--tree-budget 16" ;;
    0) flags="--tree-budget 16 --tree-max-lanes 0" ;;
    chain) flags="--tree-budget 0" ;;
    *) echo "unknown config $config"; exit 2 ;;
  esac
  python -m deltaflash bench e2e --workload demo --device cpu --prompts 16 --concurrency 1 4 16 --max-new-tokens 64 \
      $flags --speculation fixed --no-profile --out /tmp/sweep23/$config${TAG:-} --quiet > /tmp/sweep23/$config${TAG:-}.log 2>&1
  echo "$config${TAG:-} exit $?" >> /tmp/sweep23/done.txt
done
