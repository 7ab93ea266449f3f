"""Profile plain decode and one verify round of the 9B shape (random bf16 weights) with torch.profiler.

Usage: python bench/profile_decode.py [LANES]   (CUDA). Prints per-step wall time and the top ops."""

import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from deltaflash.cache.slots import SlotPool
from deltaflash.engine.batch import ExtendBatch
from deltaflash.models.random_init import qwen35_9b_config, random_model

lanes = int(sys.argv[1]) if len(sys.argv) > 1 else 1
cfg = qwen35_9b_config()
with torch.inference_mode():
    model = random_model(cfg, torch.bfloat16, "cuda")
    pool = SlotPool(cfg, lanes, 1024, torch.bfloat16, "cuda")
    slots = [pool.admit() for _ in range(lanes)]
    for s in slots:
        model.extend(ExtendBatch.build([(s, 0, list(range(1, 500)))], "cuda"), pool)

    def step():
        model.extend(ExtendBatch.build([(s, pool.lengths[s], [7]) for s in slots], "cuda"), pool)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    for _ in range(3):
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        print(f"decode step, {lanes} lanes: {(time.perf_counter() - t0) * 1e3:.1f} ms wall")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=14, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=10, max_name_column_width=60))
