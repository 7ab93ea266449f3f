"""Time fla-core's chunked gated-delta-rule kernels (the GDN prefill: deltaflash.ops.gdn.chunk._fla, the call
the engine makes) under launch configs other than the one its autotuner picked, at 9B layer shapes (CUDA).

Usage: python bench/tune_fla.py [--shapes 1x2048 1x512 16x64] [--kernels h o kkt wu] [--quick] [--out TABLE]

fla-core autotunes each kernel once per process, keyed by head counts and dims but not by the rows: the
first shape a process prefills picks the config every later shape runs. Per shape (lanes x rows) this
prints the whole call's device ms (CUDA-graph replay) with the configs fla-core's autotuner picks at that
shape, then, one kernel at a time, with each candidate config (the others at their autotuned choice), and
the largest output difference against the autotuned run (0: the same bits). --out writes a launch table
(deltaflash/ops/gdn/fla_launch.py; ship it as deltaflash/ops/gdn/tiles/<device slug>.json): for each kernel
whose best config beats fla-core's pick by 1% at some shape, a row bucket per shape (from its rows per
lane up), with that shape's best config (fla-core's pick where none beat it).
"""

import argparse
import itertools

import torch
import triton

from deltaflash.bench.common import graph_ms
from deltaflash.ops.gdn import fla_launch
from deltaflash.ops.gdn.chunk import _fla

NK, NV, DK, DV = 16, 32, 128, 128  # the 9B GDN layer


def candidates(name: str, quick: bool) -> list[triton.Config]:
    """Configs beyond (and including) fla-core's own lists for Hopper."""
    if name == "h":  # BV splits the value dim across programs: 16 doubles the programs of fla-core's 32
        space = itertools.product((16, 32, 64), (2, 4) if quick else (1, 2, 4, 8), (2, 3) if quick else (1, 2, 3, 4))
        return [triton.Config({"BV": bv}, num_warps=w, num_stages=s) for bv, w, s in space]
    if name == "o":
        tiles = ((32, 32), (64, 64), (64, 32), (128, 64)) if quick else \
            ((32, 32), (64, 64), (64, 32), (32, 64), (128, 64), (64, 128), (128, 32), (128, 128))
        space = itertools.product(tiles, (2, 4, 8), (2, 3) if quick else (2, 3, 4))
        return [triton.Config({"BK": bk, "BV": bv}, num_warps=w, num_stages=s) for (bk, bv), w, s in space]
    if name == "kkt":
        space = itertools.product((32, 64, 128), (1, 2, 4, 8), (2, 3) if quick else (1, 2, 3))
        return [triton.Config({"BK": bk}, num_warps=w, num_stages=s) for bk, w, s in space]
    space = itertools.product((1, 2, 4, 8), (2, 3) if quick else (1, 2, 3, 4))
    return [triton.Config({}, num_warps=w, num_stages=s) for w, s in space]


def describe(cfg: triton.Config) -> str:
    tile = "x".join(f"{k}{v}" for k, v in cfg.kwargs.items())
    return f"{tile + ' ' if tile else ''}w{cfg.num_warps} s{cfg.num_stages}"


def row_buckets(by_rows: dict) -> list:
    """{rows per lane: config} -> [(min_rows, config)]: the first bucket from 0, a new one where the config
    changes."""
    out = []
    for rows, cfg in sorted(by_rows.items()):
        if not out or describe(cfg) != describe(out[-1][1]):
            out.append((rows if out else 0, cfg))
    return out


def inputs(lanes: int, T: int):
    dev, bf = "cuda", torch.bfloat16
    q, k = (torch.nn.functional.normalize(torch.randn(lanes, T, NK, DK, device=dev), dim=-1).to(bf) for _ in range(2))
    v = torch.randn(lanes, T, NV, DV, device=dev, dtype=bf)
    a, b = (torch.randn(lanes, T, NV, device=dev, dtype=bf) for _ in range(2))
    A_log = torch.rand(NV, device=dev).log()
    dt_bias = torch.randn(NV, device=dev)
    state = torch.randn(lanes, NV, DK, DV, device=dev) * 0.1
    return q, k, v, a, b, A_log, dt_bias, state


def kernel_us(fn, calls: int = 5) -> list[tuple[str, float]]:
    """Device us per call of each kernel fn launches (eager calls under the profiler), longest first."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    cuda = torch.autograd.DeviceType.CUDA
    times = [(e.key[:48], e.self_device_time_total / calls) for e in prof.key_averages()
             if e.device_type == cuda and e.self_device_time_total]
    return sorted(times, key=lambda t: -t[1])


@torch.inference_mode()
def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", nargs="+", default=["1x2048", "1x512", "16x64"], help="LANESxROWS")
    p.add_argument("--kernels", nargs="+", default=["h", "o", "kkt", "wu"])
    p.add_argument("--quick", action="store_true", help="fewer candidates per kernel")
    p.add_argument("--out", default=None, help="write a launch table of the best configs by rows here")
    args = p.parse_args()
    fla_launch.use(None)  # (no engine here: the candidates below set the configs)
    tuners = {name: fla_launch.autotuner(name) for name in fla_launch.KERNELS}
    best = {}  # kernel -> {rows per lane: (config, beats fla-core's pick by 1%)}
    own = {name: list(t.configs) for name, t in tuners.items()}
    for shape in args.shapes:
        lanes, T = (int(x) for x in shape.split("x"))
        x = inputs(lanes, T)

        def run():
            return _fla(*x, T)

        for name, t in tuners.items():  # fla-core's own choice at this shape
            t.configs, _ = own[name], t.cache.clear()
        ref = [y.clone() for y in run()]
        picked = {name: t.best_config for name, t in tuners.items()}
        base = graph_ms(run)
        print(f"== {lanes} lanes x {T} rows: {base:.4f} ms with fla-core's picks "
              + ", ".join(f"{n} {describe(c)}" for n, c in picked.items()), flush=True)
        print("  by kernel (us a call): " + ", ".join(f"{name} {us:.1f}" for name, us in kernel_us(run)), flush=True)
        for name in args.kernels:
            t, rows = tuners[name], []
            for cfg in candidates(name, args.quick):
                t.configs, _ = [cfg], t.cache.clear()
                try:
                    out = run()
                    diff = max((o.float() - r.float()).abs().max().item() for o, r in zip(out, ref))
                    rows.append((graph_ms(run), describe(cfg), diff, cfg))
                except Exception as e:  # a tile the kernel cannot build (shared memory, shapes)
                    rows.append((float("inf"), describe(cfg), type(e).__name__, cfg))
            t.configs = [picked[name]]  # the next kernel's candidates run beside this one's pick
            rows.sort(key=lambda r: r[0])
            faster = rows[0][0] < 0.99 * base
            best.setdefault(name, {})[T] = (rows[0][3], True) if faster else (picked[name], False)
            print(f"  {name}: picked {describe(picked[name])}; best " + "; ".join(
                f"{d} {ms:.4f} ({ms - base:+.4f}, diff {diff})" for ms, d, diff, _ in rows[:4]), flush=True)
            print("     all: " + ", ".join(f"{d} {ms:.4f}" for ms, d, _, _ in rows), flush=True)

    if args.out:
        buckets = {name: row_buckets({T: cfg for T, (cfg, _) in by_rows.items()})
                   for name, by_rows in best.items() if any(faster for _, faster in by_rows.values())}
        fla_launch.LaunchTable(torch.cuda.get_device_name(), buckets).save(args.out)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
