"""Where one engine step's time goes at a few lanes, bundled demo pair on CUDA: wall time per step,
the device's busy time per step, and the host-side torch ops and device kernels that take the most.
Uses only the engine's public API, so the same script profiles an older tree side by side:

    python bench/step_profile.py [--lanes 1] [--target-only] [--steps 100] [--max-slots N] [--max-model-len N]
    (cd old-tree && PYTHONPATH=$PWD python ../bench/step_profile.py)
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

import deltaflash
from deltaflash.engine.engine import Engine

try:
    from deltaflash.core.request import SamplingParams
except ImportError:  # trees before the core/ package
    from deltaflash.engine.request import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lanes", type=int, default=1)
    ap.add_argument("--target-only", action="store_true")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--max-slots", type=int, default=None, help="engine slots (default: the engine's)")
    ap.add_argument("--max-model-len", type=int, default=None, help="engine max_model_len (default: the engine's)")
    ap.add_argument("--rows", type=int, default=18, help="profiler table rows")
    args = ap.parse_args()
    demo = Path(deltaflash.__file__).parent / "assets" / "demo"
    slots = {k: v for k, v in (("max_slots", args.max_slots), ("max_model_len", args.max_model_len)) if v is not None}
    t0 = time.perf_counter()
    engine = Engine.from_pretrained(demo / "target", None if args.target_only else demo / "draft", device="cuda",
                                    progress=False, **slots)
    started = time.perf_counter() - t0
    prompt = list(range(3, 60))
    # at a small max_model_len a sequence may finish inside the measurement: a new one takes its lane
    params = SamplingParams(max_new_tokens=min(4 * args.steps * 8, engine.config.max_model_len - len(prompt) - 16),
                            ignore_eos=True)

    def step():
        for ev in engine.step():
            if ev.finish_reason:
                engine.add_request(prompt, params)
    for _ in range(args.lanes):
        engine.add_request(prompt, params)
    for _ in range(5):  # prefill and the first rounds
        step()
    walls = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t0)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    host_ops = sorted((e for e in events if e.self_cpu_time_total > 0), key=lambda e: -e.self_cpu_time_total)
    print(f"{deltaflash.__file__}: {'target-only' if args.target_only else 'spec'}, {args.lanes} lane(s), "
          f"{args.steps} steps, {engine.config.max_slots} slots, max_model_len {engine.config.max_model_len}; "
          f"engine ready in {started:.1f} s")
    print(f"  step wall p50 {1e3 * statistics.median(walls):.3f} ms, mean {1e3 * statistics.fmean(walls):.3f} ms; "
          f"device busy {device_us / 1e3 / args.steps:.3f} ms per step")
    print("  host ops by self CPU time per step (us, calls per step):")
    for e in host_ops[:args.rows]:
        print(f"    {e.self_cpu_time_total / args.steps:8.1f}  {e.count / args.steps:6.1f}  {e.key[:90]}")
    kernels = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: -e.self_device_time_total)
    print("  device kernels by time per step (us, launches per step):")
    for e in kernels[:10]:
        print(f"    {e.self_device_time_total / args.steps:8.1f}  {e.count / args.steps:6.1f}  {e.key[:90]}")


if __name__ == "__main__":
    main()
