"""Depthwise causal conv + SiLU for prefill rows that extend a sequence (the plain conv returns the lanes' new
history; the prefill's, `conv_extend_heads`, reads and writes the pool's histories in place, by slot).

`causal_conv_extend_ref` is the torch route, `causal_conv_extend` the Triton kernel: one program per
(channel tile, row tile, lane) walks its rows one at a time where the GEMM wrote them (a strided column view
of the projection), each input loaded once and kept for the next rows' taps, the first row tile reading the
history, with the arithmetic of README.md (fp32 taps in order from 0, SiLU, one rounding to the rows'
dtype), so the two agree bit for bit on a GPU, as the verify route's do. The
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


@triton.jit
def _input(p_rows, p_hist, src, stride_r_t, stride_h_t, T, m_c, has, K: tl.constexpr):
    """The [BC] inputs at position src of a lane (in the rows' dtype): row src when src >= 0 (zeros past T),
    else history column K-1 + src (zeros without a slot)."""
    b_x = tl.load(p_rows + tl.maximum(src, 0).to(tl.int64) * stride_r_t, mask=m_c & (src >= 0) & (src < T), other=0.0)
    b_h = tl.load(p_hist + tl.maximum(src + K - 1, 0) * stride_h_t, mask=m_c & (src < 0) & has, other=0.0)
    return tl.where(src >= 0, b_x, b_h.to(p_rows.dtype.element_ty))


@triton.jit
def _conv_row(out, k_out, v_out, t, i_l, i_c, o_d, o_c, m_c, T, C, DK, KD, eps, x1, x2, x3, x, w1, w2, w3, w4,
              K: tl.constexpr, HEADS: tl.constexpr):
    """Row t's outputs from its inputs x and those 3, 2, 1 rows back (x1, x2, x3; m_c: the channels to store)."""
    b_acc = tl.zeros(x.shape, dtype=tl.float32)  # fp32 taps in order from 0, as the torch route adds them
    if K == 4:
        b_acc = b_acc + w1 * x1
    if K >= 3:
        b_acc = b_acc + w2 * x2
    if K >= 2:
        b_acc = b_acc + w3 * x3
    b_acc = b_acc + w4 * x
    dtype = out.dtype.element_ty
    b_o = tl.math.div_rn(b_acc, 1.0 + exact_exp(-b_acc)).to(dtype)  # silu, rounded
    if not HEADS:
        tl.store(out + (i_l * T + t) * C + o_c, b_o, mask=m_c)
    elif i_c * DK < 2 * KD:  # a q or k head: normalised
        b_n = b_o.to(tl.float32)
        b_n = (b_n * exact_rsqrt(tl.sum(b_n * b_n, axis=0) + eps)).to(dtype)
        o_r = (i_l * T + t) * KD + o_d  # the row's start
        if i_c * DK < KD:
            p_o = out + o_r + i_c * DK
        else:
            p_o = k_out + o_r + (i_c * DK - KD)
        tl.store(p_o, b_n, mask=m_c)
    else:
        VD = C - 2 * KD
        tl.store(v_out + (i_l * T + t) * VD + (o_c - 2 * KD), b_o, mask=m_c)


@triton.jit(do_not_specialize=["T"])  # prefill chunks come in every length
def conv_extend_kernel(
    rows, history, slots, weight, n_rows, out, k_out, v_out, new_history,
    stride_r_l, stride_r_t, stride_r_c,
    stride_h_l, stride_h_c, stride_h_t,
    stride_n_l, stride_n_c, stride_n_t,
    stride_w_c, stride_w_t,
    T, C, DK, KD, eps,
    K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, HEADS: tl.constexpr,
    STEP: tl.constexpr = 1,
):
    """One program: rows [i_t * BT, +BT) x channels [i_c * DK, +DK) of lane i_l (DK <= BC, K <= 4), STEP rows (1
    or 2) at a time: each input is loaded once, the next STEP rows' loads in flight while a step computes, and
    kept for the next K-1 rows' taps (the window x1, x2, x3 holds the inputs 3, 2, 1 rows back). Tap j of row t
    reads the input at t - (K-1) + j: a row when that is >= 0, else history column K-1 + (t - (K-1) + j), which
    only row tile 0 reaches - row slots[i_l] of history (slot -1: zeros); that program also writes the lane's new
    history (the inputs at n - (K-1) + i) to row slots[i_l] of new_history (slot -1: nowhere), which may be
    history itself. Without HEADS the outputs go to out [L, T, C]. With HEADS a tile is one key head (DK = dk):
    below KD channels q, below 2 KD k, each L2-normalised over the head (fp32 from the rounded conv output, one
    rounding) and stored to its head of out / k_out [L, T, KD / DK, DK]; the rest is v, stored as it is to v_out
    [L, T, C - 2 KD]. A row's bits do not depend on STEP or BT."""
    i_c, i_t, i_l = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_l = i_l.to(tl.int64)
    o_d = tl.arange(0, BC)
    o_c = i_c * DK + o_d
    m_c = (o_d < DK) & (o_c < C)
    p_rows = rows + i_l * stride_r_l + o_c.to(tl.int64) * stride_r_c
    slot = tl.load(slots + i_l).to(tl.int64)
    has = slot >= 0  # a slot: its history is read and written
    p_hist = history + tl.maximum(slot, 0) * stride_h_l + o_c.to(tl.int64) * stride_h_c
    t0 = i_t * BT
    x1 = _input(p_rows, p_hist, t0 - 3, stride_r_t, stride_h_t, T, m_c, has, K).to(tl.float32)
    x2 = _input(p_rows, p_hist, t0 - 2, stride_r_t, stride_h_t, T, m_c, has, K).to(tl.float32)
    x3 = _input(p_rows, p_hist, t0 - 1, stride_r_t, stride_h_t, T, m_c, has, K).to(tl.float32)
    p_w = weight + o_c * stride_w_c
    w1 = tl.load(p_w + max(K - 4, 0) * stride_w_t, mask=m_c, other=0.0).to(tl.float32)  # the taps of x1, x2, x3, x
    w2 = tl.load(p_w + max(K - 3, 0) * stride_w_t, mask=m_c, other=0.0).to(tl.float32)
    w3 = tl.load(p_w + max(K - 2, 0) * stride_w_t, mask=m_c, other=0.0).to(tl.float32)
    w4 = tl.load(p_w + (K - 1) * stride_w_t, mask=m_c, other=0.0).to(tl.float32)
    t_end = tl.minimum(t0 + BT, T)
    p_x = p_rows + t0.to(tl.int64) * stride_r_t  # row t's inputs, STEP rows on at each step (64-bit offsets)
    x_next = tl.load(p_x, mask=m_c & (t0 < T), other=0.0)
    if STEP == 2:
        x_after = tl.load(p_x + stride_r_t, mask=m_c & (t0 + 1 < t_end), other=0.0)
    for t in range(t0, t_end, STEP):
        x = x_next.to(tl.float32)
        p_x += STEP * stride_r_t
        x_next = tl.load(p_x, mask=m_c & (t + STEP < t_end), other=0.0)  # in flight meanwhile
        if STEP == 2:
            x_b = x_after.to(tl.float32)
            x_after = tl.load(p_x + stride_r_t, mask=m_c & (t + 3 < t_end), other=0.0)
        _conv_row(out, k_out, v_out, t, i_l, i_c, o_d, o_c, m_c, T, C, DK, KD, eps, x1, x2, x3, x, w1, w2, w3, w4,
                  K, HEADS)
        if STEP == 2:
            _conv_row(out, k_out, v_out, t + 1, i_l, i_c, o_d, o_c, m_c & (t + 1 < t_end), T, C, DK, KD, eps,
                      x2, x3, x, x_b, w1, w2, w3, w4, K, HEADS)
            x1, x2, x3 = x3, x, x_b
        else:
            x1, x2, x3 = x2, x3, x
    if i_t == 0:
        n = tl.load(n_rows + i_l).to(tl.int32)
        o_k = tl.arange(0, BK)
        i_in = n - (K - 1) + o_k[:, None]  # [BK, 1] the inputs that stay
        m_k = (o_k[:, None] < K - 1) & m_c[None, :]
        b_kr = tl.load(p_rows[None, :] + tl.maximum(i_in, 0).to(tl.int64) * stride_r_t, mask=m_k & (i_in >= 0),
                       other=0.0)
        b_kh = tl.load(p_hist[None, :] + tl.maximum(i_in + K - 1, 0) * stride_h_t, mask=m_k & (i_in < 0) & has,
                       other=0.0)
        b_keep = tl.where(i_in >= 0, b_kr, b_kh.to(rows.dtype.element_ty))
        tl.debug_barrier()  # every thread's loads of the history before any store (new_history may be history)
        p_new = new_history + tl.maximum(slot, 0) * stride_n_l + o_c[None, :].to(tl.int64) * stride_n_c \
            + o_k[:, None] * stride_n_t
        tl.store(p_new, b_keep.to(new_history.dtype.element_ty), mask=m_k & has)


ROW_TILE, NUM_WARPS, STEP = 16, 1, 1  # rows per program, warps, rows a loop step (bench/tune_conv.py sweeps them)


def _launch(rows, history, slots, weight, n_rows, outs, new_history, DK: int, KD: int, heads: bool) -> None:
    """One launch: ROW_TILE rows a program; row tile 0 also reads the history and writes the new one."""
    L, T, C = rows.shape
    K = weight.shape[1]
    if K > 4:
        raise ValueError(f"the prefill conv kernel takes up to 4 taps, not {K}")
    if L and T:
        out, k_out, v_out = outs
        BT = max(ROW_TILE, K - 1)  # (only row tile 0 reaches into the history)
        conv_extend_kernel[(triton.cdiv(C, DK), triton.cdiv(T, BT), L)](
            rows, history, slots, weight, n_rows, out, k_out, v_out, new_history,
            *rows.stride(), *history.stride(), *new_history.stride(), *weight.stride(),
            T, C, DK, KD, L2_EPS,
            K=K, BT=BT, BC=triton.next_power_of_2(DK), BK=triton.next_power_of_2(max(K - 1, 1)),
            HEADS=heads, STEP=STEP, num_warps=NUM_WARPS, num_stages=1, enable_fp_fusion=False, enable_reflect_ftz=False,
        )


def causal_conv_extend(rows: torch.Tensor, history: torch.Tensor, weight: torch.Tensor, n_rows: torch.Tensor):
    """Fused causal_conv_extend_ref (same arguments and results; rows may be a strided view, history
    any layout). One launch, no host sync."""
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
    """conv_extend_heads_ref in one launch (as causal_conv_extend; the normalisation's sum in the kernel's
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
