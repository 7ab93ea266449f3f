"""Timing helpers shared by the benchmarks: CUDA-event medians, measured copy bandwidth, reports."""

from __future__ import annotations

import gc
import json
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from deltaflash.engine.graphs import capture


def time_ms(fn, warmup: int = 3, iters: int = 10, before=None) -> float:
    """Median milliseconds of fn() (CUDA events on GPU, perf_counter on CPU); `before` (optional) runs
    ahead of each timed call, outside the timing (work it queues on the device runs before the start event)."""
    for _ in range(warmup):
        fn()
    times = []
    cuda = torch.cuda.is_available()
    for _ in range(iters):
        if before is not None:
            before()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def graph_ms(fn, reps: int = 20, trials: int = 5) -> float:
    """Device milliseconds per fn() (CUDA): `reps` calls captured in one CUDA graph, median of `trials`
    replays. No host launch cost is counted, as in the engine's graph-replayed rounds; fn must not
    sync with the host."""
    graph, _ = capture(lambda: [fn() for _ in range(reps)], warmups=1)
    graph.replay()
    return time_ms(graph.replay, warmup=1, iters=trials) / reps


def copy_bandwidth_gbs(device, nbytes: int = 4 << 30) -> float:
    """Device-to-device copy rate in GB/s, counting bytes read plus bytes written."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), warmup=3, iters=10)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def matmul_tflops(device, n: int = 8192) -> float:
    """Measured bf16 GEMM rate in TFLOP/s (an n x n x n product; 256 on the CPU): the rate a compute
    limit divides by."""
    n = n if torch.device(device).type == "cuda" else 256
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    ms = time_ms(lambda: a @ b, warmup=3, iters=10)
    return 2 * n ** 3 / (ms * 1e-3) / 1e12


def machine() -> dict:
    info = {"python": sys.version.split()[0], "torch": torch.__version__, "host": platform.node(),
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    return info


def print_table(title: str, rows: list[dict]) -> None:
    if not rows:
        return
    cols = list(rows[0])
    width = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in cols}
    print(f"\n{title}")
    print("  ".join(c.ljust(width[c]) for c in cols))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).ljust(width[c]) for c in cols))


def _fmt(v) -> str:
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def write_json(path: str | Path | None, payload: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(payload, indent=2))


def share_of_device(device: torch.device, engines_left: int, target: float) -> float:
    """`gpu_memory_utilization` for the next of `engines_left` engines one process builds on `device`:
    an equal part of what the memory in use leaves below `target` (the engines' own setting). Each engine
    sizes its page pool from the memory in use when it is built, so the first would otherwise take all of
    it. Engines dropped before are collected first (an engine is a reference cycle: its graphs hold its
    methods). Off CUDA, `target` (the CPU's pools have a fixed budget)."""
    if device.type != "cuda":
        return target
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    used = 1 - free / total
    return used + max(target - used, 0.0) / engines_left
