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

    python bench/graph_launch.py [--lanes 8]
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import statistics
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
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph):
        body()
    graph.instantiate()
    return graph


NODE_TYPES = {0: "kernel", 1: "memcpy", 2: "memset", 3: "host", 4: "child graph", 5: "empty", 6: "wait event",
              7: "event record", 8: "semaphore signal", 9: "semaphore wait", 10: "mem alloc", 11: "mem free",
              12: "batch mem op", 13: "conditional"}


def _cudart() -> ctypes.CDLL:
    """The CUDA runtime torch loaded (its path from this process's memory map)."""
    with open("/proc/self/maps") as maps:
        path = next((line.split()[-1] for line in maps if "libcudart.so" in line), "libcudart.so")
    return ctypes.CDLL(path)


def graph_shape(graph: torch.cuda.CUDAGraph) -> tuple[int, collections.Counter, int]:
    """(nodes, nodes by type, edges) of a graph kept after capture (keep_graph=True): edges == nodes - 1
    for a straight line."""
    rt, handle = _cudart(), ctypes.c_void_p(graph.raw_cuda_graph())
    count = ctypes.c_size_t(0)
    assert rt.cudaGraphGetNodes(handle, None, ctypes.byref(count)) == 0
    nodes = (ctypes.c_void_p * count.value)()
    assert rt.cudaGraphGetNodes(handle, nodes, ctypes.byref(count)) == 0
    types = collections.Counter()
    for node in nodes:
        kind = ctypes.c_int(-1)
        rt.cudaGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind))
        types[NODE_TYPES.get(kind.value, str(kind.value))] += 1
    version = ctypes.c_int(0)
    rt.cudaRuntimeGetVersion(ctypes.byref(version))
    edges = ctypes.c_size_t(0)
    if version.value >= 13000:  # (CUDA 13 added the edge data argument)
        rt.cudaGraphGetEdges(handle, None, None, None, ctypes.byref(edges))
    else:
        rt.cudaGraphGetEdges(handle, None, None, ctypes.byref(edges))
    return count.value, types, edges.value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lanes", type=int, default=8)
    args = ap.parse_args()

    print("synthetic graphs: host us per replay (device idle before it), node types, edges")
    for kind in ("line", "memcpy", "branch"):
        for n in (16, 128, 512):
            graph = synthetic(kind, n)
            nodes, types, edges = graph_shape(graph)
            print(f"  {kind:7s} {n:4d} kernels: {host_us(graph.replay):8.1f} us  {nodes} nodes {dict(types)} "
                  f"edges {edges}")

    # the engine's own graphs, each kept after its capture so its nodes can be listed
    made = []
    plain = torch.cuda.CUDAGraph

    class Recorded(plain):
        def __new__(cls, *a, **k):
            return super().__new__(cls, keep_graph=True)

        def __init__(self, *a, **k):
            super().__init__(keep_graph=True)
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
        nodes, types, edges = graph_shape(graph)
        rows.append((name, bucket, nodes, dict(types), edges, host_us(graph.replay)))
    for name, bucket, nodes, types, edges, us in rows:
        print(f"  {name:28s} bucket {bucket:3d}: {nodes:4d} nodes {types} edges {edges:4d}  host {us:8.1f} us")


if __name__ == "__main__":
    main()
