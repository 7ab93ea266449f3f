"""A measured lever, not taken: SwiGLU's input GEMM with the activation in its epilogue, h = silu(x W_gate^T)
* (x W_up^T), against the route the engine runs - cuBLAS's merged gate / up GEMM, then
ops/activation/silu_mul.py, which writes the [M, 2I] projection and reads it back (at 2048 rows of the 9B
shape 100 MB each way per layer, ~48 us on an H100, 1.5 ms of a 2048-token prefill).

The kernel: a program owns a [BM, BN] tile of h; it streams [BM, BK] tiles of x and the matching [BN, BK]
tiles of the merged weight's gate and up rows (`MergedProjections.merged_weight`, gate rows first) through
TMA descriptors into two fp32 accumulators, then rounds each to the dtype as a GEMM writes it and applies
silu_mul's arithmetic (so given equal GEMM outputs its bits are the unfused route's). The figures (9B shape,
K 4096, I 12288; 27b: 5120, 17408), bf16, at prefill row counts: the median of runs of back-to-back calls
(the device busy, as in a prefill graph), both routes in one process, and their largest difference.

    python bench/swiglu_gemm.py [--rows 256 2048 8192] [--shape 9b] [--tiles 128x64x64x4x5 ...]

Measured on an H100 (docs/benchmarks.md, thirty-fourth session): at 2048 rows the best tile took 0.680 ms
against 0.658 for cuBLAS + silu_mul - Triton's K loop reached 1.3x the compute limit where cuBLAS reached
1.007x, more than the activation's round trip saves. Hence not taken; a GEMM at cuBLAS's rate with an
epilogue (warp-specialized, which Triton 3.6 does not build for sm_90) would be.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from deltaflash.bench.common import machine, matmul_tflops
from deltaflash.ops.activation.silu_mul import silu_mul
from deltaflash.ops.gdn.verify import exact_exp


@dataclasses.dataclass(frozen=True)
class SwigluTile:
    BM: int = 128
    BN: int = 128
    BK: int = 64
    warps: int = 8
    stages: int = 3
    group_m: int = 8
    persistent: bool = False  # one program per SM walking the tiles
    warp_specialize: bool = False  # Triton's producer / consumer warps for the K loop

    def __str__(self) -> str:
        return f"{self.BM}x{self.BN}x{self.BK}x{self.warps}x{self.stages}"


@triton.jit
def _tile(t, M, I, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    """Tile t's (row tile, column tile): GROUP_M row tiles per column tile, so neighbours share weight
    tiles in L2."""
    n_m, n_n = tl.cdiv(M, BM), tl.cdiv(I, BN)
    per_group = GROUP_M * n_n
    first_m = (t // per_group) * GROUP_M
    rows = tl.minimum(n_m - first_m, GROUP_M)
    return first_m + (t % per_group) % rows, (t % per_group) // rows


@triton.jit
def _swiglu_tile(x_desc, w_desc, out_desc, i_m, i_n, I, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 STAGES: tl.constexpr, WS: tl.constexpr):
    b_g = tl.zeros([BM, BN], dtype=tl.float32)
    b_u = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in tl.range(0, K, BK, num_stages=STAGES, warp_specialize=WS):
        b_x = x_desc.load([i_m * BM, k0])
        b_g = tl.dot(b_x, tl.trans(w_desc.load([i_n * BN, k0])), b_g)
        b_u = tl.dot(b_x, tl.trans(w_desc.load([I + i_n * BN, k0])), b_u)
    dtype = out_desc.dtype
    b_g = b_g.to(dtype).to(tl.float32)  # the projection's output, rounded as a GEMM writes it
    b_s = tl.math.div_rn(b_g, 1.0 + exact_exp(-b_g)).to(dtype).to(tl.float32)
    out_desc.store([i_m * BM, i_n * BN], (b_s * b_u.to(dtype).to(tl.float32)).to(dtype))


@triton.jit
def swiglu_gemm_kernel(x_desc, w_desc, out_desc, M, I, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                       GROUP_M: tl.constexpr, STAGES: tl.constexpr, WS: tl.constexpr):
    """Tile (i_m, i_n) of h [M, I] from x [M, K] and w [2I, K] (gate rows 0..I-1, up rows I..2I-1)."""
    i_m, i_n = _tile(tl.program_id(0), M, I, BM, BN, GROUP_M)
    _swiglu_tile(x_desc, w_desc, out_desc, i_m, i_n, I, K, BM, BN, BK, STAGES, WS)


@triton.jit
def swiglu_gemm_persistent_kernel(x_desc, w_desc, out_desc, M, I, K, BM: tl.constexpr, BN: tl.constexpr,
                                  BK: tl.constexpr, GROUP_M: tl.constexpr, STAGES: tl.constexpr, WS: tl.constexpr):
    """swiglu_gemm_kernel's tiles t = pid, pid + programs, ... (one program per SM)."""
    tiles = tl.cdiv(M, BM) * tl.cdiv(I, BN)
    for t in tl.range(tl.program_id(0), tiles, tl.num_programs(0)):
        i_m, i_n = _tile(t, M, I, BM, BN, GROUP_M)
        _swiglu_tile(x_desc, w_desc, out_desc, i_m, i_n, I, K, BM, BN, BK, STAGES, WS)


