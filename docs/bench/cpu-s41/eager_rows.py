"""TTFT of one long prompt, 9B shape at the serve defaults, with a long prompt's later 2048-row chunks on the eager
dense route (EAGER_DENSE_MIN_ROWS 1024) against their prefill graphs (paged attention; the threshold past 2048),
alternated in one engine (the runner reads the module's constant at each step). Usage: eager_rows.py [TOKENS...]"""
import statistics
import sys
import time

import torch

import deltaflash.engine.runner as runner_module
from deltaflash.core.request import SamplingParams
from deltaflash.engine.config import EngineConfig
from deltaflash.engine.engine import Engine
from deltaflash.models.random_init import qwen35_9b_config, random_model

engine = Engine(random_model(qwen35_9b_config(), torch.bfloat16, torch.device("cuda"), copying=True), None, None,
                EngineConfig())
params = SamplingParams(max_new_tokens=1, ignore_eos=True)
for tokens in [int(t) for t in sys.argv[1:]] or [4096, 8192]:
    prompts = [[3 + (7 * i + j) % 9000 for j in range(tokens)] for i in range(8)]
    times = {1024: [], 4096: []}
    for rep in range(3):
        for rows in (1024, 4096):
            runner_module.EAGER_DENSE_MIN_ROWS = rows
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            engine.generate([prompts[rep]], params)
            torch.cuda.synchronize()
            if rep:  # the first pass warms each path
                times[rows].append(1e3 * (time.perf_counter() - t0))
    print(f"{tokens} tokens: eager dense later chunks {statistics.median(times[1024]):.1f} ms {times[1024]}, "
          f"graphs {statistics.median(times[4096]):.1f} ms {times[4096]}")
