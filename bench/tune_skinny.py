"""Tune ops/gemm/skinny.py's tiles on this GPU against cuBLAS and write the table the engine reads
(`--skinny-gemm auto` takes ops/gemm/tiles/<device name>.json, the default --out).

Usage: python bench/tune_skinny.py [--shapes 9b demo] [--out PATH] [--margin 0.03] [--quick]
       TRITON_INTERPRET=1 python bench/tune_skinny.py --dry-run   (the toy shape on the CPU: the script's plumbing)
       python bench/tune_skinny.py --sass 16x64x128x4x3 ...        (BMxBNxBKxWARPSxSTAGES compiled for sm_90 on
                                                                    any machine: registers, shared memory, loads, MMAs)

For each product of one forward of each model (the target's; the bundled pair's drafter too) and each row
class (BM 16 for 1-16 rows, 32, 64) every candidate tile is timed at the class's most rows, then cuBLAS
(F.linear) and the class's three best tiles at each row bucket. Each time is a CUDA-graph replay over enough
copies of the weight that L2 holds none of them between reads (a forward reads each weight once). A tile
enters the table for a bucket where it beats cuBLAS by the margin and matches F.linear to bf16 tolerance.

Prints per product and bucket: cuBLAS and the best tile (ms, TB/s of the weight read), then per model one
forward's products at each bucket: cuBLAS, the table, and the weight-read limit at the measured copy rate.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

from deltaflash.bench.common import copy_bandwidth_gbs, graph_ms, time_ms
from deltaflash.models.layers import product_weights
from deltaflash.models.random_init import SHAPES
from deltaflash.ops.gemm.skinny import (ROW_BUCKETS, SkinnyGemms, SkinnyTile, row_block, skinny_linear, table_key,
                                        table_path)

L2_BYTES = 60 << 20       # more than the H100 / H200's 50 MB L2
SHARED_BYTES = 200 << 10  # a tile's pipeline must fit the SM's shared memory (228 KB on sm_90)


def model_products(name: str) -> list[tuple[int, int]]:
    """(N, K) of each product one forward runs, with repeats: a model of SHAPES on the meta device, or
    'demo' (the bundled pair: target and drafter, from their configs)."""
    if name == "demo":  # a few MB: loaded on the CPU
        from deltaflash.bundled import BUNDLED
        from deltaflash.models.dflash import load_drafter
        from deltaflash.models.loader import load_model

        target = load_model(BUNDLED / "target", dtype=torch.bfloat16, device="cpu", progress=False)
        c = target.cfg
        drafter = load_drafter(BUNDLED / "draft", target_hidden_size=c.hidden_size, target_vocab_size=c.vocab_size,
                               target_num_layers=c.num_layers, dtype=torch.bfloat16, device="cpu")
        modules = [target, drafter]
    else:
        from deltaflash.models.qwen3_5 import Qwen35Model

        with torch.device("meta"):
            modules = [Qwen35Model(SHAPES[name]())]
    shapes = []
    for module in modules:
        if hasattr(module, "merge_projections") and not any(
                getattr(m, "merged_weight", None) is not None for m in module.modules()):
            module.merge_projections()
        shapes += [tuple(w.shape) for w in product_weights(module)]
    return shapes


def candidates(n: int, k: int, bm: int, sms: int, quick: bool) -> list[SkinnyTile]:
    """Tiles worth timing for an N x K product at BM rows: split counts that fill the SMs once and twice."""
    tiles = []
    for bn in (32, 64) if quick else (32, 64, 128):
        for bk in (128,) if quick else (128, 256):
            if bk > max(16, triton.next_power_of_2(k)):
                continue
            column_tiles = triton.cdiv(n, bn)
            fill = max(1, math.ceil(sms / column_tiles))
            splits = sorted({min(s, triton.cdiv(k, bk)) for s in (fill, 2 * fill)})
            for split in splits:
                for warps in (4,) if quick else (4, 8):
                    for stages in (3,) if quick else (3, 4):
                        if stages * (bn + bm) * bk * 2 <= SHARED_BYTES:
                            tiles.append(SkinnyTile(bn, bk, split, warps, stages))
    return tiles


class Product:
    """One N x K weight (copies enough to defeat L2) and the rows x of every bucket."""

    def __init__(self, n: int, k: int, device, dtype, timer):
        nbytes = n * k * dtype.itemsize
        self.copies = [torch.randn(n, k, device=device).div_(k ** 0.5).to(dtype)
                       for _ in range(max(1, min(8, math.ceil(L2_BYTES / nbytes))))]
        self.n, self.k, self.nbytes, self.timer = n, k, nbytes, timer
        self.x = {rows: torch.randn(rows, k, device=device).to(dtype) for rows in ROW_BUCKETS}

    def ms(self, rows: int, tile: SkinnyTile | None) -> float:
        x = self.x[rows]
        if tile is None:
            return self.timer(lambda: [F.linear(x, w) for w in self.copies]) / len(self.copies)
        return self.timer(lambda: [skinny_linear(x, w, None, tile) for w in self.copies]) / len(self.copies)

    def correct(self, rows: int, tile: SkinnyTile) -> bool:
        x, w = self.x[rows], self.copies[0]
        want = F.linear(x.float(), w.float())
        got = skinny_linear(x, w, None, tile).float()
        return bool(torch.allclose(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item()))


def tune(shapes: list[tuple[int, int]], device, dtype, timer, sms: int, margin: float, quick: bool, done=None):
    """-> (table of winning tiles, {(n, k, rows): (cuBLAS ms, best tile, its ms)}), the shapes in the order
    given; done(tiles, report), when given, after each shape (a run cut short keeps what it measured)."""
    tiles, report = {}, {}
    for n, k in shapes:
        product = Product(n, k, device, dtype, timer)
        for bm in sorted({row_block(r) for r in ROW_BUCKETS}):
            buckets = [r for r in ROW_BUCKETS if row_block(r) == bm]
            timed = []
            for tile in candidates(n, k, bm, sms, quick):
                if product.correct(buckets[-1], tile):
                    timed.append((product.ms(buckets[-1], tile), tile))
                else:
                    print(f"  {n}x{k} rows {buckets[-1]} {tile}: WRONG OUTPUT (left out)", flush=True)
            best = [tile for _, tile in sorted(timed, key=lambda t: t[0])[:3]]
            for rows in buckets:
                cublas = product.ms(rows, None)
                ms, tile = min(((product.ms(rows, t), t) for t in best), key=lambda t: t[0], default=(math.inf, None))
                report[(n, k, rows)] = (cublas, tile, ms)
                if tile is not None and ms < cublas * (1 - margin):
                    tiles[table_key(n, k, dtype, rows)] = tile
                print(f"{n:>7d} x {k:<6d} rows {rows:>2d}: cuBLAS {cublas:.4f} ms {product.nbytes / cublas / 1e9:5.2f} "
                      f"TB/s | best {tile} {ms:.4f} ms {product.nbytes / ms / 1e9:5.2f} TB/s | "
                      f"x{cublas / ms:.2f}{' TAKEN' if table_key(n, k, dtype, rows) in tiles else ''}", flush=True)
        del product
        if done is not None:
            done(tiles, report)
    return tiles, report


def sass_report(tiles: list[str]) -> None:
    """Each BMxBNxBKxWARPSxSTAGES tile's kernel (bf16, K a multiple of BK, with and without partial sums)
    compiled for sm_90 as the JIT would launch it: ptxas registers and spills, shared memory, and the
    counts of the SASS instructions that move W and multiply (ptxas and nvdisasm of Triton's own wheel)."""
    import re
    import tempfile

    from verify_registers import compile_sm90, opcode, ptxas_report, sass

    from deltaflash.ops.gemm.skinny import skinny_linear_kernel

    pointers = {"x": "*bf16", "w": "*bf16", "bias": "*bf16", "out": "*bf16", "part": "*fp32"}
    for text in tiles:
        bm, bn, bk, warps, stages = (int(v) for v in text.split("x"))
        for partial in (False, True):
            consts = dict(PARTIAL=partial, HAS_BIAS=False, IEEE=False, EVEN_K=True, BM=bm, BN=bn, BK=bk)
            kernel = compile_sm90(skinny_linear_kernel, pointers, consts, None, warps, True, stages, ("M",))
            with tempfile.TemporaryDirectory() as tmp:
                instructions, _ = sass(kernel, Path(tmp))
                registers = ptxas_report(kernel, Path(tmp))
            ops = Counter(opcode(i) for i in instructions)
            moved = {op: n for op, n in sorted(ops.items()) if re.match(r"(LDG|HMMA|HGMMA|LDSM|STG|STSM|UTMA)", op)}
            print(f"{text} {'partial' if partial else 'direct '}: {registers}; shared {kernel.metadata.shared} B; "
                  f"{len(instructions)} SASS; {moved}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", nargs="+", default=["9b", "demo"], help=f"models: {sorted(SHAPES)} or demo")
    p.add_argument("--out", default=None, help="table path (default: ops/gemm/tiles/<this GPU>.json)")
    p.add_argument("--report", default=None, help="also write every timing here (JSON)")
    p.add_argument("--margin", type=float, default=0.03, help="a tile must beat cuBLAS by this fraction")
    p.add_argument("--quick", action="store_true", help="a few tiles per product (a first look)")
    p.add_argument("--dry-run", action="store_true", help="the toy shape on the CPU interpreter, wall-clock times")
    p.add_argument("--sass", nargs="+", metavar="BMxBNxBKxWARPSxSTAGES", help="static sm_90 report of these tiles")
    args = p.parse_args()
    if args.sass:
        return sass_report(args.sass)
    if args.dry_run:
        device, timer, sms, bw, name = "cpu", lambda fn: time_ms(fn, warmup=0, iters=1), 4, 1.0, "cpu-interpreter"
        dtype = torch.float16  # (the interpreter's bf16 tl.dot is wrong)
        args.shapes, args.quick = ["toy"], True
    else:
        if not torch.cuda.is_available():
            sys.exit("tune_skinny.py times kernels on a GPU (--dry-run tries the script on the CPU interpreter)")
        device, timer, dtype = "cuda", graph_ms, torch.bfloat16
        props = torch.cuda.get_device_properties(0)
        sms, name, bw = props.multi_processor_count, torch.cuda.get_device_name(0), copy_bandwidth_gbs("cuda")
    products = {shape: model_products(shape) for shape in args.shapes}
    read = Counter()  # bytes each shape reads in one forward of every model: the costliest are tuned first
    for shapes in products.values():
        for n, k in shapes:
            read[(n, k)] += n * k
    out = Path(args.out) if args.out else table_path(name)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save(tiles, report):
        SkinnyGemms(name, tiles).save(out)
        if args.report:
            Path(args.report).write_text(json.dumps(
                [{"n": n, "k": k, "rows": rows, "cublas_ms": c, "tile": str(t), "tile_ms": ms}
                 for (n, k, rows), (c, t, ms) in sorted(report.items())], indent=1) + "\n")

    with torch.inference_mode():
        tiles, report = tune([shape for shape, _ in read.most_common()], device, dtype, timer, sms, args.margin,
                             args.quick, done=save)
    print(f"\n{name}: copy rate {bw:.0f} GB/s; a table entry beats cuBLAS by >= {args.margin:.0%}")
    for shape, shapes in products.items():
        counts = Counter(shapes)
        limit = sum(n * k * 2 * c for (n, k), c in counts.items()) / (bw * 1e9) * 1e3
        print(f"{shape}: one forward's {len(shapes)} products ({len(counts)} shapes), weight-read limit {limit:.3f} ms")
        for rows in ROW_BUCKETS:
            cublas = sum(report[(n, k, rows)][0] * c for (n, k), c in counts.items())
            table = sum((report[(n, k, rows)][2] if table_key(n, k, dtype, rows) in tiles
                         else report[(n, k, rows)][0]) * c for (n, k), c in counts.items())
            print(f"  rows {rows:>2d}: cuBLAS {cublas:.3f} ms ({cublas / limit:.2f}x limit) | table {table:.3f} ms "
                  f"({table / limit:.2f}x) | cuBLAS / table {cublas / table:.3f}")
    print(f"table: {len(tiles)} entries -> {out}")


if __name__ == "__main__":
    main()
