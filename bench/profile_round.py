"""Profile the verify forward of the 9B shape (random bf16 weights) kernel by kernel with torch.profiler.

Usage: python bench/profile_round.py [LANES ...] [--width W] [--layers N] [--max-model-len N ...]
       [--skinny-gemm auto|off|TABLE]   (CUDA)
       python bench/profile_round.py [LANES ...] --tree-budget 0 16   (whole rounds: chain of W, trees of 16)

For each lane count: the forward is run eagerly (so every kernel is visible) and from its CUDA graph;
prints the graph replay time, the eager kernel count and summed kernel time, and the kernels grouped
by what they do, largest first. Plain decode is the same forward at width 1. Several --max-model-len
(a 256-token context each) show what of the forward grows with the configured capacity.

With --tree-budget, a whole round (`engine.step()`: drafting from a random script, verify, acceptance,
commit) is profiled instead, for each budget given (0: the chain of W rows), so a tree round's extra cost
over a chain round of the same rows is broken down by kernel group. Run it with DELTAFLASH_NO_CUDA_GRAPHS=1
to see every kernel of the verify forward (a replayed graph's kernels are listed too where the profiler
records them, but the eager round is what shows the launches).
"""

import argparse
import gc
import re
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from deltaflash.bench.common import time_ms
from deltaflash.bench.round import decoding_engine, verify_inputs
from deltaflash.models.random_init import qwen35_9b_config, random_model

# kernel name pattern -> group (first match wins)
GROUPS = (
    (r"gdn_verify", "GDN verify (Triton)"),
    (r"conv_tree", "conv tree step (Triton)"),
    (r"ranked_tree|greedy_walk|ancestor_mask|top_k_kernel", "tree build / walk / mask (Triton)"),
    (r"topk|sort|radix", "top-k / sort"),
    (r"rms_norm", "RMS norms (Triton)"),
    (r"fmha|attention|flash|softmax", "attention"),  # before GEMM: SDPA's kernels are cutlass too
    (r"gemm|gemv|cutlass|sm90|nvjet|splitK|ampere|xmma|skinny_linear", "GEMM"),  # (+ ops/gemm's split-K sum)
    (r"index|gather|scatter|Indexing|put_", "index / gather / scatter"),
    (r"reduce|mean|sum", "reductions (norms)"),
    (r"copy|cat|Cat", "copies / cat"),
    (r"elementwise|vectorized|unrolled", "elementwise"),
)


def group(name: str) -> str:
    return next((g for pattern, g in GROUPS if re.search(pattern, name, re.I)), "other")


def profile_forward(fn) -> tuple[int, float, dict, list]:
    """Kernel count, summed kernel ms, ms per group, top kernels of one call of fn."""
    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    kernels = [e for e in prof.events() if e.device_type == kind]  # on CPU (smoke test): every op, nested
    by_group, by_name = defaultdict(float), defaultdict(lambda: [0, 0.0])
    for e in kernels:
        ms = (e.device_time if cuda else e.cpu_time) / 1e3
        by_group[group(e.name)] += ms
        by_name[e.name][0] += 1
        by_name[e.name][1] += ms
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:15]
    return len(kernels), sum(by_group.values()), dict(by_group), top


@torch.inference_mode()
def main():
    p = argparse.ArgumentParser()
    p.add_argument("lanes", type=int, nargs="*", default=[1, 16])
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--device", default="cuda")
    p.add_argument("--max-model-len", type=int, nargs="+", default=[1024])
    p.add_argument("--skinny-gemm", default="auto", help="the engine's --skinny-gemm (auto, off or a table)")
    p.add_argument("--tree-budget", type=int, nargs="+", default=None,
                   help="profile whole rounds with these tree budgets (0: chains of --width) instead of the forward")
    args = p.parse_args()
    model = random_model(qwen35_9b_config(args.layers), torch.bfloat16, args.device)
    if args.tree_budget is not None:
        return profile_rounds(model, args)
    for lanes, capacity in ((n, c) for n in args.lanes for c in args.max_model_len):
        engine = decoding_engine(model, lanes, args.width, 256, capacity, skinny_gemm=args.skinny_gemm)
        runner = engine.runner
        inputs = verify_inputs(engine)
        eager = lambda: runner._verify_rows(*inputs[:3])  # noqa: E731  (the graphs' forward, run eagerly)
        eager_ms = time_ms(eager, 2, 5)
        graph_ms = time_ms(lambda: runner.verify(*inputs), 2, 10) if runner.graphs else float("nan")
        profile_forward(eager)  # profiler warm-up
        count, kernel_ms, groups, top = profile_forward(eager)
        report(f"lanes {lanes}, width {args.width}, max_model_len {capacity}: graph replay {graph_ms:.2f} ms, "
               f"eager {eager_ms:.2f} ms", count, kernel_ms, groups, top)
        del engine, runner, inputs, eager
        gc.collect()  # an engine is a reference cycle: free its pool before the next one sizes its own
        torch.cuda.empty_cache()


def report(title: str, count: int, kernel_ms: float, groups: dict, top: list) -> None:
    print(f"\n=== {title}, {count} kernels summing to {kernel_ms:.2f} ms (mean {kernel_ms / max(count, 1) * 1e3:.1f} us)")
    for g, ms in sorted(groups.items(), key=lambda kv: -kv[1]):
        print(f"  {g:28s} {ms:8.3f} ms")
    for name, (n, ms) in top:
        print(f"  {n:5d} x {ms / n * 1e3:8.1f} us  {ms:7.3f} ms  {name[:110]}")


def profile_rounds(model, args) -> None:
    """Whole rounds (engine.step) per lane count, capacity and tree budget, timed and profiled."""
    for lanes, capacity, budget in ((n, c, b) for n in args.lanes for c in args.max_model_len for b in args.tree_budget):
        engine = decoding_engine(model, lanes, args.width, 256, capacity, tree_budget=budget,
                                 skinny_gemm=args.skinny_gemm)
        step = engine.step
        ms = time_ms(step, 3, 10)
        profile_forward(step)  # profiler warm-up
        kind = f"tree of {budget}" if budget else f"chain of {args.width}"
        report(f"lanes {lanes}, {kind}, max_model_len {capacity}: round {ms:.2f} ms wall", *profile_forward(step))
        del engine, step
        gc.collect()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
