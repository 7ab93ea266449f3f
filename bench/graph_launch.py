"""What a CUDA graph launch costs the host on this machine, and what the engine's graphs are made of.

The step profiles put ~0.25 ms of host time in each `cudaGraphLaunch` of the demo pair's graphs (a few
hundred kernels each): on a 16 MB model that is a third of a speculative step. CUDA launches a
straight-line graph of kernel nodes in about constant time; other graphs (memcpy nodes, branches
from a second stream) may cost per node. This script measures both sides:

1. synthetic graphs of N tiny kernels - straight line, with memcpy nodes, with a side-stream branch -
   host microseconds per `replay()` (the device idle before each: a launch that queues behind work
   measures the queue);
2. the bundled demo pair's engine graphs (speculative engine): per graph and bucket, node count by type,
   edges, and host microseconds per replay.

    python bench/graph_launch.py [--lanes 8] [--device cuda] [--dot DIR]
"""

from __future__ import annotations

import argparse
import collections
import re
import statistics
import tempfile
import time
from pathlib import Path

import torch

import deltaflash


def host_us(replay, repeats: int = 60) -> float:
    """Median host microseconds of one replay() call, the device idle before each."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        replay()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return 1e6 * statistics.median(times[5:])


def synthetic(kind: str, n: int) -> torch.cuda.CUDAGraph:
    x, y = torch.zeros(256, device="cuda"), torch.zeros(256, device="cuda")
    side = torch.cuda.Stream()

    def body():
        for i in range(n):
            if kind == "memcpy" and i % 8 == 0:
                y.copy_(x)  # same dtype, contiguous: cudaMemcpyAsync, a memcpy node
            if kind == "branch" and i % 16 == 0:
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    x.mul_(1.0)
                torch.cuda.current_stream().wait_stream(side)
            x.add_(1.0)

    body()
    graph = torch.cuda.CUDAGraph()
    graph.enable_debug_mode()
    with torch.cuda.graph(graph):
        body()
    return graph


def dot_summary(graph: torch.cuda.CUDAGraph, path: Path) -> tuple[int, collections.Counter, int]:
    """(nodes, node-type words seen, edges) from the graph's DOT dump (cudaGraphDebugDotPrint)."""
    graph.debug_dump(str(path))
    text = path.read_text()
    nodes = len(set(re.findall(r"graph_\d+_node_\d+", text)))
    types = collections.Counter(re.findall(r"\b(KERNEL|MEMSET|MEMCPY|HOST|EMPTY|EVENT_RECORD|WAIT_EVENT|MEM_ALLOC|"
                                           r"MEM_FREE|CONDITIONAL|CHILD_GRAPH|BATCH_MEM_OP)\b", text.upper()))
    return nodes, types, text.count("->")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lanes", type=int, default=8)
    ap.add_argument("--dot", default=None, help="keep the DOT dumps in this folder")
    args = ap.parse_args()
    folder = Path(args.dot or tempfile.mkdtemp())
    folder.mkdir(parents=True, exist_ok=True)

    print("synthetic graphs: host us per replay (device idle before it), node types, edges")
    for kind in ("line", "memcpy", "branch"):
        for n in (16, 128, 512):
            graph = synthetic(kind, n)
            nodes, types, edges = dot_summary(graph, folder / f"synthetic-{kind}-{n}.dot")
            print(f"  {kind:7s} {n:4d} kernels: {host_us(graph.replay):8.1f} us  {nodes} nodes {dict(types)} "
                  f"edges {edges}")

    # the engine's own graphs: every capture in debug mode, so each can be dumped
    made = []
    plain = torch.cuda.CUDAGraph

    class Recorded(plain):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.enable_debug_mode()
            made.append(self)

    torch.cuda.CUDAGraph = Recorded
    from deltaflash.engine.engine import Engine

    demo = Path(deltaflash.__file__).parent / "assets" / "demo"
    engine = Engine.from_pretrained(demo / "target", demo / "draft", device="cuda", progress=False)
    torch.cuda.CUDAGraph = plain
    print(f"demo pair, speculative engine: {len(made)} graphs captured")
    owners = {}
    for fn in engine.runner.graphs.functions:
        for bucket, (graph, _) in fn.graphs.items():
            owners[id(graph)] = (fn.name, bucket)
    rows = []
    for i, graph in enumerate(made):
        name, bucket = owners.get(id(graph), (f"graph {i}", 0))
        if bucket not in (0, args.lanes) and not name.startswith("prefill"):
            continue
        nodes, types, edges = dot_summary(graph, folder / f"engine-{i}.dot")
        rows.append((name, bucket, nodes, dict(types), edges, host_us(graph.replay)))
    for name, bucket, nodes, types, edges, us in rows:
        print(f"  {name:28s} bucket {bucket:3d}: {nodes:4d} nodes {types} edges {edges:4d}  host {us:8.1f} us")


if __name__ == "__main__":
    main()
