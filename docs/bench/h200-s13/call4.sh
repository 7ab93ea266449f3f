#!/usr/bin/env bash
# session call 4: paged attention with 64-key tiles and up to 128 splits - GPU tests, then the serve-default bench
OUT=$1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/fla*.whl >/dev/null 2>&1
export TRITON_CACHE_DIR=/tmp/triton-cache PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
mkdir -p $TRITON_CACHE_DIR; cat .tcache/triton-cache.tgz.part-* | tar xzf - -C $TRITON_CACHE_DIR
timeout 50 python3 -m pytest -q -x -n 8 -p no:cacheprovider tests/test_ops_attention.py > $OUT/tests.txt 2>&1; echo "=== tests exit $?"; tail -3 $OUT/tests.txt
timeout 60 python3 -m deltaflash bench attention --max-model-len 262144 --json $OUT/attention.json > $OUT/attention.txt 2>&1; echo "=== attention exit $?"; tail -14 $OUT/attention.txt | cut -c1-200
