"""Where one engine step's time goes at a few lanes, bundled demo pair on CUDA: wall time per step,
the device's busy time per step, and the host-side torch ops and device kernels that take the most.
Uses only the engine's public API, so the same script profiles an older tree side by side:

    python bench/step_profile.py [--lanes 1] [--target-only] [--steps 100] [--max-slots N] [--max-model-len N] [--python]
        [--slowest 5] [--gc-freeze] [--split] [--ttft N [--stacks REGEX]] [--shape 9b]
        [--tree-budget N]
    (cd old-tree && PYTHONPATH=$PWD python ../bench/step_profile.py)

--shape 9b / 27b: a target-only engine of that shape (random bf16 weights) instead of the demo pair, for
--ttft: which kernels of a long prefill run below the GEMM rate (the device kernels table).
--stacks REGEX (with --ttft): the Python lines launching the matching kernels, e.g. `--stacks direct_copy` under
DELTAFLASH_NO_PREFILL_GRAPHS=1 (a graph replay has no launching op).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import re
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


def kernel_name(key: str, width: int = 110) -> str:
    """A device kernel's name with torch's template noise taken out, so an elementwise kernel shows its
    functor (`elementwise_kernel<..., MulFunctor<float>>`, not 90 characters of `at::native::`)."""
    for noise in ("void ", "at::native::", "(anonymous namespace)::", "gpu_kernel_impl_nocast", "gpu_kernel_impl",
                  "binary_internal::", "c10::", "at::TensorIteratorBase&", "std::", "unsigned int"):
        key = key.replace(noise, "")
    key = re.sub(r"\(int\)#\d+\}", "", key)
    key = re.sub(r"\s+", " ", key)
    return key[:width]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class _Seen:
    """Collector pauses (ms) and Triton kernel loads seen so far; mark/since bracket one step."""

    def __init__(self):
        self.gc_ms, self.gc_by_gen, self.loads, self._t = 0.0, [0, 0, 0], 0, 0.0

    def on_gc(self, phase, info):
        if phase == "start":
            self._t = time.perf_counter()
        else:
            self.gc_ms += 1e3 * (time.perf_counter() - self._t)
            self.gc_by_gen[info["generation"]] += 1

    def mark(self):
        return self.gc_ms, self.loads

    def since(self, mark):
        return self.gc_ms - mark[0], self.loads - mark[1]

    def describe(self):
        return f"collector {self.gc_ms:.1f} ms in {self.gc_by_gen} runs by generation, {self.loads} kernel loads"


@contextlib.contextmanager
def watch():
    seen = _Seen()
    gc.callbacks.append(seen.on_gc)
    try:
        from deltaflash.ops.compiles import on_kernel_load
    except ImportError:  # trees before ops/compiles.py
        on_kernel_load = None
    try:
        with on_kernel_load(lambda *_: setattr(seen, "loads", seen.loads + 1)) if on_kernel_load else contextlib.nullcontext():
            yield seen
    finally:
        gc.callbacks.remove(seen.on_gc)


def launch_stacks(run, pattern: str, requests: int, rows: int) -> None:
    """Which Python lines launch the device kernels whose names match `pattern` (a regex; on the CPU, the
    ops' own names): `run` once under the profiler with Python stacks, each matching kernel charged to the
    innermost deltaflash / fla frames of the op that launched it. Kernels replayed from a CUDA graph carry
    no launching op: profile eager steps for them (DELTAFLASH_NO_PREFILL_GRAPHS=1 for a prefill)."""
    from collections import defaultdict

    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities, with_stack=True) as prof:
        run()
    sync()
    match = re.compile(pattern)
    by_site = defaultdict(lambda: [0, 0.0])  # (kernel, launching op, frames) -> [launches, device us]
    for event in prof.events():
        kernels = [(k.name, k.duration) for k in event.kernels if match.search(k.name)]
        if not torch.cuda.is_available() and match.search(event.name) and event.cpu_parent is not None:
            kernels = [(event.name, event.cpu_time_total)]  # the CPU: the op is the "kernel"
        if not kernels:
            continue
        op = event if event.name.startswith("aten::") or event.cpu_parent is None else event.cpu_parent
        while op.cpu_parent is not None and op.cpu_parent.name.startswith("aten::"):
            op = op.cpu_parent  # the outermost aten op: what the Python line called
        frames, parent = [], op.cpu_parent
        while parent is not None and len(frames) < 4:  # Python frames are the op's parents (or its `stack`)
            if re.search(r"(deltaflash|fla)/.*\.py\(\d+\)", parent.name):
                frames.append(re.sub(r".*?((deltaflash|fla)/)", r"\1", parent.name))
            parent = parent.cpu_parent
        frames = frames or [f for f in (op.stack or []) if re.search(r"(deltaflash|fla)/", f)][:4]
        for name, us in kernels:
            site = by_site[(kernel_name(name, 60), op.name, " <- ".join(frames) or "?")]
            site[0] += 1
            site[1] += us
    print(f"  launch sites of kernels matching {pattern!r} (per request: launches, device us):")
    if not by_site:
        print("    none (graph replays carry no launching op: profile eager steps)")
    for (name, op, frames), (n, us) in sorted(by_site.items(), key=lambda kv: -kv[1][1])[:rows]:
        print(f"    {n / requests:6.1f}  {us / requests:9.1f}  {name}  [{op}]  {frames}")


def host_split(first_token, n: int) -> None:
    """Where a request's TTFT goes, by CUDA events on the idle stream (no profiler): from add_request to the
    first graph replay's launch (host work: the device has nothing queued), from that launch to the last
    replay's end (the graphs' device time, with their launch), and the rest (eager work after the replays,
    the read of the token, its emission)."""
    replay, marks = torch.cuda.CUDAGraph.replay, []

    def timed(graph):
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record()
        replay(graph)
        after.record()
        marks.append((before, after))

    torch.cuda.CUDAGraph.replay = timed
    rows = []
    try:
        for i in range(n):
            marks.clear()
            start = torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start.record()
            first_token(i)
            wall = 1e3 * (time.perf_counter() - t0)
            if marks:
                pre, graphs = start.elapsed_time(marks[0][0]), marks[0][0].elapsed_time(marks[-1][1])
                rows.append((wall, pre, graphs, wall - pre - graphs))
    finally:
        torch.cuda.CUDAGraph.replay = replay
    if rows:
        wall, pre, graphs, rest = (statistics.median(r[k] for r in rows) for k in range(4))
        print(f"  TTFT by CUDA events (p50 of {len(rows)}, no profiler): {wall:.2f} ms = host before the first replay "
              f"{pre:.3f} + replays {graphs:.3f} + after {rest:.3f}")
    else:
        print("  TTFT by CUDA events: no graph replay (eager prefill)")


def ttft_profile(engine, args) -> None:
    """One prompt at a time: wall from add_request to its first token, then where one prefill's host time goes."""
    params = SamplingParams(max_new_tokens=1, ignore_eos=True)
    prompts = [[3 + (7 * i + j) % 90 for j in range(args.ttft)] for i in range(max(10, args.steps))]

    def first_token(i):
        engine.add_request(prompts[i], params)
        while engine.has_work():
            engine.step()
        sync()
    for i in range(3):
        first_token(i)
    walls = []
    for i in range(args.steps):
        t0 = time.perf_counter()
        first_token(i)
        walls.append(time.perf_counter() - t0)
    if torch.cuda.is_available():
        host_split(first_token, args.steps)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for i in range(10):
            first_token(i)
    events = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    print(f"{deltaflash.__file__}: TTFT of one {args.ttft}-token prompt ({'target-only' if args.target_only or args.shape != 'demo' else 'spec'}, {args.shape}, "
          f"{engine.config.max_slots} slots, max_model_len {engine.config.max_model_len})"
          f": p50 {1e3 * statistics.median(walls):.2f} ms, min {1e3 * min(walls):.2f} ms over {len(walls)}; device busy "
          f"{device_us / 1e4:.2f} ms per request (under the profiler)")
    kernels = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total),
                     key=lambda e: -e.self_device_time_total)
    if kernels:
        print("  device kernels by time per request (us, launches per request):")
        for e in kernels[:args.rows]:
            print(f"    {e.self_device_time_total / 10:8.1f}  {e.count / 10:6.1f}  {kernel_name(e.key)}")
    host = sorted((e for e in events if e.self_cpu_time_total > 0), key=lambda e: -e.self_cpu_time_total)
    print("  host ops by self CPU time per request (us, calls per request):")
    for e in host[:args.rows]:
        print(f"    {e.self_cpu_time_total / 10:8.1f}  {e.count / 10:6.1f}  {e.key[:90]}")
    if args.stacks:
        launch_stacks(lambda: [first_token(i) for i in range(2)], args.stacks, 2, args.rows)
    if args.split:
        count = itertools.count()
        split_profile(engine, lambda: first_token(next(count) % len(prompts)), args.steps,
                      ("add_request", "runner._prefill", "runner._prefill_replay"))
    import cProfile
    import pstats
    with cProfile.Profile() as py:
        for i in range(10):
            first_token(i)
    print("  Python functions by cumulative time, 10 requests:")
    pstats.Stats(py).sort_stats("cumulative").print_stats(args.rows + 15)
    print("  Python functions by own time, 10 requests:")
    pstats.Stats(py).sort_stats("tottime").print_stats(args.rows)


