#!/usr/bin/env bash
# session call 3: host profile at 64 target-only lanes (HEAD vs 430eac4), the 2048-token prefill profile (HEAD vs b8e1320), first requests
OUT=$1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export TRITON_CACHE_DIR=/tmp/triton-cache PYTHONUNBUFFERED=1
mkdir -p $TRITON_CACHE_DIR; cat .tcache/triton-cache.tgz.part-* | tar xzf - -C $TRITON_CACHE_DIR
prof() { local name=$1 tree=$2 limit=$3; shift 3
  echo "=== $name ($tree): $*"; PYTHONPATH=$tree:/tmp/site timeout $limit python3 "$@" > $OUT/$name.txt 2>&1; echo "=== $name exit $?"
  grep -E "step wall|TTFT|device busy" $OUT/$name.txt | head -4; }
prof steps64-head $PWD 120 bench/step_profile.py --lanes 64 --max-slots 64 --max-model-len 320 --target-only --steps 100 --slowest 0 --python --rows 22
prof steps64-430eac4 .old/430eac4 120 bench/step_profile.py --lanes 64 --max-slots 64 --max-model-len 320 --target-only --steps 100 --slowest 0 --python --rows 22
prof ttft2048-head $PWD 150 bench/step_profile.py --shape 9b --ttft 2048 --steps 10 --rows 30
prof ttft2048-b8e1320 .old/b8e1320 150 bench/step_profile.py --shape 9b --ttft 2048 --steps 10 --rows 30
echo "=== first"; PYTHONPATH=/tmp/site:$PWD timeout 200 python3 bench/first_requests.py --out $OUT/first.json > $OUT/first.txt 2>&1; echo "=== first exit $?"; tail -15 $OUT/first.txt
echo "=== attention"; PYTHONPATH=/tmp/site:$PWD timeout 150 python3 -m deltaflash bench attention --max-model-len 262144 --split-keys 4096 --key-tiles 32:3 64:2 64:3 --json $OUT/attention.json > $OUT/attention.txt 2>&1; echo "=== attention exit $?"; tail -16 $OUT/attention.txt | cut -c1-400
