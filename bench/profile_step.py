"""Where one request's engine steps spend their time, host side: per-step wall times, then a torch
profile (runtime calls: launches, copies, syncs, pinned allocations) and a cProfile of the decode steps.

Usage: python bench/profile_step.py [--model DIR] [--draft DIR | --no-draft] [--tokens N] [--slots S]

Runs one request at a time (concurrency 1) on the bundled demo pair by default. Written against the
public engine API that both the current engine and the one before the serving-core redesign have
(`Engine.from_pretrained`, `add_request`, `has_work`, `step`), so the same script profiles both.
"""

import argparse
import cProfile
import io
import pstats
import statistics
import time
from collections import Counter
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

try:
    from deltaflash.core.request import SamplingParams
except ImportError:  # the engine before the serving-core redesign
    from deltaflash.engine.request import SamplingParams
from deltaflash.engine.engine import Engine

DEMO = Path(__file__).resolve().parent.parent / "deltaflash" / "assets" / "demo"
RUNTIME_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaGraphLaunch", "cudaMemcpyAsync", "cudaStreamSynchronize",
                 "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaHostAlloc", "cudaEventRecord", "cudaEventQuery",
                 "cudaStreamWaitEvent")


def one_request(engine: Engine, prompt: list[int], tokens: int) -> list[tuple[float, int]]:
    """(step wall ms, tokens emitted) per step of one greedy request."""
    engine.add_request(prompt, SamplingParams(max_new_tokens=tokens))
    steps = []
    while engine.has_work():
        t0 = time.perf_counter()
        events = engine.step()
        steps.append(((time.perf_counter() - t0) * 1e3, sum(len(e.token_ids) for e in events)))
    return steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEMO / "target"))
    ap.add_argument("--draft", default=str(DEMO / "draft"))
    ap.add_argument("--no-draft", action="store_true")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--demo-prompt", type=int, default=None, metavar="I",
                    help="the I-th held-out prompt of `bench e2e --workload demo` instead of 64 fixed tokens")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script (fp32, no device timings)")
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    t0 = time.perf_counter()
    engine = Engine.from_pretrained(args.model, None if args.no_draft else args.draft, device=args.device, progress=False,
                                    max_slots=args.slots, max_model_len=args.max_model_len)
    prompt = list(range(100, 164))
    if args.demo_prompt is not None:
        from deltaflash.tokenizer import encode_prompt
        from deltaflash.train.corpus import heldout_prompts, load_split

        prompt = encode_prompt(engine.tokenizer, heldout_prompts(load_split(), args.demo_prompt + 1)[-1])
    print(f"prompt of {len(prompt)} tokens")
    for _ in range(3):  # compile and capture whatever the engine did not at start-up
        one_request(engine, prompt, args.tokens)
    sync()
    print(f"engine ready and warm in {time.perf_counter() - t0:.1f} s "
          f"({'spec' if not args.no_draft else 'target-only'}, {args.slots} slots)")

    first, decode, per_step = [], [], []
    for _ in range(args.repeats):
        steps = one_request(engine, prompt, args.tokens)
        first.append(steps[0][0])
        decode.extend(ms for ms, _ in steps[1:])
        per_step.append(sum(n for _, n in steps[1:]) / max(len(steps) - 1, 1))
    print(f"first step (prefill + first token) median {statistics.median(first):.3f} ms; decode step median "
          f"{statistics.median(decode):.3f} ms, p90 {sorted(decode)[int(0.9 * len(decode))]:.3f} ms; "
          f"{statistics.mean(per_step):.2f} tokens per decode step")

    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        steps = one_request(engine, prompt, args.tokens)
        sync()
    counts = Counter()
    for e in prof.events():
        if e.name in RUNTIME_CALLS:
            counts[e.name] += 1
    n = len(steps)
    print(f"runtime calls per step over one request ({n} steps): "
          + ", ".join(f"{k} {v / n:.1f}" for k, v in counts.most_common()))
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    print(f"device time per step {sum(e.device_time for e in kernels) / n / 1e3:.3f} ms "
          f"({len(kernels) / n:.1f} kernels per step, graph replays counted as their kernels)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))

    prof_py = cProfile.Profile()
    prof_py.enable()
    one_request(engine, prompt, args.tokens)
    prof_py.disable()
    out = io.StringIO()
    pstats.Stats(prof_py, stream=out).sort_stats("tottime").print_stats(30)
    print(out.getvalue())


if __name__ == "__main__":
    main()