def split_profile(engine, step, steps: int, extra: tuple[str, ...] = ()) -> None:
    """Inclusive wall time per step of the step's parts (no profiler: each part wrapped in a timer), for
    the parts this tree has: what of a host-bound step is scheduling, launching, reading, committing,
    emitting. Parts nest (the runner's execute holds the round and the commit). `extra`: more of the
    engine's attributes to time."""
    import importlib

    parts = ("scheduler.schedule", "runner.execute", "runner.map_pages", "runner._round", "runner.verify",
             "runner._commit", "_apply", "runner.idle_clock.begin", "runner.idle_clock.end", *extra)
    module_parts = {"deltaflash.engine.runner": ("read_emitted", "accept", "commit", "to_device", "CommitPlan.chain",
                                                 "LaneSampling.build"),
                    "deltaflash.engine.graphs": ("LaneGraphs.run",), "deltaflash.cache.commit": ("validate_plan",)}
    total: dict[str, float] = {}

    def wrap(owner, path: str, label: str):
        *outer, name = path.split(".")
        for attr in outer:
            owner = getattr(owner, attr, None)
        fn = getattr(owner, name, None) if owner is not None else None
        if fn is None:
            return None

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                total[label] = total.get(label, 0.0) + time.perf_counter() - t
        setattr(owner, name, timed)
        return owner, name, fn

    undo = [wrap(engine, path, path) for path in parts] + [wrap(torch.cuda, "CUDAGraph.replay", "CUDAGraph.replay")]
    for name, paths in module_parts.items():
        try:
            module = importlib.import_module(name)
        except ImportError:  # an older tree without the module
            continue
        undo += [wrap(module, path, path) for path in paths]
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    wall = time.perf_counter() - t0
    for owner, name, fn in filter(None, reversed(undo)):
        setattr(owner, name, fn)
    print(f"  parts of a step, inclusive wall time per step ({steps} steps, {1e6 * wall / steps:.1f} us each):")
    for label, seconds in sorted(total.items(), key=lambda kv: -kv[1]):
        print(f"    {1e6 * seconds / steps:8.1f} us  {label}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lanes", type=int, default=1)
    ap.add_argument("--target-only", action="store_true")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--max-slots", type=int, default=None, help="engine slots (default: the engine's)")
    ap.add_argument("--max-model-len", type=int, default=None, help="engine max_model_len (default: the engine's)")
    ap.add_argument("--device", default="cuda", help="cuda (the point), or cpu to try the script")
    ap.add_argument("--rows", type=int, default=18, help="profiler table rows")
    ap.add_argument("--python", action="store_true", help="also the Python functions by own time (cProfile)")
    ap.add_argument("--split", action="store_true",
                    help="also the step's parts (scheduling, launches, the read, commit, emitting) by wall time "
                         "(with --ttft: a first token's)")
    ap.add_argument("--slowest", type=int, default=5, help="list the N slowest steps with what they did")
    ap.add_argument("--gc-freeze", action="store_true", help="gc.freeze() after start-up, as a server would")
    ap.add_argument("--round-graphs", action=argparse.BooleanOptionalAction, default=None,
                    help="greedy rounds as one CUDA graph (EngineConfig.round_graphs; default: the engine's)")
    ap.add_argument("--tree-budget", type=int, default=0,
                    help="rounds verify draft trees of N nodes (EngineConfig.tree_budget; 0: chains)")
    ap.add_argument("--shape", default="demo", help="demo (the bundled pair), or 9b / 27b / toy: a target-only "
                    "engine of random bf16 weights of that shape")
    ap.add_argument("--ttft", type=int, default=0, metavar="N",
                    help="instead: time to first token of one N-token prompt at a time (host ops, Python functions)")
    ap.add_argument("--stacks", default=None, metavar="REGEX",
                    help="with --ttft: the Python lines that launch the kernels matching REGEX (eager steps only: "
                         "DELTAFLASH_NO_PREFILL_GRAPHS=1)")
    args = ap.parse_args()
    demo = Path(deltaflash.__file__).parent / "assets" / "demo"
    slots = {k: v for k, v in (("max_slots", args.max_slots), ("max_model_len", args.max_model_len)) if v is not None}
    if args.round_graphs is not None:  # (an older tree without the option takes no such keyword)
        slots["round_graphs"] = args.round_graphs
    if args.tree_budget:
        slots["tree_budget"] = args.tree_budget
    if args.ttft:  # its prompts repeat: each timing prefills its whole prompt, not the rest after a kept state
        slots["prefix_cache"] = 0
    t0 = time.perf_counter()
    if args.shape == "demo":
        engine = Engine.from_pretrained(demo / "target", None if args.target_only else demo / "draft",
                                        device=args.device, progress=False, **slots)
    else:  # (a tree without random_init.SHAPES has only the demo pair here)
        from deltaflash.engine.config import EngineConfig
        from deltaflash.models.random_init import SHAPES, random_model

        model = random_model(SHAPES[args.shape](), torch.bfloat16, args.device)
        engine = Engine(model, None, None, EngineConfig(**slots))  # the serve defaults unless given
    started = time.perf_counter() - t0
    prompt = list(range(3, 60))
    # at a small max_model_len a sequence may finish inside the measurement: a new one takes its lane
    params = SamplingParams(max_new_tokens=min(4 * args.steps * 8, engine.config.max_model_len - len(prompt) - 16),
                            ignore_eos=True)

    if args.ttft:
        return ttft_profile(engine, args)
    print(f"{deltaflash.__file__}: {'target-only' if args.target_only else 'spec'}, {args.lanes} lane(s), "
          f"{args.steps} steps, {engine.config.max_slots} slots, max_model_len {engine.config.max_model_len}; "
          f"engine ready in {started:.1f} s{', collector frozen' if args.gc_freeze else ''}")
    if args.gc_freeze:
        gc.freeze()  # what a server does after start-up: the start-up objects leave the collector's scans

    def step(on_report=None):
        events = engine.step(on_report) if on_report is not None else engine.step()
        for ev in events:
            if ev.finish_reason:
                engine.add_request(prompt, params)
    for _ in range(args.lanes):
        engine.add_request(prompt, params)
    for _ in range(5):  # prefill and the first rounds
        step()
    walls, slow = [], []
    with watch() as seen:
        for i in range(args.steps):
            reports, mark = [], seen.mark()
            t0 = time.perf_counter()
            step(reports.append if args.slowest else None)
            sync()
            walls.append(time.perf_counter() - t0)
            slow.append((walls[-1], i, reports, seen.since(mark)))
    q = statistics.quantiles(walls, n=100)
    print(f"  step wall p50 {1e3 * q[49]:.3f} / p90 {1e3 * q[89]:.3f} / p99 {1e3 * q[98]:.3f} / max "
          f"{1e3 * max(walls):.3f} ms; {seen.describe()}")
    for wall, i, reports, (gc_ms, loads) in sorted(slow, reverse=True)[:args.slowest]:
        what = "; ".join(f"prefill {r.prefill_tokens} tok in {1e3 * r.prefill_s:.2f} ms, {r.decode_lanes} lanes "
                         f"{sum(r.widths)} rows in {1e3 * r.decode_s:.2f} ms, {r.preempted} preempted, pages "
                         f"{r.pages_used}/{r.pages_total}" for r in reports)
        print(f"    slow step {i}: {1e3 * wall:.2f} ms (gc {gc_ms:.2f} ms, kernel loads {loads}): {what}")
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.steps):
            step()
        sync()
    events = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    host_ops = sorted((e for e in events if e.self_cpu_time_total > 0), key=lambda e: -e.self_cpu_time_total)
    print(f"  step wall p50 {1e3 * statistics.median(walls):.3f} ms, mean {1e3 * statistics.fmean(walls):.3f} ms; "
          f"device busy {device_us / 1e3 / args.steps:.3f} ms per step (under the profiler)")
    print("  host ops by self CPU time per step (us, calls per step):")
    for e in host_ops[:args.rows]:
        print(f"    {e.self_cpu_time_total / args.steps:8.1f}  {e.count / args.steps:6.1f}  {e.key[:90]}")
    kernels = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: -e.self_device_time_total)
    print("  device kernels by time per step (us, launches per step):")
    for e in kernels[:args.rows]:
        print(f"    {e.self_device_time_total / args.steps:8.1f}  {e.count / args.steps:6.1f}  {kernel_name(e.key)}")
    if args.split:
        split_profile(engine, step, args.steps)
    if args.python:  # the host side by Python function: which of the engine's own code a step spends
        import cProfile
        import pstats
        with cProfile.Profile() as py:
            for _ in range(args.steps):
                step()
            sync()
        print(f"  Python functions by own time, {args.steps} steps (cProfile slows each call; compare rows):")
        pstats.Stats(py).sort_stats("tottime").print_stats(args.rows)


if __name__ == "__main__":
    main()
