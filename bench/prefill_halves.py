"""Issue 15's 2048-token TTFT: a prompt's prefill as two halves whose layers run in turn on two streams
(Qwen35Model.extend_pipelined: the second half's layer l beside the first half's layer l + 1, so one half's
bandwidth- and latency-bound kernels - fla-core's chunked rule, norms, SwiGLU's activation, the conv - can run
under the other's GEMMs), against the whole prompt in one forward (the engine's route) and the two halves one
after another. Fixed-shape batches (the engine's prefill-graph route) in CUDA graphs, alternated, CUDA events;
checks that the pipelined halves give the serial halves' logits and state bit for bit.

    python bench/prefill_halves.py [--tokens 2048] [--shape 9b] [--layers N] [--reps 10]
    TRITON_INTERPRET=1 python bench/prefill_halves.py --shape toy --tokens 128 --reps 1   # CPU dry run (no streams)
"""

from __future__ import annotations

import argparse
import statistics

import torch

from deltaflash.cache.slots import SlotPool
from deltaflash.core.batch import ExtendBatch
from deltaflash.models.random_init import SHAPES, random_model
from deltaflash.ops.gdn import fla_launch
from deltaflash.ops.kernels import reference_kernels, triton_kernels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="9b")
    ap.add_argument("--layers", type=int, default=None, help="layers of the shape (default: its own)")
    ap.add_argument("--reps", type=int, default=10, help="timed replays of each route, alternated")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    cfg = SHAPES[args.shape](*([args.layers] if args.layers else []))
    model = random_model(cfg, torch.bfloat16 if cuda else torch.float32, device)
    kernels = triton_kernels() if cuda else reference_kernels()
    if cuda:
        table = fla_launch.bundled_table(torch.cuda.get_device_name(device))
        fla_launch.use(fla_launch.LaunchTable.load(table) if table is not None else None)
    T, half = args.tokens, args.tokens // 2
    pool = SlotPool(cfg, 1, T + 64, model.embed_tokens.weight.dtype, device)
    ids = torch.randint(0, cfg.vocab_size, (1, T), generator=torch.Generator().manual_seed(0)).to(device)
    lane = lambda v: torch.tensor([v], device=device)  # noqa: E731

    def batch(lo: int, hi: int) -> ExtendBatch:
        return ExtendBatch.padded(ids[:, lo:hi], lane(0), lane(lo), lane(hi - lo), lane(0), starts_sequences=lo == 0)

    whole, first, second = batch(0, T), batch(0, half), batch(half, T)
    streams = [torch.cuda.Stream(), torch.cuda.Stream()] if cuda else None
    routes = {
        "whole": lambda: model.extend(whole, pool, kernels)[0],
        "halves": lambda: (model.extend(first, pool, kernels), model.extend(second, pool, kernels)[0])[1],
        "pipelined": lambda: model.extend_pipelined([first, second], pool, kernels, streams)[1][0],
    }

    def state() -> torch.Tensor:
        return torch.cat([pool.recurrent_state[0].flatten().float(), pool.conv_history[0].flatten().float()])

    outputs = {}
    for name, route in routes.items():
        pool.reset(0)
        outputs[name] = (route().clone(), state())
    same = all(torch.equal(a, b) for a, b in zip(outputs["halves"], outputs["pipelined"]))
    gap = (outputs["whole"][0] - outputs["halves"][0]).abs().max().item()
    print(f"{torch.cuda.get_device_name(device) if cuda else 'cpu'}: {args.shape} ({cfg.num_layers} layers), "
          f"{T} tokens; pipelined halves == serial halves (logits, state) bit for bit: {same}; "
          f"whole against halves: logits differ by {gap:.3g} at most")
    if not cuda:
        return
    replays = {}
    for name, route in routes.items():
        for _ in range(2):  # (first use: compiles and autotunes outside the capture)
            pool.reset(0)
            route()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        pool.reset(0)
        with torch.cuda.graph(graph):
            route()
        replays[name] = graph.replay
    times = {name: [] for name in routes}
    for _ in range(args.reps):
        for name, replay in replays.items():
            pool.reset(0)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            replay()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end))
    base = statistics.median(times["whole"])
    for name, ms in times.items():
        p50 = statistics.median(ms)
        print(f"  {name:>9}: {p50:8.3f} ms p50 (min {min(ms):.3f}) = {p50 / base:.3f}x the whole prompt's forward")


if __name__ == "__main__":
    main()
