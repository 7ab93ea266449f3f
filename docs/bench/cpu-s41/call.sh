# s41's device calls: bash docs/bench/cpu-s41/call.sh PART. On an H200: bench/h200_owed.sh PART (issues 15/16's owed
# figures). On an H100: the fortieth session's second call (host path on the VM's CPU, prompt-logprob tests on CUDA).
PART=${1:-1}
name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $name; $(date -u)"
if [[ $name == *H200* ]]; then exec bash bench/h200_owed.sh "$OUT" "$PART"; fi
exec bash docs/bench/cpu-s40/call2.sh
