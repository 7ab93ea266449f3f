"""MoE experts as two grouped GEMMs over token-expert pairs sorted by expert, with no host sync
(CUDA-graph capturable): the launch grids depend only on N, k and E.

Reference: naive.moe_experts_ref. Alignment scheme and the grid bound: README.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@triton.jit
def moe_gate_up_kernel(
    x, gate_up_proj, act, pair_ids, block_expert,
    stride_x_n, stride_x_h, stride_w_e, stride_w_r, stride_w_h,
    TOPK, E, H: tl.constexpr, I: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr,
):
    """Program (row block i_m, column tile i_n): act[rows, cols] = silu(x W_gate^T) * (x W_up^T) for
    the block's pairs (token = pair // TOPK) and its expert; padding rows (pair -1) write nothing."""
    i_m, i_n = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    i_e = tl.load(block_expert + i_m).to(tl.int64)
    if i_e >= E:  # past the padded total of this step
        return
    o_m = i_m * BM + tl.arange(0, BM).to(tl.int64)
    o_n = i_n * BN + tl.arange(0, BN).to(tl.int64)
    b_pair = tl.load(pair_ids + o_m)
    m_m, m_n = b_pair >= 0, o_n < I
    o_t = tl.where(m_m, b_pair, 0) // TOPK
    p_x = x + o_t[:, None] * stride_x_n
    p_g = gate_up_proj + i_e * stride_w_e + o_n[None, :] * stride_w_r
    p_u = p_g + I * stride_w_r
    b_gate = tl.zeros([BM, BN], dtype=tl.float32)
    b_up = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, H, BK):
        o_k = k0 + tl.arange(0, BK).to(tl.int64)
        m_k = o_k < H
        b_x = tl.load(p_x + o_k[None, :] * stride_x_h, mask=m_m[:, None] & m_k[None, :], other=0.0)
        m_w = m_k[:, None] & m_n[None, :]
        b_wg = tl.load(p_g + o_k[:, None] * stride_w_h, mask=m_w, other=0.0)  # [BK, BN] = W_gate^T tile
        b_wu = tl.load(p_u + o_k[:, None] * stride_w_h, mask=m_w, other=0.0)
        b_gate = tl.dot(b_x, b_wg, b_gate, input_precision=PRECISION)
        b_up = tl.dot(b_x, b_wu, b_up, input_precision=PRECISION)
    # The reference's roundings: gate and up in x's dtype, silu(gate) rounded, then the product.
    dtype = act.dtype.element_ty
    b_gate = b_gate.to(dtype).to(tl.float32)
    b_silu = (b_gate / (1.0 + tl.exp(-b_gate))).to(dtype).to(tl.float32)
    b_act = b_silu * b_up.to(dtype).to(tl.float32)
    tl.store(act + o_m[:, None] * I + o_n[None, :], b_act.to(dtype), mask=m_m[:, None] & m_n[None, :])


@triton.jit
def moe_down_kernel(
    act, down_proj, topk_weights, pair_out, pair_ids, block_expert,
    stride_w_e, stride_w_h, stride_w_i,
    E, H: tl.constexpr, I: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr,
):
    """Program (row block i_m, column tile i_n): pair_out[pair, cols] = topk_weights[pair] *
    (act[row] W_down^T) for the block's pairs and its expert; padding rows write nothing."""
    i_m, i_n = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    i_e = tl.load(block_expert + i_m).to(tl.int64)
    if i_e >= E:
        return
    o_m = i_m * BM + tl.arange(0, BM).to(tl.int64)
    o_n = i_n * BN + tl.arange(0, BN).to(tl.int64)
    b_pair = tl.load(pair_ids + o_m)
    m_m, m_n = b_pair >= 0, o_n < H
    o_p = tl.where(m_m, b_pair, 0)
    p_a = act + o_m[:, None] * I
    p_d = down_proj + i_e * stride_w_e + o_n[None, :] * stride_w_h
    b_y = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, I, BK):
        o_k = k0 + tl.arange(0, BK).to(tl.int64)
        m_k = o_k < I
        b_a = tl.load(p_a + o_k[None, :], mask=m_m[:, None] & m_k[None, :], other=0.0)
        b_d = tl.load(p_d + o_k[:, None] * stride_w_i, mask=m_k[:, None] & m_n[None, :], other=0.0)
        b_y = tl.dot(b_a, b_d, b_y, input_precision=PRECISION)
    # The reference's roundings: the expert output in x's dtype, times the routing weight, rounded.
    dtype = pair_out.dtype.element_ty
    b_w = tl.load(topk_weights + o_p, mask=m_m, other=0.0).to(tl.float32)
    b_y = b_y.to(dtype).to(tl.float32) * b_w[:, None]
    tl.store(pair_out + o_p[:, None] * H + o_n[None, :], b_y.to(dtype), mask=m_m[:, None] & m_n[None, :])


@dataclass(frozen=True)
class ExpertBlocks:
    """Token-expert pairs (pair p = token * k + j) grouped by expert, each expert's run of rows padded
    to a multiple of BM. R = rows_bound(N * k, E, BM), a host-known bound on the padded total.
    pair_ids [R] long: the pair of each row, -1 for padding (also every row past the padded total);
    block_expert [R // BM] long: the expert of each BM-row block, E past the padded total."""

    pair_ids: torch.Tensor
    block_expert: torch.Tensor


