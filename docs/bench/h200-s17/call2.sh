#!/usr/bin/env bash
# session 17, call 2: the attention test fix on CUDA; what a graph launch costs (synthetic and the demo pair's
# graphs); issue 14's real-context rounds at 16 lanes (4k computed and unwritten, 32k / 128k unwritten); what
# of a 16-lane round grows with the capacity (kernel groups at 1k vs 256k); the dotsum / v2 tiles
OUT=$1
T0=$(date +%s)
DELTAFLASH_TEST_DEVICE=cuda PYTEST_ARGS="-n 8 -p no:cacheprovider" LIMIT_TESTS=100 TESTS="tests/test_ops_attention.py" \
  bash bench/gpu_checks.sh $OUT tests > /dev/null 2>&1
grep -E "passed|failed|^FAILED" $OUT/log.txt | tail -4
export TRITON_CACHE_DIR=/tmp/triton-cache PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
echo "=== [$(( $(date +%s) - T0 )) s] graph launch"
timeout 100 python3 bench/graph_launch.py --lanes 8 --dot /tmp/dot > $OUT/graph-launch.txt 2>&1; echo "exit $?"
cat $OUT/graph-launch.txt | grep -v Warning | cut -c1-250 | tail -40
ls -S /tmp/dot | tail -2 | while read f; do cp /tmp/dot/$f $OUT/; done
for ctx in 4096 32768 131072; do
  for how in "--unwritten-context" ""; do
    [ -z "$how" ] && [ $ctx != 4096 ] && continue
    echo "=== [$(( $(date +%s) - T0 )) s] round 16 lanes context $ctx $how"
    timeout 90 python3 -m deltaflash bench round --lanes 16 --routes fused --rounds 6 --prompt-len $ctx \
      --max-model-len $(( ctx + 256 )) $how --json $OUT/long-$ctx${how:+-unwritten}.json 2>&1 | tail -2
  done
done
echo "=== [$(( $(date +%s) - T0 )) s] profile 16 lanes, 1k vs 256k"
timeout 150 python3 bench/profile_round.py 16 --max-model-len 1024 262144 > $OUT/profile-capacity.txt 2>&1; echo "exit $?"
grep -E "^===|^  [a-zA-Z]" $OUT/profile-capacity.txt | head -30
left=$(( 575 - ($(date +%s) - T0) ))
echo "=== [$(( $(date +%s) - T0 )) s] attention dotsum / v2 (limit $left)"
timeout $left python3 -m deltaflash bench attention --max-model-len 262144 --contexts 32768 131072 \
  --key-tiles 16:64:2:64:dotsum 64:64:2:64:v2 2>&1 | tail -12
DELTAFLASH_TEST_DEVICE=cuda timeout 40 python3 .old/v2bits.py 2>&1 | tail -2
echo "=== done $(( $(date +%s) - T0 )) s"
