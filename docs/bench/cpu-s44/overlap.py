"""Can a prefill's bandwidth- and latency-bound kernels hide under cuBLAS's GEMMs on a second stream? (Issue 15's
2048-token TTFT: its GEMMs run at cuBLAS's rate; what is left above 1.25x the compute limit is the rest. Splitting a
prompt in two halves, the second half's layer l can run beside the first half's layer l + 1.) This times, for
1024-row halves of the 9B shape: stream A's GEMMs of 24 layers (the MLP's up / gate and down products), stream B's
other work of 24 layers (SwiGLU's activation, two RMS norms, fla-core's chunked rule when it imports), each alone and
both at once. python docs/bench/cpu-s44/overlap.py"""

import torch
import torch.nn.functional as F

torch.manual_seed(0)
dev, dt, rows, layers = "cuda", torch.bfloat16, 1024, 24
hidden, inter, heads, dim = 4096, 12288, 32, 128
x = torch.randn(rows, hidden, device=dev, dtype=dt)
w_up = torch.randn(hidden, 2 * inter, device=dev, dtype=dt) / 64
w_down = torch.randn(inter, hidden, device=dev, dtype=dt) / 64
act = torch.randn(rows, 2 * inter, device=dev, dtype=dt)
res = torch.randn(rows, hidden, device=dev, dtype=dt)
norm_w = torch.ones(hidden, device=dev, dtype=dt)
try:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    q, k, v = (torch.randn(1, rows, heads, dim, device=dev, dtype=dt) for _ in range(3))
    k = F.normalize(k.float(), dim=-1).to(dt)
    g = -torch.rand(1, rows, heads, device=dev, dtype=torch.float32)
    beta = torch.rand(1, rows, heads, device=dev, dtype=dt)
    h0 = torch.zeros(1, heads, dim, dim, device=dev, dtype=torch.float32)
except ImportError:
    chunk_gated_delta_rule = None


def gemms():
    for _ in range(layers):
        up = x @ w_up
        up[:, :inter] @ w_down


def others():
    for _ in range(layers):
        F.silu(act[:, :inter]) * act[:, inter:]
        for _ in range(2):
            F.rms_norm((res + x).float(), (hidden,), norm_w.float(), 1e-6).to(dt)
        if chunk_gated_delta_rule is not None:
            chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)


def timed(fn, reps=5):
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


side = torch.cuda.Stream()


def both():
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        others()
    gemms()
    torch.cuda.current_stream().wait_stream(side)


def graphed(fn):
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


print(torch.cuda.get_device_name(), "| fla-core:", chunk_gated_delta_rule is not None)
for mode, wrap in (("eager", lambda f: f), ("graph", graphed)):
    try:
        a, b, ab = (timed(wrap(f)) for f in (gemms, others, both))
    except Exception as e:  # (fla-core's autotuner may not capture)
        print(mode, "failed:", repr(e)[:200])
        continue
    print(f"{mode}: GEMMs {a:.3f} ms, others {b:.3f} ms, serial {a + b:.3f}, both at once {ab:.3f} "
          f"(hidden: {(a + b - ab) / b:.0%} of the others)")
