"""Skinny GEMMs: y = x W^T (+ b) for the few rows of a decode or verify round (M <= MAX_ROWS), where the
product is a read of W and its time is W's bytes over the memory bandwidth.

cuBLAS reads the 9B shape's projections at ~3.1 TB/s for 16 rows on the H200 (the lm_head at 4.2 TB/s;
docs/benchmarks.md): its tiles are sized for compute, and where a matrix has few column tiles it splits K
and reduces in a kernel of its own. Here a program owns BN columns of W and one of SPLIT equal stretches
of K: it streams [BN, BK] tiles of W through a software pipeline (`stages`) and multiplies the rows of x
(padded to BM, at least 16 for the tensor cores) into an fp32 accumulator. With SPLIT = 1 it writes y
itself; otherwise it writes its fp32 partial sum and `splitk_sum_kernel` adds the SPLIT partials in split
order - no atomics, so every call of one shape gives the same bits (a float atomic's order would not).

Which tile wins depends on (N, K, M) and the device: `bench/tune_skinny.py` times every candidate against
cuBLAS on the device and writes a table (`SkinnyGemms`, JSON); a shape the table lacks, or where cuBLAS won,
stays on cuBLAS. A row's bits depend on the tile, hence on how many rows share the call (as with cuBLAS):
speculative greedy output equals target-only output up to near-ties unless the engine is batch-invariant
(ops/gemm/invariant.py), which takes precedence.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from deltaflash.ops.tables import bundled, device_table

MAX_ROWS = 64                       # more rows than this: compute-bound enough for cuBLAS
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # the table's row counts (a call of M rows uses the first >= M)
SUM_BLOCK = 1024                    # columns per program of the split-K sum
TABLES = Path(__file__).parent / "tiles"  # the tables tuned on each device, <device name slug>.json


@triton.jit(do_not_specialize=["M"])  # any number of rows up to BM, one binary
def skinny_linear_kernel(x, w, bias, out, part, M, N, K, K_SPLIT, stride_xm, stride_wn, stride_om,
                         PARTIAL: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, EVEN_K: tl.constexpr,
                         BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    i_n, i_s = tl.program_id(0), tl.program_id(1)
    o_m = tl.arange(0, BM).to(tl.int64)
    o_n = (i_n * BN + tl.arange(0, BN)).to(tl.int64)
    m_m, m_n = o_m < M, o_n < N
    k_lo = i_s * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    b_acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        o_k = k0 + tl.arange(0, BK)
        if EVEN_K:  # K and K_SPLIT are multiples of BK: no mask along K, vector loads of W
            b_x = tl.load(x + o_m[:, None] * stride_xm + o_k[None, :], mask=m_m[:, None], other=0.0)
            b_w = tl.load(w + o_n[:, None] * stride_wn + o_k[None, :], mask=m_n[:, None], other=0.0)
        else:
            m_k = o_k < k_hi
            b_x = tl.load(x + o_m[:, None] * stride_xm + o_k[None, :], mask=m_m[:, None] & m_k[None, :], other=0.0)
            b_w = tl.load(w + o_n[:, None] * stride_wn + o_k[None, :], mask=m_n[:, None] & m_k[None, :], other=0.0)
        if IEEE:
            b_acc = tl.dot(b_x, tl.trans(b_w), b_acc, input_precision="ieee")
        else:
            b_acc = tl.dot(b_x, tl.trans(b_w), b_acc)
    m_out = m_m[:, None] & m_n[None, :]
    if not PARTIAL:
        if HAS_BIAS:
            b_acc += tl.load(bias + o_n, mask=m_n, other=0.0).to(tl.float32)[None, :]
        tl.store(out + o_m[:, None] * stride_om + o_n[None, :], b_acc.to(out.dtype.element_ty), mask=m_out)
    else:  # part [split, M, N] fp32 (one binary for every split count)
        tl.store(part + (i_s * M + o_m[:, None]) * N + o_n[None, :], b_acc, mask=m_out)


@triton.jit
def splitk_sum_kernel(part, bias, out, M, N, stride_om, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                      BLOCK: tl.constexpr):
    """out[m, n] = sum over s = 0, 1, ..., SPLIT-1 of part[s, m, n] (+ bias[n]), in that order."""
    i_m, i_n = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o_n = (i_n * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    m_n = o_n < N
    b_sum = tl.load(part + i_m * N + o_n, mask=m_n, other=0.0)
    for s in tl.static_range(1, SPLIT):
        b_sum += tl.load(part + (s * M + i_m) * N + o_n, mask=m_n, other=0.0)
    if HAS_BIAS:
        b_sum += tl.load(bias + o_n, mask=m_n, other=0.0).to(tl.float32)
    tl.store(out + i_m * stride_om + o_n, b_sum.to(out.dtype.element_ty), mask=m_n)


@dataclasses.dataclass(frozen=True)
class SkinnyTile:
    """One launch shape: BN columns x BK of K a pipeline step, K cut into `split` stretches."""

    block_n: int
    block_k: int
    split: int = 1
    warps: int = 4
    stages: int = 3

    def __str__(self) -> str:
        return f"BN {self.block_n} BK {self.block_k} split {self.split} {self.warps}w {self.stages}s"


def row_block(rows: int) -> int:
    """BM for `rows` rows: a power of two, at least 16 (the tensor cores' smallest M)."""
    return max(16, triton.next_power_of_2(rows))


def _launch(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tile: SkinnyTile) -> torch.Tensor:
    M, K = rows.shape
    N = weight.shape[0]
    out = torch.empty(M, N, dtype=rows.dtype, device=rows.device)
    if M == 0 or N == 0:
        return out
    BN, BK = tile.block_n, tile.block_k
    split = max(1, min(tile.split, triton.cdiv(K, BK)))  # no stretch without a step of K
    k_split = triton.cdiv(triton.cdiv(K, split), BK) * BK
    split = triton.cdiv(K, k_split)                      # stretches that hold some of K
    part = out if split == 1 else torch.empty(split, M, N, dtype=torch.float32, device=rows.device)
    bias_arg = weight if bias is None else bias
    skinny_linear_kernel[(triton.cdiv(N, BN), split)](
        rows, weight, bias_arg, out, part, M, N, K, k_split, rows.stride(0), weight.stride(0), out.stride(0),
        PARTIAL=split > 1, HAS_BIAS=bias is not None, IEEE=rows.dtype == torch.float32, EVEN_K=K % BK == 0,
        BM=row_block(M), BN=BN, BK=BK, num_warps=tile.warps, num_stages=tile.stages)
    if split > 1:
        splitk_sum_kernel[(M, triton.cdiv(N, SUM_BLOCK))](
            part, bias_arg, out, M, N, out.stride(0), SPLIT=split, HAS_BIAS=bias is not None, BLOCK=SUM_BLOCK,
            num_warps=4)
    return out


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tile: SkinnyTile) -> torch.Tensor:
    """F.linear(x, weight, bias) through `tile` for x [..., K] of at most MAX_ROWS rows and weight [N, K]
    of x's dtype (fp32 sums of fp32 inputs are IEEE, as cuBLAS's without TF32)."""
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1] or x.dtype != weight.dtype:
        raise ValueError(f"x [..., K] and weight [N, K] of one dtype, got {tuple(x.shape)} {x.dtype} and "
                         f"{tuple(weight.shape)} {weight.dtype}")
    K = weight.shape[1]
    rows = x.reshape(-1, K)
    if rows.shape[0] > MAX_ROWS:
        raise ValueError(f"skinny_linear takes at most {MAX_ROWS} rows, got {rows.shape[0]}")
    if tile.block_k < 16 or tile.block_n < 16 or tile.split < 1:
        raise ValueError(f"tile {tile}: BN and BK at least 16, split at least 1")
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    return _launch(rows, weight, bias, tile).view(*x.shape[:-1], weight.shape[0])


