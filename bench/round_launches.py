"""How many device launches a speculative round makes from the host, by kind, before and after the
step's one read - the host cost of a round where the model is small (the demo pair on the H200 spends
more of a round launching than computing). Runs on the CPU under TRITON_INTERPRET=1 with the fused
kernels on tests' tiny pair (launch counts do not depend on the model's size): every eager torch op that
launches a kernel counts one, every Triton launch one, and every call that replays a CUDA graph on a GPU
(drafter block / trees, verify, context append, greedy round graphs) one plus one copy per input.

    TRITON_INTERPRET=1 python bench/round_launches.py [--tree-budget 16] [--round-graphs] [--rounds 4]
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import sys
import tempfile
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.spec_pairs builds the tiny pair

# ops that launch nothing (views, allocations, host reads)
FREE = {"view", "_unsafe_view", "expand", "slice", "select", "t", "transpose", "permute", "unsqueeze", "squeeze",
        "as_strided", "empty", "empty_like", "empty_strided", "new_empty", "detach", "alias", "split",
        "split_with_sizes", "unbind", "lift_fresh", "_reshape_alias", "movedim", "unflatten", "narrow", "diagonal",
        "_local_scalar_dense", "view_as", "chunk", "expand_as", "resolve_conj", "resolve_neg", "set_"}
# a view where the layout allows one, else a copy (one launch): counted as "<name> (copy)" when the result
# does not share the input's storage
VIEW_OR_COPY = {"reshape", "flatten", "contiguous"}


class Launches(TorchDispatchMode):
    """Counts launches per phase; `as_one` wraps a function whose calls count `n` launches however many
    ops they run (a Triton kernel, a graph replay)."""

    def __init__(self):
        super().__init__()
        self.phase, self.muted = None, 0
        self.by_phase = collections.defaultdict(collections.Counter)

    def tally(self, name: str, n: int = 1) -> None:
        if self.phase is not None and not self.muted:
            self.by_phase[self.phase][name] += n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._overloadpacket.__name__
        out = func(*args, **(kwargs or {}))
        if name in VIEW_OR_COPY:
            if out.untyped_storage().data_ptr() != args[0].untyped_storage().data_ptr():
                self.tally(f"{name} (copy)")
        elif name not in FREE:
            self.tally(name)
        return out

    def as_one(self, fn, name: str, n: int = 1):
        def counted(*args, **kwargs):
            self.tally(name, n)
            self.muted += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.muted -= 1
        return counted


def interpreted_launches() -> Launches:
    """A counter with every Triton launch counted as one: the kernels run interpreted on the CPU, so the
    process must run under TRITON_INTERPRET=1 (it exits otherwise)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1 (the fused kernels on the CPU)")
    from triton.runtime import interpreter

    count = Launches()
    launch = interpreter.InterpretedFunction.run
    interpreter.InterpretedFunction.run = lambda self, *a, **k: count.as_one(launch, "triton " + self.fn.__name__)(
        self, *a, **k)
    return count


class _Graph:
    def __init__(self, run):
        self.run = run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree-budget", type=int, default=0, help="tree rounds of N nodes (0: chains of the block)")
    ap.add_argument("--round-graphs", action="store_true", help="greedy rounds as one graph (EngineConfig.round_graphs)")
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    count = interpreted_launches()

    import deltaflash.engine.runner as runner_module
    from deltaflash.core.request import SamplingParams
    from tests.spec_pairs import engine_for, make_pair, prompts

    target, draft = make_pair(Path(tempfile.mkdtemp()), "dense_gqa", "dflash", block_size=8)
    budget = args.tree_budget
    engine = engine_for(target, draft, kernels="triton", max_slots=1, max_model_len=128, tree_budget=budget,
                        tree_top_k=4)
    runner, source = engine.runner, engine.runner.source
    for obj, name, inputs in ((source, "draft_tree", 3), (source, "_block", 3), (source, "append", 3),
                              (runner, "_verify_rows", 5 if budget else 3)):
        setattr(obj, name, count.as_one(getattr(obj, name), f"graph {name.strip('_')}", 1 + inputs))
    if args.round_graphs:  # what the CUDA graphs would replay, as one launch plus their inputs' copies
        runner.round_graphs = {("tree", budget): _Graph(count.as_one(runner._greedy_tree_round, "graph tree round", 6))} \
            if budget else {w: _Graph(count.as_one(functools.partial(runner._greedy_round, width=w), "graph round", 5))
                            for w in runner.widths[1:]}
    read = runner_module.read_emitted

    def reading(*a, **k):
        out = read(*a, **k)
        if count.phase is not None:
            count.phase = "after the read"
        return out

    runner_module.read_emitted = reading
    engine.add_request(prompts(96, [9])[0], SamplingParams(max_new_tokens=8 * args.rounds, ignore_eos=True))
    engine.step()  # the prefill
    rounds = 0
    with count, torch.inference_mode():
        while engine.has_work() and rounds < args.rounds:
            count.phase = "before the read"
            engine.step()
            count.phase = None
            rounds += 1
    label = f"tree of {budget}" if budget else "chain of 8"
    total = sum(sum(c.values()) for c in count.by_phase.values()) / rounds
    print(f"{label}{', round graphs' if args.round_graphs else ''}: {total:.1f} launches per round")
    for phase, c in count.by_phase.items():
        print(f"  {phase}: {sum(c.values()) / rounds:.1f} - " + ", ".join(f"{k} {v / rounds:g}" for k, v in c.most_common()))


if __name__ == "__main__":
    main()
