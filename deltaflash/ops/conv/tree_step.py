"""Conv tree step: depthwise causal conv + SiLU over a lane's tree of rows, reading the slot's conv
history (never writing it) and emitting the lane's window [history | rows] for the commit.

Reference: naive.conv_tree_step_ref. Math and the bitwise contract: README.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaflash.ops.conv.naive import check_device, check_tree_step_shapes
from deltaflash.ops.gdn.verify import MAX_WIDTH, exact_exp


@triton.jit
def conv_tree_step_kernel(
    rows, conv_history, state_slot_ids, parents, weight, out, window,
    stride_r_l, stride_r_w, stride_r_c,
    stride_h_s, stride_h_c, stride_h_t,
    stride_p_l, stride_p_w,
    stride_w_c, stride_w_t,
    C,
    W: tl.constexpr, K: tl.constexpr, BC: tl.constexpr, BW: tl.constexpr, BT: tl.constexpr,
):
    """One program: channel tile i_c of node n of lane i_l (nodes are independent: the path walk
    only reads the window). Window column K-1+n holds node n; tap j of node n reads the column K-1-j
    steps up its path (past the root into the history). Node 0's program also copies the history."""
    i_c, n, i_l = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_l = i_l.to(tl.int64)
    o_c = i_c * BC + tl.arange(0, BC)
    o_w = tl.arange(0, BW)
    o_t = tl.arange(0, BT)
    m_c = o_c < C
    KW = K - 1 + W  # window columns

    i_s = tl.load(state_slot_ids + i_l).to(tl.int64)
    p_hist = conv_history + i_s * stride_h_s + o_c.to(tl.int64) * stride_h_c  # column 0 of the slot's history
    p_rows = rows + i_l * stride_r_l + o_c.to(tl.int64) * stride_r_c  # node 0 of the lane's rows
    p_win = window + (i_l * C + o_c) * KW
    m_hist = m_c & (i_s >= 0)
    if n == 0:
        for t in tl.static_range(K - 1):
            b_h = tl.load(p_hist + t * stride_h_t, mask=m_hist, other=0.0)
            tl.store(p_win + t, b_h.to(window.dtype.element_ty), mask=m_c)

    b_par = tl.load(parents + i_l * stride_p_l + o_w * stride_p_w, mask=o_w < W, other=-1).to(tl.int32)
    b_r = tl.load(p_rows + n * stride_r_w, mask=m_c, other=0.0)
    tl.store(p_win + K - 1 + n, b_r.to(window.dtype.element_ty), mask=m_c)
    # walk up the path: b_cols[j] = window column of tap j
    i_cur = K - 1 + n
    b_cols = tl.where(o_t == K - 1, i_cur, 0)
    for i in tl.static_range(1, K):
        i_par = tl.sum(tl.where(o_w == i_cur - (K - 1), b_par, 0))
        i_cur = tl.where(i_cur >= K - 1, tl.where(i_par >= 0, i_par + K - 1, K - 2), i_cur - 1)
        b_cols = tl.where(o_t == K - 1 - i, i_cur, b_cols)
    # taps in order j = 0..K-1, fp32, from 0
    b_acc = tl.zeros([BC], dtype=tl.float32)
    for j in tl.static_range(K):
        i_col = tl.sum(tl.where(o_t == j, b_cols, 0))
        b_xh = tl.load(p_hist + tl.minimum(i_col, K - 2) * stride_h_t, mask=m_hist & (i_col < K - 1), other=0.0)
        m_row = (i_col >= K - 1) & (i_col < KW)  # upper bound: malformed parents read nothing
        b_xr = tl.load(p_rows + tl.maximum(i_col - (K - 1), 0) * stride_r_w, mask=m_c & m_row, other=0.0)
        b_x = tl.where(i_col < K - 1, b_xh.to(window.dtype.element_ty), b_xr.to(window.dtype.element_ty))
        b_w = tl.load(weight + o_c * stride_w_c + j * stride_w_t, mask=m_c, other=0.0).to(tl.float32)
        b_acc = b_acc + b_w * b_x.to(tl.float32)
    b_o = tl.math.div_rn(b_acc, 1.0 + exact_exp(-b_acc))  # silu
    tl.store(out + (i_l * W + n) * C + o_c, b_o.to(out.dtype.element_ty), mask=m_c)


def conv_tree_step_fwd(rows, conv_history, state_slot_ids, parents, weight, out, window):
    """Allocate the outputs (unless given) and launch one program per (channel tile, node, lane)."""
    L, W, C = rows.shape
    K = weight.shape[1]
    if out is None:
        out = torch.empty(L, W, C, dtype=rows.dtype, device=rows.device)
    if window is None:
        window = torch.empty(L, C, K - 1 + W, dtype=rows.dtype, device=rows.device)
    if L == 0:
        return out, window
    BC = min(triton.next_power_of_2(C), 256)
    conv_tree_step_kernel[(triton.cdiv(C, BC), W, L)](
        rows, conv_history, state_slot_ids, parents, weight, out, window,
        *rows.stride(), *conv_history.stride(), *parents.stride(), *weight.stride(),
        C,
        W=W, K=K, BC=BC, BW=triton.next_power_of_2(W), BT=triton.next_power_of_2(K),
        num_warps=4, num_stages=1, enable_fp_fusion=False, enable_reflect_ftz=False,
    )
    return out, window


def conv_tree_step(rows, conv_history, state_slot_ids, parents, weight, *, out=None, window_out=None):
    """Fused conv_tree_step_ref (same arguments and results). rows [L, W, C] (strided view fine);
    conv_history [S, C, K-1] a layer view of the pool (read only); state_slot_ids [L] (-1 padding);
    parents [L, W]; weight [C, K]. out [L, W, C] and window_out [L, C, K-1+W] (rows' dtype,
    contiguous) may be given. Returns (out, window). No host sync."""
    check_tree_step_shapes(rows, conv_history, state_slot_ids, parents, weight)
    L, W, C = rows.shape
    K = weight.shape[1]
    if not 1 <= W <= MAX_WIDTH:
        raise ValueError(f"verify width W={W} must be in [1, {MAX_WIDTH}]")
    check_device(rows, conv_history=conv_history, state_slot_ids=state_slot_ids, parents=parents, weight=weight)
    for name, t, shape in (("out", out, (L, W, C)), ("window_out", window_out, (L, C, K - 1 + W))):
        if t is not None and (tuple(t.shape) != shape or t.dtype != rows.dtype or not t.is_contiguous()
                              or t.device != rows.device):
            raise ValueError(f"{name} must be a contiguous {rows.dtype} tensor of shape {shape} on {rows.device}")
    return conv_tree_step_fwd(rows, conv_history, state_slot_ids.contiguous(), parents, weight, out, window_out)