def swiglu_gemm(x: torch.Tensor, w: torch.Tensor, tile: SwigluTile = SwigluTile()) -> torch.Tensor:
    """silu(x @ w[:I].T) * (x @ w[I:].T) for x [..., K] and the merged weight w [2I, K] of one 16-bit dtype,
    both with unit last stride and 16-byte aligned rows (TMA); returns a contiguous [..., I]. No host sync."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    K = x.shape[-1]
    if w.dim() != 2 or w.shape[1] != K or w.shape[0] % 2 or x.dtype != w.dtype or x.dtype not in (
            torch.bfloat16, torch.float16):
        raise ValueError(f"swiglu_gemm: x {tuple(x.shape)} {x.dtype} and w {tuple(w.shape)} {w.dtype}: "
                         "w must be [2I, K] of x's 16-bit dtype")
    I = w.shape[0] // 2
    x2 = x.reshape(-1, K)
    if x2.stride(1) != 1 or (x2.stride(0) * x2.element_size()) % 16 or (K * w.element_size()) % 16 or I % tile.BN:
        raise ValueError(f"swiglu_gemm: rows must be 16-byte aligned and I ({I}) a multiple of BN ({tile.BN})")
    M = x2.shape[0]
    out = torch.empty(M, I, dtype=x.dtype, device=x.device)
    if M:
        tiles = triton.cdiv(M, tile.BM) * (I // tile.BN)
        kernel = swiglu_gemm_persistent_kernel if tile.persistent else swiglu_gemm_kernel
        grid = (min(tiles, torch.cuda.get_device_properties(x.device).multi_processor_count) if tile.persistent and
                x.is_cuda else tiles,)
        kernel[grid](
            TensorDescriptor.from_tensor(x2, [tile.BM, tile.BK]), TensorDescriptor.from_tensor(w, [tile.BN, tile.BK]),
            TensorDescriptor.from_tensor(out, [tile.BM, tile.BN]), M, I, K, BM=tile.BM, BN=tile.BN, BK=tile.BK,
            GROUP_M=tile.group_m, STAGES=tile.stages, WS=tile.warp_specialize, num_warps=tile.warps, num_stages=tile.stages)
    return out.view(*x.shape[:-1], I)


SHAPES = {"9b": (4096, 12288), "27b": (5120, 17408)}
# the tiles measured (H100, 2026-12-06); "w" (warp specialization) does not compile for sm_90 with Triton 3.6
TILES = ("128x64x64x4x5", "128x64x64x4x4", "128x64x64x4x4p", "128x64x64x4x3", "128x128x64x8x4", "64x128x64x4x4",
         "128x64x128x4x3")


def burst_ms(fn, calls: int = 20, runs: int = 7) -> float:
    """Median over `runs` of the milliseconds per call of `calls` back-to-back calls."""
    fn()
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def parse_tile(text: str) -> SwigluTile:
    """BMxBNxBKxwarpsxstages, then p (persistent) and / or w (warp-specialized)."""
    flags = text.lstrip("0123456789x")
    BM, BN, BK, warps, stages = (int(v) for v in text[:len(text) - len(flags)].split("x"))
    return SwigluTile(BM=BM, BN=BN, BK=BK, warps=warps, stages=stages, persistent="p" in flags,
                      warp_specialize="w" in flags)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[256, 2048, 8192])
    ap.add_argument("--shape", default="9b", choices=sorted(SHAPES))
    ap.add_argument("--tiles", nargs="+", default=list(TILES),
                    help="BMxBNxBKxwarpsxstages[p][w]: p persistent, w warp-specialized")
    args = ap.parse_args()
    K, I = SHAPES[args.shape]
    rate = matmul_tflops("cuda")
    print(f"{machine()}; bf16 GEMM rate {rate:.0f} TFLOP/s; {args.shape}: K {K}, I {I}")
    torch.manual_seed(0)
    w = torch.randn(2 * I, K, dtype=torch.bfloat16, device="cuda") * K ** -0.5
    for M in args.rows:
        x = torch.randn(M, K, dtype=torch.bfloat16, device="cuda")

        def unfused():
            gate, up = F.linear(x, w).split(I, dim=-1)
            return silu_mul(gate, up)
        reference = unfused()
        gemm = burst_ms(lambda: F.linear(x, w))
        both = burst_ms(unfused)
        limit = 2 * M * K * 2 * I / (rate * 1e9)
        print(f"rows {M}: compute limit {limit:.3f} ms; cuBLAS GEMM {gemm:.3f} ms ({gemm / limit:.3f}x), + silu_mul "
              f"{both:.3f} ms ({both / limit:.3f}x)")
        for text in args.tiles:
            tile = parse_tile(text)
            try:
                out = swiglu_gemm(x, w, tile)
                ms = burst_ms(lambda: swiglu_gemm(x, w, tile))
            except Exception as e:  # a tile that does not fit the device (shared memory, registers)
                print(f"  {text:18s} failed: {type(e).__name__}: {str(e)[:120]}")
                continue
            diff = (out.float() - reference.float()).abs().max().item()
            print(f"  {text:18s} {ms:.3f} ms ({ms / limit:.3f}x the limit, {both / ms:.3f}x faster than cuBLAS + "
                  f"silu_mul); largest difference {diff:.3g}", flush=True)


if __name__ == "__main__":
    main()
