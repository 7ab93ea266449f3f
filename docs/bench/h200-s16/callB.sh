#!/usr/bin/env bash
# session 16 call B: issue 14's paged flatness (one process) and real long contexts at 16 lanes
OUT=$1
LIMIT_PAGED=200 LIMIT_LONGCTX=175 bash bench/gpu_checks.sh $OUT paged longctx > /dev/null 2>&1
grep -E "^=== |round/at|^ *[0-9]+ +[0-9]+ |lanes|ms" $OUT/log.txt | cut -c1-220 | tail -60
