"""Depthwise causal conv + SiLU for prefill rows that extend a sequence (the plain conv returns the lanes' new
history; the prefill's, `conv_extend_heads`, reads and writes the pool's histories in place, by slot).

`causal_conv_extend_ref` is the torch route, `causal_conv_extend` the Triton kernel: one program per
(channel tile, row tile, lane) reads the rows where the GEMM wrote them (a strided column view of the
projection) and, for the first K-1 rows (their own launch), the history, with the arithmetic of README.md
(fp32 taps in order from 0, SiLU, one rounding to the rows' dtype), so the two agree bit for bit on a GPU,
as the verify route's do. The
verify route (read-only history, tree parents, windows for commit) lives in tree_step.py / naive.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from deltaflash.ops.conv.naive import check_device, check_rows_and_weight
from deltaflash.ops.gdn.chunk import l2_normalize
from deltaflash.ops.gdn.naive import L2_EPS
from deltaflash.ops.gdn.verify import exact_exp, exact_rsqrt


def check_extend_shapes(rows, history, weight, n_rows):
    L, _, C, K = check_rows_and_weight(rows, weight, "T")
    if tuple(history.shape) != (L, C, K - 1):
        raise ValueError(f"history must be [L={L}, C={C}, K-1={K - 1}]; got {tuple(history.shape)}")
    if tuple(n_rows.shape) != (L,):
        raise ValueError(f"n_rows must be [L={L}]; got {tuple(n_rows.shape)}")


def causal_conv_extend_ref(rows: torch.Tensor, history: torch.Tensor, weight: torch.Tensor, n_rows: torch.Tensor):
    """rows: [L, T, C] projected qkv (valid rows first, n_rows[l] of them); history: [L, C, K-1] the
    K-1 raw inputs before row 0; weight: [C, K] (tap K-1 multiplies the current row).
    Returns (silu(conv) [L, T, C] in rows' dtype, new history [L, C, K-1] = last K-1 raw inputs
    after the lane's n_rows rows, in rows' dtype). Rows past n_rows get outputs too (of the inputs
    there); they change no history."""
    check_extend_shapes(rows, history, weight, n_rows)
    L, T, C = rows.shape
    K = weight.shape[1]
    full = torch.cat([history.to(rows.dtype), rows.transpose(1, 2)], dim=2)  # [L, C, K-1+T]
    x, w = full.float(), weight.float()
    acc = torch.zeros(L, C, T, dtype=torch.float32, device=rows.device)
    for j in range(K):  # tap j reads the input K-1-j rows back: column t + j of the window
        acc = acc + w[:, j, None] * x[:, :, j:j + T]
    out = F.silu(acc).to(rows.dtype).transpose(1, 2)
    idx = n_rows.view(L, 1, 1) + torch.arange(K - 1, device=rows.device).view(1, 1, K - 1)
    new_history = full.gather(2, idx.expand(L, C, K - 1))
    return out, new_history


@triton.jit(do_not_specialize=["T"])  # prefill chunks come in every length
def conv_extend_kernel(
    rows, history, slots, weight, n_rows, out, k_out, v_out, new_history,
    stride_r_l, stride_r_t, stride_r_c,
    stride_h_l, stride_h_c, stride_h_t,
    stride_n_l, stride_n_c, stride_n_t,
    stride_w_c, stride_w_t,
    T, C, DK, KD, eps,
    K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    HEADS: tl.constexpr, FIRST: tl.constexpr,
):
    """One program: rows [R0 + i_t * BT, +BT) x channels [i_c * DK, +DK) of lane i_l (DK <= BC). Tap j of row t
    reads the input at t - (K-1) + j: a row when that is >= 0, else history column K-1 + (t - (K-1) + j).
    FIRST: the launch of rows [0, K-1) (R0 = 0), the only ones that reach into the history - row slots[i_l] of
    history (slot -1: zeros) - and it writes the lane's new history (the inputs at n - (K-1) + i) to row
    slots[i_l] of new_history (slot -1: nowhere), which may be history itself. Else R0 = K-1: rows only, and the
    registers of the history's loads (its [C, K-1] layout loads a channel at a time) are not the whole grid's.
    Without HEADS the outputs go to out [L, T, C]. With HEADS a tile is one key head (DK = dk): below KD
    channels q, below 2 KD k, each L2-normalised over the head (fp32 from the rounded conv output, one
    rounding) and stored to its head of out / k_out [L, T, KD / DK, DK]; the rest is v, stored as it is to
    v_out [L, T, C - 2 KD]."""
    i_c, i_t, i_l = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_l = i_l.to(tl.int64)
    o_d = tl.arange(0, BC)
    o_c = i_c * DK + o_d
    o_t = (0 if FIRST else K - 1) + i_t * BT + tl.arange(0, BT)
    m_c = (o_d < DK) & (o_c < C)
    m_t = (o_t < T) & (o_t < K - 1) if FIRST else o_t < T
    p_rows = rows + i_l * stride_r_l + o_c[None, :].to(tl.int64) * stride_r_c
    slot = tl.load(slots + i_l).to(tl.int64)  # (FIRST only reads the history; the others drop this load)
    has = slot >= 0  # a slot: its history is read and written
    p_hist = history + tl.maximum(slot, 0) * stride_h_l + o_c[None, :].to(tl.int64) * stride_h_c
    b_acc = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(K):
        src = o_t[:, None] - (K - 1) + j  # [BT, 1] input index (negative: the history)
        b_x = tl.load(p_rows + tl.maximum(src, 0).to(tl.int64) * stride_r_t, mask=m_c[None, :] & (src >= 0) & (src < T),
                      other=0.0)
        if FIRST:
            b_xh = tl.load(p_hist + tl.maximum(src + K - 1, 0) * stride_h_t, mask=m_c[None, :] & (src < 0) & has,
                           other=0.0)
            b_x = tl.where(src >= 0, b_x, b_xh.to(rows.dtype.element_ty))
        b_w = tl.load(weight + o_c * stride_w_c + j * stride_w_t, mask=m_c, other=0.0).to(tl.float32)
        b_acc = b_acc + b_w[None, :] * b_x.to(tl.float32)
    dtype = out.dtype.element_ty
    b_o = tl.math.div_rn(b_acc, 1.0 + exact_exp(-b_acc)).to(dtype)  # silu, rounded
    m_o = m_c[None, :] & m_t[:, None]
    if not HEADS:
        tl.store(out + (i_l * T + o_t[:, None]) * C + o_c[None, :], b_o, mask=m_o)
    elif i_c * DK < 2 * KD:  # a q or k head: normalised
        b_n = b_o.to(tl.float32)
        b_n = (b_n * exact_rsqrt(tl.sum(b_n * b_n, axis=1) + eps)[:, None]).to(dtype)
        o_r = (i_l * T + o_t[:, None]).to(tl.int64) * KD + o_d[None, :]  # row starts
        if i_c * DK < KD:
            p_o = out + o_r + i_c * DK
        else:
            p_o = k_out + o_r + (i_c * DK - KD)
        tl.store(p_o, b_n, mask=m_o)
    else:
        VD = C - 2 * KD
        tl.store(v_out + (i_l * T + o_t[:, None]).to(tl.int64) * VD + (o_c[None, :] - 2 * KD), b_o, mask=m_o)
    if FIRST:
        n = tl.load(n_rows + i_l).to(tl.int32)
        o_k = tl.arange(0, BK)
        i_in = n - (K - 1) + o_k[:, None]  # [BK, 1] the inputs that stay
        m_k = (o_k[:, None] < K - 1) & m_c[None, :]
        b_kr = tl.load(p_rows + tl.maximum(i_in, 0).to(tl.int64) * stride_r_t, mask=m_k & (i_in >= 0), other=0.0)
        b_kh = tl.load(p_hist + tl.maximum(i_in + K - 1, 0) * stride_h_t, mask=m_k & (i_in < 0) & has, other=0.0)
        b_keep = tl.where(i_in >= 0, b_kr, b_kh.to(rows.dtype.element_ty))
        tl.debug_barrier()  # every thread's loads of the history before any store (new_history may be history)
        p_new = new_history + tl.maximum(slot, 0) * stride_n_l + o_c[None, :].to(tl.int64) * stride_n_c \
            + o_k[:, None] * stride_n_t
        tl.store(p_new, b_keep.to(new_history.dtype.element_ty), mask=m_k & has)


ROW_TILE, NUM_WARPS = 32, 4  # rows per program, warps (tile sweep on the H200: bench/tune_conv.py)


def _launch(rows, history, slots, weight, n_rows, outs, new_history, DK: int, KD: int, heads: bool) -> None:
    """Two launches: rows [0, K-1) with the history (and the new history), then the rest in ROW_TILE rows."""
    L, T, C = rows.shape
    K = weight.shape[1]
    if L and T:
        out, k_out, v_out = outs
        BK = triton.next_power_of_2(K - 1)
        for first, row_tiles, BT, warps in ((True, 1, BK, 1), (False, triton.cdiv(T - (K - 1), ROW_TILE), ROW_TILE,
                                                                  NUM_WARPS)):
            if row_tiles > 0:
                conv_extend_kernel[(triton.cdiv(C, DK), row_tiles, L)](
                    rows, history, slots, weight, n_rows, out, k_out, v_out, new_history,
                    *rows.stride(), *history.stride(), *new_history.stride(), *weight.stride(),
                    T, C, DK, KD, L2_EPS,
                    K=K, BT=BT, BC=triton.next_power_of_2(DK), BK=BK, HEADS=heads, FIRST=first,
                    num_warps=warps, num_stages=1, enable_fp_fusion=False, enable_reflect_ftz=False,
                )


def causal_conv_extend(rows: torch.Tensor, history: torch.Tensor, weight: torch.Tensor, n_rows: torch.Tensor):
    """Fused causal_conv_extend_ref (same arguments and results; rows may be a strided view, history
    any layout). Two launches (rows [0, K-1) with the history, then the rest), no host sync."""
    check_extend_shapes(rows, history, weight, n_rows)
    check_device(rows, history=history, weight=weight, n_rows=n_rows)
    L, T, C = rows.shape
    out = torch.empty(L, T, C, dtype=rows.dtype, device=rows.device)
    new_history = torch.empty(L, C, weight.shape[1] - 1, dtype=rows.dtype, device=rows.device)
    lanes = torch.arange(L, device=rows.device)  # lane l reads history[l], writes new_history[l]
    _launch(rows, history, lanes, weight, n_rows, (out, out, out), new_history, min(triton.next_power_of_2(C), 128), 0,
            False)
    return out, new_history


def check_heads(C: int, key_heads: int, value_heads: int, key_dim: int) -> int:
    """The value head dim of C = 2 * key_heads * key_dim + value_heads * dv channels."""
    vd = C - 2 * key_heads * key_dim
    if key_heads < 1 or value_heads % key_heads or vd <= 0 or vd % value_heads:
        raise ValueError(f"{C} channels do not split into q, k ({key_heads} x {key_dim} each) and v "
                         f"({value_heads} heads, a multiple of {key_heads})")
    return vd // value_heads


def check_slot_shapes(rows, conv_history, slots, weight, n_rows) -> None:
    L, _, C, K = check_rows_and_weight(rows, weight, "T")
    if conv_history.dim() != 3 or tuple(conv_history.shape[1:]) != (C, K - 1):
        raise ValueError(f"conv_history must be [slots, C={C}, K-1={K - 1}]; got {tuple(conv_history.shape)}")
    for name, t in (("slots", slots), ("n_rows", n_rows)):
        if tuple(t.shape) != (L,):
            raise ValueError(f"{name} must be [L={L}]; got {tuple(t.shape)}")


def read_histories(conv_history: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[L, C, K-1]: row slots[l] of conv_history [S, C, K-1], zeros where slots[l] < 0."""
    return torch.where((slots >= 0)[:, None, None], conv_history[slots.clamp(min=0)], 0)


