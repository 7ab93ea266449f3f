"""Which steps of the demo pair's C = 64 wave run their prefill eagerly, on this CPU box: the bench's speculative
engine (adaptive widths, the prefill budget scaled beside rounds, max_slots 64, prefix cache off) with prefill
graphs standing in (the captured function called eagerly, so outputs and acceptance are real), an eager step
costing EAGER graph rows (on CUDA: measured at start) and the rounds' costs faked (the CPU's timings decide
nothing): a width-w round costs 1 + SLOPE x (w - 1) plain rounds. Prints every step that prefills: its chunks'
tokens, the plan's graph (None: eager), the budget and the round's lanes.

    python docs/bench/cpu-s45/demo_plans.py [--eager 3000] [--slopes 0.02 0.05 0.1 0.2] [--concurrency 64]
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from deltaflash.bundled import BUNDLED
from deltaflash.core.request import SamplingParams
from deltaflash.engine.config import EngineConfig
from deltaflash.engine.engine import Engine
from deltaflash.engine.graphs import prefill_shapes, prefill_lane_buckets
from deltaflash.models.dflash import load_drafter
from deltaflash.models.loader import load_model
from deltaflash.tokenizer import encode_prompt, load_tokenizer
from deltaflash.train.corpus import heldout_prompts, load_split


class Eager:
    """A prefill graph standing in: the captured function called eagerly; `replays` records (T, lanes)."""

    def __init__(self, fn, T, lanes, replays):
        self.fn, self.T, self.buckets, self.replays = fn, T, prefill_lane_buckets(T, lanes), replays

    def run_host(self, *inputs):
        self.replays.append((self.T, len(inputs[0])))
        return (self.fn(*(torch.from_numpy(x) for x in inputs)),)


def wave(model, drafter, tokenizer, prompts, concurrency, eager, slope):
    config = EngineConfig(max_slots=concurrency, speculation="adaptive", scale_prefill_budget=True, prefix_cache=0,
                          share_prompts=False)
    engine = Engine(model, tokenizer, drafter, config)
    runner, c = engine.runner, engine.config
    shapes = prefill_shapes(c.round_prefill_tokens, c.max_slots, c.max_model_len, c.idle_prefill_tokens)
    replays = []
    runner.prefill_graphs = {T: Eager(runner._prefill_rows, T, lanes, replays) for T, lanes in shapes}
    engine.scheduler.config = dataclasses.replace(engine.scheduler.config, prefill_graphs=True)
    engine.scheduler.eager_prefill_rows = eager
    if hasattr(runner, "eager_rows"):  # (trees before the plan carried the choice)
        runner.eager_rows = eager
    costs = engine.scheduler.costs
    costs.cost = lambda bucket, width: 1e-3 * (1 + 0.02 * bucket) * (1 + slope * (width - 1))
    plans, schedule = [], engine.scheduler.schedule

    def recording():
        plan = schedule()
        if plan.prefill:
            plans.append(plan)
        return plan

    engine.scheduler.schedule = recording
    params = SamplingParams(max_new_tokens=128)
    for i in range(concurrency):
        engine.add_request(prompts[i % len(prompts)], params)
    steps = []  # (plan, the graph (T, lanes) it replayed or None: eager)
    while engine.has_work():
        plans.clear()
        replays.clear()
        engine.step()
        if plans:
            steps.append((plans[0], replays[0] if replays else None))
    return steps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--eager", type=float, default=3000.0)
    ap.add_argument("--slopes", type=float, nargs="+", default=[0.02, 0.05, 0.1, 0.2])
    ap.add_argument("--concurrency", type=int, default=64)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = load_model(BUNDLED / "target", dtype=torch.float32, device=torch.device("cpu"), progress=False)
    cfg = model.cfg
    drafter = load_drafter(BUNDLED / "draft", target_hidden_size=cfg.hidden_size, target_vocab_size=cfg.vocab_size,
                           target_num_layers=cfg.num_layers, dtype=torch.float32, device=torch.device("cpu"))
    tokenizer = load_tokenizer(BUNDLED / "target")
    prompts = [encode_prompt(tokenizer, t) for t in heldout_prompts(load_split(), 16, num_lines=12)]
    print("prompt tokens:", sorted(len(p) for p in prompts))
    for slope in args.slopes:
        steps = wave(model, drafter, tokenizer, prompts, args.concurrency, args.eager, slope)
        print(f"slope {slope}: {len(steps)} prefill steps, {sum(g is None for _, g in steps)} eager")
        for p, graph in steps:
            lens = [len(ch.tokens) for ch in p.prefill]
            print(f"   {'EAGER' if graph is None else 'graph'} {graph} tokens {sum(lens)} "
                  f"in {len(lens)} chunks {sorted(lens)[:3]}..{sorted(lens)[-3:]} budget {p.prefill_budget} "
                  f"lanes {len(p.decode)} W {p.round_width}")


if __name__ == "__main__":
    main()
