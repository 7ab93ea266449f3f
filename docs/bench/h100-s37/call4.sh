export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-cache
for i in 1 2; do for t in $PWD/.out/h512.json auto; do echo "== $t $i" >> $OUT/t1024.txt
DELTAFLASH_FLA_TILES=$([ $t = auto ] && echo "" || echo $t) timeout 45 python3 bench/step_profile.py --shape 9b --ttft 1024 --steps 8 --rows 14 >> $OUT/t1024.txt 2>&1; done; done
grep -E "^== |TTFT by CUDA|TTFT of one|fwd_kernel_h" $OUT/t1024.txt | cut -c1-200
