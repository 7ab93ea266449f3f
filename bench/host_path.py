"""The host's own cost of a first token, on any machine: an engine of the tiny "toy" shape on the CPU whose
prefill graphs are stand-ins that return at once (logits of zeros), so what is timed is the engine's Python
and its small tensor work from add_request to the first token - scheduling, pages, the graph's inputs,
acceptance, emission - without the model. The GPU's own host figures (step_profile.py --ttft --split) swing
2x between runs on the lent machines; this one resolves tens of microseconds, side by side with an older tree:

    python bench/host_path.py [--tokens 256 2048] [--requests 200]
    (cd old-tree && PYTHONPATH=$PWD python ../bench/host_path.py)

CUDA calls cost more than their CPU counterparts (a transfer, a launch): what moves here is the Python.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import numpy as np
import torch

import deltaflash
from deltaflash.engine.config import EngineConfig
from deltaflash.engine.engine import Engine
from deltaflash.engine.graphs import prefill_graph_buckets
from deltaflash.models.random_init import SHAPES, random_model

try:
    from deltaflash.core.request import SamplingParams
except ImportError:  # trees before the core/ package
    from deltaflash.engine.request import SamplingParams


class StandIn:
    """A prefill graph of T rows that replays at once: zeros for each lane (its last row's hidden state
    [width = H], or in trees before the runner projected the rows itself its logits [width = V])."""

    def __init__(self, buckets: tuple[int, ...], width: int):
        self.buckets, self.calls = buckets, 0
        self.out = torch.zeros(buckets[-1], width)

    def run_host(self, *inputs):
        self.calls += 1
        return (self.out[:len(inputs[0])],)

    def run(self, *inputs):  # (trees before run_host)
        self.calls += 1
        return (self.out[:inputs[0].shape[0]],)


def main(argv: list[str] | None = None) -> dict[int, float]:
    """Prints, and returns, the p50 seconds per prompt length."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[256, 2048])
    ap.add_argument("--requests", type=int, default=200)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    cfg = SHAPES["toy"](num_layers=2)
    engine = Engine(random_model(cfg, torch.float32, "cpu"), None, None, EngineConfig())  # the serve defaults
    runner, config = engine.runner, engine.config
    buckets = prefill_graph_buckets(config.round_prefill_tokens, config.max_slots, config.max_model_len,
                                    config.idle_prefill_tokens)
    width = cfg.hidden_size if hasattr(runner, "_prefill_hidden") else cfg.vocab_size
    runner.prefill_graphs = {T: StandIn(lanes, width) for T, lanes in buckets.items()}
    if width != cfg.vocab_size:  # the runner projects the rows that sample a token: a stand-in there too (on the
        zeros = torch.zeros(max(buckets[max(buckets)]), cfg.vocab_size)  # CPU a GEMM timed on the threads)
        engine.model.logits = lambda hidden, *args, **kwargs: zeros[:hidden.shape[0]]
    engine.scheduler.config = dataclasses.replace(engine.scheduler.config, prefill_graphs=True)
    params = SamplingParams(max_new_tokens=1, ignore_eos=True)
    rng = np.random.default_rng(0)
    print(f"{deltaflash.__file__}: host time from add_request to the first token, toy shape on the CPU, "
          f"{config.max_slots} slots, max_model_len {config.max_model_len}, prefill graphs standing in "
          f"(us, {args.requests} requests per length)")
    p50 = {}
    for n in args.tokens:
        # a new prompt each (a prompt seen before would start from the prefix cache's branch point short of its end)
        prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for _ in range(args.requests + 20)]
        times, replays = [], sum(g.calls for g in runner.prefill_graphs.values())
        for i in range(args.requests + 20):
            t0 = time.perf_counter()
            engine.add_request(prompts[i], params)
            while engine.has_work():
                engine.step()
            times.append(time.perf_counter() - t0)
        if sum(g.calls for g in runner.prefill_graphs.values()) - replays != args.requests + 20:
            raise SystemExit(f"{n}-token prompts did not each replay one stand-in graph: the figure would time the model")
        times = times[20:]
        p50[n] = statistics.median(times)
        print(f"  {n:5d} tokens: p50 {1e6 * p50[n]:7.1f}  min {1e6 * min(times):7.1f}")
    return p50


if __name__ == "__main__":
    main()
