"""The k largest entries of each row of a wide matrix (a drafter's log-probabilities over the vocabulary):
best first, equal values in index order.

Reference and contract: naive.row_top_k (a stable descending sort, cut to k). torch.topk runs one block
per row through a radix select (about 30 us for a lane's seven rows of 8k entries on the H200) and leaves the
order of equal values open. Here rows split into chunks of at most BLOCK entries, one program per (row, chunk)
takes its chunk's k best by k rounds of max-then-lowest-index; with more than one chunk a second launch merges
each row's chunk winners the same way (lowest vocabulary index first among equal values). Values are copied,
not computed: the reference's exactly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 8192  # entries of a row per program: a bundled drafter's vocabulary in one launch


@triton.jit
def _take_best(vals, idx, live, K: tl.constexpr, out_v, out_i):
    """K rounds: the largest live value, the lowest index among its equals; stores K (value, index) pairs
    (past the live entries: -inf at index 2**31 - 1, which the merge skips)."""
    for j in tl.static_range(K):
        best = tl.max(tl.where(live, vals, float("-inf")), axis=0)
        at = tl.min(tl.where(live & (vals == best), idx, 2147483647), axis=0)
        at = tl.where(at == 2147483647, tl.min(tl.where(live, idx, 2147483647), axis=0), at)  # (NaN rows: any live)
        tl.store(out_v + j, tl.max(tl.where(idx == at, vals, float("-inf")), axis=0))
        tl.store(out_i + j, at.to(tl.int64))
        live = live & (idx != at)


@triton.jit
def chunk_top_k_kernel(x, out_v, out_i, stride_x, V, S, K: tl.constexpr, BLOCK: tl.constexpr):
    """Row i_r, chunk i_s: its K best (value, vocabulary index) at out[i_r, i_s, :]."""
    i_r, i_s = tl.program_id(0).to(tl.int64), tl.program_id(1)
    idx = i_s * BLOCK + tl.arange(0, BLOCK)
    live = idx < V
    vals = tl.load(x + i_r * stride_x + idx, mask=live, other=float("-inf"))
    base = (i_r * S + i_s) * K
    _take_best(vals, idx, live, K, out_v + base, out_i + base)


@triton.jit
def merge_top_k_kernel(cand_v, cand_i, out_v, out_i, C, K: tl.constexpr, BC: tl.constexpr):
    """Row i_r: the K best of its C chunk winners (ties: the lowest vocabulary index)."""
    i_r = tl.program_id(0).to(tl.int64)
    o_c = tl.arange(0, BC)
    idx = tl.load(cand_i + i_r * C + o_c, mask=o_c < C, other=2147483647).to(tl.int32)
    live = idx != 2147483647
    vals = tl.load(cand_v + i_r * C + o_c, mask=live, other=float("-inf"))
    _take_best(vals, idx, live, K, out_v + i_r * K, out_i + i_r * K)


def row_top_k(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """naive.row_top_k's contract: x [..., V] float32, 1 <= k <= V -> (values, indices) [..., k]."""
    V = x.shape[-1]
    if x.dtype != torch.float32 or not 1 <= k <= V or V >= 2**31:
        raise ValueError(f"float32 rows of fewer than 2**31 entries and 1 <= k <= {V} expected, got {x.dtype}, k={k}")
    lead = x.shape[:-1]
    rows = x.reshape(-1, V)
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    R = rows.shape[0]
    values = torch.empty(*lead, k, dtype=torch.float32, device=x.device)
    indices = torch.empty(*lead, k, dtype=torch.long, device=x.device)
    if R == 0:
        return values, indices
    block = min(BLOCK, triton.next_power_of_2(V))
    S = triton.cdiv(V, block)
    warps = 8 if block >= 4096 else 4
    if S == 1:
        chunk_top_k_kernel[(R, 1)](rows, values, indices, rows.stride(0), V, 1, K=k, BLOCK=block, num_warps=warps)
        return values, indices
    per = min(k, block)  # each chunk's winners
    cand_v = torch.empty(R, S, per, dtype=torch.float32, device=x.device)
    cand_i = torch.empty(R, S, per, dtype=torch.long, device=x.device)
    chunk_top_k_kernel[(R, S)](rows, cand_v, cand_i, rows.stride(0), V, S, K=per, BLOCK=block, num_warps=warps)
    C = S * per
    merge_top_k_kernel[(R,)](cand_v, cand_i, values, indices, C, K=k, BC=triton.next_power_of_2(C), num_warps=4)
    return values, indices