def table_key(n: int, k: int, dtype: torch.dtype, rows: int) -> str:
    """The table's key of a product: N x K, the dtype and the row bucket (the first of ROW_BUCKETS >= rows)."""
    bucket = next(b for b in ROW_BUCKETS if b >= rows)
    return f"{n}x{k}:{str(dtype).removeprefix('torch.')}:{bucket}"


@dataclasses.dataclass(frozen=True)
class SkinnyGemms:
    """The products a tuned table routes to skinny_linear (the rest, and every call of more than MAX_ROWS
    rows, to F.linear). `tiles`: table_key -> tile; `device`: the device it was tuned on."""

    device: str
    tiles: dict[str, SkinnyTile]

    def tile_for(self, n: int, k: int, dtype: torch.dtype, rows: int) -> SkinnyTile | None:
        if rows > MAX_ROWS or rows == 0:
            return None
        return self.tiles.get(table_key(n, k, dtype, rows))

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """F.linear(x, weight, bias), through the table's tile where it has one for this call."""
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        tile = self.tile_for(weight.shape[0], weight.shape[1], x.dtype, rows) \
            if weight.dim() == 2 and x.dtype == weight.dtype else None
        return F.linear(x, weight, bias) if tile is None else skinny_linear(x, weight, bias, tile)

    def save(self, path: str | Path) -> None:
        table = {key: dataclasses.asdict(tile) for key, tile in sorted(self.tiles.items())}
        Path(path).write_text(json.dumps({"device": self.device, "tiles": table}, indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> SkinnyGemms:
        """A table written by `save` (bench/tune_skinny.py); ValueError naming the file if it is not one."""
        try:
            data = json.loads(Path(path).read_text())
            return cls(str(data["device"]), {key: SkinnyTile(**tile) for key, tile in data["tiles"].items()})
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}: not a skinny GEMM table ({type(e).__name__}: {e})") from e


def table_path(device_name: str) -> Path:
    """Where the table of a device of this name (torch.cuda.get_device_name) ships: tiles/<its slug>.json."""
    return device_table(TABLES, device_name)


def bundled_table(device_name: str) -> Path | None:
    """The table tuned on a device of this name that ships with deltaflash, if any."""
    return bundled(TABLES, device_name)
