"""Would a step's prefill chunk and its round overlap on two streams? (issue 15's ITL ratio)

A step that prefills beside a round runs the two one after the other: at C = 8 on the H200 (9B shape,
target-only) a 512-row chunk's graph and the decode graph take 20.6 ms against 7.0 for the decode alone, so a
stream's token waits ~3x its usual time. The two touch disjoint slots and pages, and they are different kinds of
work - the chunk's GEMMs are compute-bound, the decode's (8 rows) read the weights - so on two streams the decode
could run in the chunk's shadow. This script measures how much: a target-only engine of random weights at the
serve defaults; one prefill graph of T rows captured again in a pool and on a capture stream of its own (two
graphs that share a memory pool, or cuBLAS's workspace through one capture stream, must not run at once), and
the engine's decode graph at the lane bucket; replays on padding lanes (slot -1: every row computed, state
written to the sink), each alone, one after the other, and side by side on two streams. Nothing in the engine
changes: the figure says whether the engine should.

    python bench/stream_overlap.py [--shape 9b] [--rows 512 256] [--lanes 8 32] [--reps 20]
"""

from __future__ import annotations

import argparse

import torch

from deltaflash.bench.common import time_ms


def median_ms(fn, reps: int) -> float:
    """CUDA events around fn() on the current stream (the two-stream run joins it before its end event), the
    device idle before each."""
    return time_ms(fn, iters=reps, before=torch.cuda.synchronize)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="9b")
    ap.add_argument("--rows", type=int, nargs="+", default=[512, 256])
    ap.add_argument("--lanes", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()

    from deltaflash.engine.config import EngineConfig
    from deltaflash.engine.engine import Engine
    from deltaflash.engine.graphs import capture
    from deltaflash.models.random_init import SHAPES, random_model

    engine = Engine(random_model(SHAPES[args.shape](), torch.bfloat16, "cuda"), None, None, EngineConfig())
    runner = engine.runner
    print(f"{args.shape} target-only engine, serve defaults; {torch.cuda.get_device_name()}; ms per step, median of "
          f"{args.reps}", flush=True)
    main_stream, side = torch.cuda.current_stream(), torch.cuda.Stream()
    for T in args.rows:
        graphs = runner.prefill_graphs[T]
        inputs = tuple(s[:1] for s in graphs.static)  # one padding lane of T rows
        with torch.inference_mode():
            prefill, _ = capture(lambda: graphs.fn(*inputs), torch.cuda.graph_pool_handle(), 1, torch.cuda.Stream())
        for L in args.lanes:
            decode = runner.decode_graphs.graphs[runner.decode_graphs.bucket(L)][0]

            def serial():
                prefill.replay()
                decode.replay()

            def overlapped():
                side.wait_stream(main_stream)
                with torch.cuda.stream(side):
                    prefill.replay()
                decode.replay()
                main_stream.wait_stream(side)

            alone_p, alone_d = median_ms(prefill.replay, args.reps), median_ms(decode.replay, args.reps)
            one_after, side_by_side = median_ms(serial, args.reps), median_ms(overlapped, args.reps)
            print(f"  prefill {T:4d} rows {alone_p:7.2f} | decode {L:3d} lanes {alone_d:6.2f} | one after the other "
                  f"{one_after:7.2f} ({one_after / alone_d:.2f}x the decode) | two streams {side_by_side:7.2f} "
                  f"({side_by_side / alone_d:.2f}x; {one_after - side_by_side:+.2f} ms)", flush=True)


if __name__ == "__main__":
    main()
