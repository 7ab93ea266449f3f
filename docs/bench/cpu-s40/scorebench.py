"""Score one 2048-token prompt (prompt_logprobs=1, max_new_tokens 0) on a toy model with the 9B's vocabulary (CPU)."""
import dataclasses, statistics, sys, time, torch
import deltaflash
from deltaflash.engine.config import EngineConfig
from deltaflash.engine.engine import Engine
from deltaflash.models.random_init import SHAPES, random_model
try:
    from deltaflash.core.request import SamplingParams
except ImportError:
    from deltaflash.engine.request import SamplingParams
torch.manual_seed(0)
cfg = dataclasses.replace(SHAPES["toy"](num_layers=4), vocab_size=248320)
engine = Engine(random_model(cfg, torch.float32, "cpu"), None, None, EngineConfig())
prompt = torch.randint(3, cfg.vocab_size, (2048,)).tolist()
params = SamplingParams(max_new_tokens=0, prompt_logprobs=1)
walls = []
for i in range(4):
    t0 = time.perf_counter(); steps = 0
    engine.add_request(prompt, params)
    while engine.has_work():
        engine.step(); steps += 1
    walls.append(time.perf_counter() - t0)
print(f"{deltaflash.__file__}: {steps} steps, wall p50 {statistics.median(walls[1:]):.3f} s (runs {[round(w, 3) for w in walls]})")
