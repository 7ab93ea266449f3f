"""What a CUDA graph launch costs the host on this machine, and what the engine's graphs are made of.

The step profiles put ~0.18-0.25 ms of host time in each `cudaGraphLaunch` of the demo pair's graphs (a
few hundred kernels each): on a 16 MB model that is a third of a speculative step. Yet graphs of up to 512
torch elementwise kernels - a straight line, with memcpy nodes, or branching through a second stream -
launched in 3-5 us on the H200 (seventeenth session). This script looks for the difference:

1. synthetic graphs of N tiny nodes - torch elementwise kernels (a straight line, with memcpy nodes, with a
   side-stream branch), Triton kernels, cuBLAS GEMMs - host microseconds per `replay()` with the device
   idle before it, and (`busy`) right behind a long device sleep, as a step's launches are;
2. an engine's graphs (the bundled demo pair's speculative engine, or `--shape 9b`: a target-only engine of
   random weights at the serve defaults; compiling its kernels takes a fresh machine about a minute): per
   graph and bucket, node count by type, edges, host microseconds per replay, and what the launch costs the
   device: the replay's time between CUDA events with the device idle before it, less the same replay's time
   queued behind a device sleep (its kernels alone) - the device waiting on the host's launch.

3. `--gemms ROWS...`: each of the 9B shape's prefill GEMMs (cuBLAS through F.linear) captured alone at
   those row counts: its graph's nodes by type (cuBLAS adds memset nodes for some kernels) and the
   replay's device time.

    python bench/graph_launch.py [--lanes 8] [--skip-synthetic] [--skip-engine] [--shape demo|9b]
                                 [--gemms 512 2048]
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import statistics
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

import deltaflash
from deltaflash.bench.common import time_ms


@triton.jit
def _bump(x, N: tl.constexpr):
    o = tl.arange(0, N)
    tl.store(x + o, tl.load(x + o) + 1.0)


def host_us(replay, repeats: int = 60, busy: bool = False) -> float:
    """Median host microseconds of one replay() call, the device idle before each (busy: queued behind
    ~1 ms of device sleep, as a step's second and third launches are behind its first)."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        if busy:
            torch.cuda._sleep(2_000_000)  # cycles: ~1 ms at the H200's clock
        t0 = time.perf_counter()
        replay()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return 1e6 * statistics.median(times[5:])


def device_ms(replay, repeats: int = 10, busy: bool = False) -> float:
    """Median milliseconds between CUDA events recorded around one replay(), the device idle before it
    (busy: both queued behind a device sleep, so the events time the graph's kernels alone, not its launch)."""
    def settle():
        torch.cuda.synchronize()
        if busy:
            torch.cuda._sleep(20_000_000)  # cycles: ~10 ms, longer than any launch
    return time_ms(replay, warmup=0, iters=repeats, before=settle)


def synthetic(kind: str, n: int) -> torch.cuda.CUDAGraph:
    x, y = torch.zeros(256, device="cuda"), torch.zeros(256, device="cuda")
    a, b = torch.randn(16, 256, device="cuda", dtype=torch.bfloat16), torch.randn(256, 256, device="cuda",
                                                                                  dtype=torch.bfloat16)
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
            if kind == "triton":
                _bump[(1,)](x, N=256)
            elif kind == "gemm":
                torch.mm(a, b)
            else:
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


# (out, in) of the 9B shape's prefill GEMMs: GDN in_proj (qkv, z, b, a merged), GDN out_proj, attention
# q (with its gate) / k / v merged, o_proj, MLP gate / up merged, down_proj
GEMMS_9B = {"gdn in": (8192 + 4096 + 64, 4096), "gdn out": (4096, 4096), "attn qkv": (8192 + 2048, 4096),
            "attn o": (4096, 4096), "mlp gate/up": (2 * 12288, 4096), "mlp down": (4096, 12288)}


def gemm_graphs(rows: list[int]) -> None:
    print(f"9b prefill GEMMs (bf16, F.linear), each captured alone: nodes by type, device ms per replay "
          f"(allow_bf16_reduced_precision_reduction {torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction})")
    for M in rows:
        for name, (N, K) in GEMMS_9B.items():
            x = torch.randn(M, K, dtype=torch.bfloat16, device="cuda")
            w = torch.randn(N, K, dtype=torch.bfloat16, device="cuda")
            out = torch.nn.functional.linear(x, w)
            graph = torch.cuda.CUDAGraph(keep_graph=True)
            with torch.cuda.graph(graph):
                out = torch.nn.functional.linear(x, w)
            graph.instantiate()
            nodes, types, _ = graph_shape(graph)
            print(f"  rows {M:5d} {name:12s} {N:6d} x {K:5d}: {dict(types)}  {device_ms(graph.replay, busy=True):.3f} ms"
                  f"  host {host_us(graph.replay, 15):.1f} us", flush=True)
            del out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lanes", type=int, default=8)
    ap.add_argument("--skip-synthetic", action="store_true")
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--gemms", type=int, nargs="*", default=[], metavar="ROWS",
                    help="the 9B shape's prefill GEMMs at these row counts, each captured alone (then exit)")
    ap.add_argument("--no-reduced-precision", action="store_true",
                    help="with --gemms: torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False")
    ap.add_argument("--shape", default="demo", help="demo (the bundled pair, speculative) or 9b / 27b: a "
                    "target-only engine of random bf16 weights of that shape at the serve defaults")
    args = ap.parse_args()

    if args.gemms:
        if args.no_reduced_precision:
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        return gemm_graphs(args.gemms)
    if not args.skip_synthetic:
        print("synthetic graphs: host us per replay, device idle / busy before it; node types, edges", flush=True)
        for kind in ("line", "memcpy", "branch", "triton", "gemm"):
            for n in (16, 128, 512):
                graph = synthetic(kind, n)
                nodes, types, edges = graph_shape(graph)
                print(f"  {kind:7s} {n:4d} nodes: {host_us(graph.replay):8.1f} / {host_us(graph.replay, busy=True):8.1f}"
                      f" us  {nodes} nodes {dict(types)} edges {edges}", flush=True)
    if args.skip_engine:
        return

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

    if args.shape == "demo":
        demo = Path(deltaflash.__file__).parent / "assets" / "demo"
        engine = Engine.from_pretrained(demo / "target", demo / "draft", device="cuda", progress=False)
    else:
        from deltaflash.engine.config import EngineConfig
        from deltaflash.models.random_init import SHAPES, random_model

        engine = Engine(random_model(SHAPES[args.shape](), torch.bfloat16, "cuda"), None, None, EngineConfig())
    torch.cuda.CUDAGraph = plain
    print(f"{args.shape}, {'target-only' if engine.runner.source is None else 'speculative'} engine: {len(made)} "
          f"graphs captured; device ms per replay: idle before it / queued behind a sleep (= its kernels) / the "
          f"difference (the device waiting on the launch)")
    owners = {}
    for fn in engine.runner.graphs.functions:
        for bucket, (graph, _) in fn.graphs.items():
            owners[id(graph)] = (fn.name, bucket)
    for i, graph in enumerate(made):
        name, bucket = owners.get(id(graph), (f"graph {i}", 0))
        if bucket not in (0, args.lanes) and not name.startswith("prefill"):
            continue
        nodes, types, edges = graph_shape(graph)
        idle, kernels = device_ms(graph.replay), device_ms(graph.replay, busy=True)
        print(f"  {name:28s} bucket {bucket:3d}: {nodes:4d} nodes {dict(types)} edges {edges:4d}  host "
              f"{host_us(graph.replay, 15):8.1f} / {host_us(graph.replay, 15, busy=True):8.1f} us (idle / busy); device "
              f"{idle:.3f} / {kernels:.3f} / {idle - kernels:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