def rows_bound(num_pairs: int, num_experts: int, BM: int) -> int:
    """Most padded rows P pairs can take: each routed expert adds < BM padding rows, and at most
    min(E, P) experts are routed; = min(P * BM, P + E * (BM - 1)), rounded up to whole blocks."""
    return triton.cdiv(num_pairs + min(num_experts, num_pairs) * (BM - 1), BM) * BM


def group_pairs_by_expert(topk_ids: torch.Tensor, num_experts: int, BM: int) -> ExpertBlocks:
    """topk_ids [N, k] long -> ExpertBlocks, with device ops only (a stable sort, searchsorted,
    cumsum, scatter): no host sync, shapes fixed by N, k, E and BM."""
    ids = topk_ids.reshape(-1)
    P, R = ids.numel(), rows_bound(ids.numel(), num_experts, BM)
    sorted_ids, order = torch.sort(ids, stable=True)
    experts = torch.arange(num_experts, device=ids.device)
    start = torch.searchsorted(sorted_ids, experts)  # [E] first sorted position of each expert
    count = torch.searchsorted(sorted_ids, experts, right=True) - start
    padded = (count + BM - 1) // BM * BM  # [E] rows of each expert's run
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    rank = torch.arange(P, device=ids.device) - start[sorted_ids]  # place within its expert's run
    pair_ids = torch.full((R,), -1, dtype=torch.long, device=ids.device)
    pair_ids.scatter_(0, padded_start[sorted_ids] + rank, order)
    block_rows = torch.arange(0, R, BM, device=ids.device)
    block_expert = torch.searchsorted(padded_end, block_rows, right=True)  # E once past the total
    return ExpertBlocks(pair_ids, block_expert)


def moe_tiles(num_pairs: int, num_experts: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BM, BN, BK). 16-row blocks while experts average under 32 pairs (decode: padding would
    dominate larger blocks), 64-row blocks beyond (prefill). BK is 64 for both, so a token's products
    are summed in the same pieces whichever block size its batch gets (batch invariance: a verify row
    and a decode row give the same bits)."""
    if num_pairs < 32 * num_experts:
        return 16, 64, 64
    return (64, 128, 64) if dtype.itemsize <= 2 else (64, 64, 64)


def fused_moe_fwd(x, topk_weights, topk_ids, gate_up_proj, down_proj) -> torch.Tensor:
    N, H = x.shape
    k = topk_ids.shape[1]
    E, I = down_proj.shape[0], down_proj.shape[2]
    if N == 0:
        return torch.zeros_like(x)
    BM, BN, BK = moe_tiles(N * k, E, x.dtype)
    blocks = group_pairs_by_expert(topk_ids, E, BM)
    R = blocks.pair_ids.shape[0]
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # tf32 only matters for fp32 inputs
    act = torch.empty(R, I, dtype=x.dtype, device=x.device)
    moe_gate_up_kernel[(R // BM, triton.cdiv(I, BN))](
        x, gate_up_proj, act, blocks.pair_ids, blocks.block_expert,
        *x.stride(), *gate_up_proj.stride(),
        k, E, H=H, I=I,
        BM=BM, BN=BN, BK=BK, PRECISION=precision, num_warps=4,
    )
    pair_out = torch.empty(N * k, H, dtype=x.dtype, device=x.device)
    moe_down_kernel[(R // BM, triton.cdiv(H, BN))](
        act, down_proj, topk_weights.reshape(-1).contiguous(), pair_out, blocks.pair_ids, blocks.block_expert,
        *down_proj.stride(),
        E, H=H, I=I,
        BM=BM, BN=BN, BK=BK, PRECISION=precision, num_warps=4,
    )
    return pair_out.view(N, k, H).sum(1)  # fixed order over k: deterministic, no atomics


def fused_moe_experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                      gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> torch.Tensor:
    """naive.moe_experts_ref as two grouped-GEMM launches, with no host sync. x [N, H] (fp32, bf16 or
    fp16); topk_weights [N, k] in x's dtype; topk_ids [N, k] long in [0, E) (not checked: that
    would sync); gate_up_proj [E, 2I, H]; down_proj [E, H, I], both in x's dtype -> [N, H]."""
    if x.dim() != 2 or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"x must be [N, H] fp32, bf16 or fp16; got {tuple(x.shape)} {x.dtype}")
    N, H = x.shape
    if gate_up_proj.dim() != 3 or gate_up_proj.shape[1] % 2 or gate_up_proj.shape[2] != H:
        raise ValueError(f"gate_up_proj must be [E, 2I, {H}]; got {tuple(gate_up_proj.shape)}")
    E, I = gate_up_proj.shape[0], gate_up_proj.shape[1] // 2
    if down_proj.shape != (E, H, I):
        raise ValueError(f"down_proj must be [{E}, {H}, {I}]; got {tuple(down_proj.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != N or topk_ids.dtype != torch.long:
        raise ValueError(f"topk_ids must be [{N}, k] long; got {tuple(topk_ids.shape)} {topk_ids.dtype}")
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_weights must be {tuple(topk_ids.shape)}; got {tuple(topk_weights.shape)}")
    for name, t in (("topk_weights", topk_weights), ("gate_up_proj", gate_up_proj), ("down_proj", down_proj)):
        if t.dtype != x.dtype:
            raise ValueError(f"{name} must be {x.dtype} like x; got {t.dtype}")
    for name, t in (("topk_weights", topk_weights), ("topk_ids", topk_ids),
                    ("gate_up_proj", gate_up_proj), ("down_proj", down_proj)):
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")
    return fused_moe_fwd(x, topk_weights, topk_ids, gate_up_proj, down_proj)