def write_histories(conv_history: torch.Tensor, slots: torch.Tensor, new_history: torch.Tensor) -> None:
    """conv_history[slots[l]] = new_history[l] for every lane with a slot (>= 0; those are distinct), in one
    index_put_ and no host sync (a CUDA graph captures it): a lane without a slot writes what the first lane
    with one writes, to that slot - copies of one value, the same whichever lands last - or, where no lane
    has a slot, row 0's history back unchanged. The first lane is picked by index_select: indexing with a
    0-dim tensor would read it on the host."""
    live = slots >= 0
    first = live.int().argmax().view(1)  # the first lane with a slot (0 if none)
    target = torch.where(live, slots, slots.index_select(0, first).clamp(min=0))
    new_history = new_history.to(conv_history.dtype)
    fallback = torch.where(live.index_select(0, first)[:, None, None], new_history.index_select(0, first),
                           conv_history.index_select(0, target.index_select(0, first)))
    conv_history[target] = torch.where(live[:, None, None], new_history, fallback)


def conv_extend_heads_ref(rows, conv_history, slots, weight, n_rows, key_heads: int, value_heads: int, key_dim: int):
    """causal_conv_extend_ref of lanes whose histories are rows of conv_history [S, C, K-1] (a pool's layer),
    lane l's at slots[l] (-1: zeros, and nothing written), split into the chunked rule's inputs: returns (q, k
    [L, T, key_heads, key_dim], L2-normalised in fp32 and rounded to rows' dtype - value head j reads key head
    j // (value_heads / key_heads), in the chunked rule; v [L, T, value_heads, dv]), all contiguous, and
    writes each lane's new history to its slot."""
    check_slot_shapes(rows, conv_history, slots, weight, n_rows)
    dv = check_heads(rows.shape[-1], key_heads, value_heads, key_dim)
    out, new_history = causal_conv_extend_ref(rows, read_histories(conv_history, slots), weight, n_rows)
    write_histories(conv_history, slots, new_history)
    kd = key_heads * key_dim
    q, k, v = out.split([kd, kd, value_heads * dv], dim=-1)

    def normalised(x):
        return l2_normalize(x.unflatten(-1, (key_heads, key_dim)), L2_EPS).to(rows.dtype).contiguous()
    return normalised(q), normalised(k), v.unflatten(-1, (value_heads, dv)).contiguous()


def conv_extend_heads(rows, conv_history, slots, weight, n_rows, key_heads: int, value_heads: int, key_dim: int):
    """conv_extend_heads_ref in two launches (as causal_conv_extend; the normalisation's sum in the kernel's
    order), each lane's history read from and its new history written to its slot's row in place: one
    program's channel tile is one key head (or key_dim channels of v)."""
    check_slot_shapes(rows, conv_history, slots, weight, n_rows)
    check_device(rows, conv_history=conv_history, slots=slots, weight=weight, n_rows=n_rows)
    dv = check_heads(rows.shape[-1], key_heads, value_heads, key_dim)
    L, T, _ = rows.shape
    q = torch.empty(L, T, key_heads, key_dim, dtype=rows.dtype, device=rows.device)
    k, v = torch.empty_like(q), torch.empty(L, T, value_heads, dv, dtype=rows.dtype, device=rows.device)
    _launch(rows, conv_history, slots, weight, n_rows, (q, k, v), conv_history, key_dim, key_heads * key_dim, True)
    return q, k, v
