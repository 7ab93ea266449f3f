"""Where a decode step's host time goes at L lanes (target-only, bundled target): inclusive wall time of
the step's parts, by wrapping them (no profiler). usage: host_split.py L [device] [steps]"""
import sys, time, collections, functools
import torch
from deltaflash.bundled import BUNDLED
from deltaflash.engine.config import EngineConfig
from deltaflash.engine.engine import Engine
from deltaflash.core.request import SamplingParams
from deltaflash.models.loader import load_model, default_dtype
import deltaflash.engine.runner as R
import deltaflash.cache.commit as C
import deltaflash.speculative.acceptance as A

L = int(sys.argv[1]); dev = torch.device(sys.argv[2] if len(sys.argv) > 2 else "cpu")
steps = int(sys.argv[3]) if len(sys.argv) > 3 else 200
torch.set_grad_enabled(False)
model = load_model(BUNDLED / "target", dtype=default_dtype(dev), device=dev, progress=False)
eng = Engine(model, None, None, EngineConfig(max_slots=L, max_model_len=2048))
for i in range(L):
    eng.add_request([1 + i, 2, 3], SamplingParams(max_new_tokens=1500, ignore_eos=True))
for _ in range(20):
    eng.step()
acc = collections.defaultdict(float)
def wrap(obj, name, label=None):
    fn = getattr(obj, name)
    @functools.wraps(fn)
    def w(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            acc[label or name] += time.perf_counter() - t
    setattr(obj, name, w)
sch, run = eng.scheduler, eng.runner
wrap(sch, "schedule", "scheduler.schedule")
wrap(run, "execute", "runner.execute")
wrap(run, "map_pages", "runner.map_pages")
wrap(run, "_round", "runner._round")
wrap(run, "verify", "runner.verify")
wrap(run, "_commit", "runner._commit")
wrap(eng, "_apply", "engine._apply")
wrap(R, "read_emitted", "read_emitted (sync)")
wrap(R.LaneSampling, "build", "LaneSampling.build")
wrap(R, "accept", "accept")
wrap(R, "commit", "commit (cache)")
wrap(C, "validate_plan", "validate_plan")
wrap(R, "to_device", "runner to_device")
import deltaflash.engine.graphs as G; wrap(G.LaneGraphs, "run", "LaneGraphs.run (copy in + replay)")
wrap(R.CommitPlan, "chain", "CommitPlan.chain")
wrap(run.idle_clock, "begin", "idle_clock.begin"); wrap(run.idle_clock, "end", "idle_clock.end")
sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
sync()
t0 = time.perf_counter()
for _ in range(steps):
    eng.step()
sync()
wall = time.perf_counter() - t0
print(f"{L} lanes, {steps} decode steps on {dev}: {wall / steps * 1e6:.1f} us per step")
for k, v in sorted(acc.items(), key=lambda kv: -kv[1]):
    print(f"  {v / steps * 1e6:9.1f} us  {k}")
