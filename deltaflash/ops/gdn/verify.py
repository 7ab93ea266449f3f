"""Mapped GDN verify: read each lane's recurrent state through its slot id, run the recurrence over the
lane's rows following `parents`, write only the output and the replay log (never the state).

Reference: naive.gdn_verify_ref. Math, tree handling and the bitwise contract: README.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from deltaflash.ops.gdn.naive import check_verify_shapes, gather_slots_ref, gdn_gates_ref

MAX_WIDTH = 64  # rows per lane; BW = next power of two is held in registers


@dataclass(frozen=True)
class BuildOptions:
    """How the verify kernel is compiled; neither changes what the two routes agree on (both run this
    kernel). BUILD turns both on: H200, 9B shape, 64 lanes, BV 32 (bench/tune_verify.py, 2026-12-05)
    0.217 ms with neither, 0.225 with widen_at_load alone, 0.196 with both (sm_90 row loop 1,308 -> 903
    instructions a thread: bench/verify_registers.py).
    fp_fusion: FMA contraction of the whole kernel (the recurrence's own FMAs are explicit either way); the
        dk sums then fold their products in. The gates keep torch's rounding either way (exact_add /
        exact_mul where contraction reached them; gamma == torch's is checked on the GPU).
    widen_at_load: q and k become fp32 where they are loaded (a few elements a thread) rather than after
        their broadcast over the state tile. The value is the same (bf16 -> fp32 is exact)."""

    fp_fusion: bool = False
    widen_at_load: bool = False


BUILD = BuildOptions(fp_fusion=True, widen_at_load=True)

if triton.knobs.runtime.interpret:
    # The interpreter has no libdevice; numpy's functions stand in (CPU tests only).
    @triton.jit
    def exact_exp(x):
        return tl.exp(x)

    @triton.jit
    def exact_log1p(x):
        return tl.log(1.0 + x)

    @triton.jit
    def exact_rsqrt(x):
        return tl.math.rsqrt(x)

    @triton.jit
    def exact_add(x, y):
        return x + y

    @triton.jit
    def exact_mul(x, y):
        return x * y

    @triton.jit
    def widen(x):
        return x.to(tl.float32)
else:
    # libdevice __nv_expf / __nv_log1pf / __nv_rsqrtf: what torch's CUDA kernels call (tl.exp is ex2.approx).
    @triton.jit
    def exact_exp(x):
        return libdevice.exp(x)

    @triton.jit
    def exact_log1p(x):
        return libdevice.log1p(x)

    @triton.jit
    def exact_rsqrt(x):
        return libdevice.rsqrt(x)

    # add / multiply rounded on their own even in a kernel compiled with FMA contraction (BUILD): PTX
    # never contracts an instruction that names its rounding mode. The gates use them where contraction
    # would merge them with libdevice's last multiply (sigmoid's 1 + exp(-b); -exp(A_log) * softplus).
    @triton.jit
    def exact_add(x, y):
        return tl.inline_asm_elementwise("add.rn.f32 $0, $1, $2;", "=r,r,r", [x, y], dtype=tl.float32,
                                         is_pure=True, pack=1)

    @triton.jit
    def exact_mul(x, y):
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [x, y], dtype=tl.float32,
                                         is_pure=True, pack=1)

    @triton.jit
    def widen(x):
        """x as fp32, converted here: an inline conversion is not moved past a layout change, as `.to` is."""
        if x.dtype == tl.bfloat16:
            return tl.inline_asm_elementwise("cvt.f32.bf16 $0, $1;", "=r,h", [x], dtype=tl.float32, is_pure=True,
                                             pack=1)
        elif x.dtype == tl.float16:
            return tl.inline_asm_elementwise("cvt.f32.f16 $0, $1;", "=r,h", [x], dtype=tl.float32, is_pure=True,
                                             pack=1)
        else:
            return x.to(tl.float32)


@triton.jit
def row_loads(q, k, v, i_l, i_h, i_hk, n, o_k, o_v, m_k, m_v,
              stride_q_l, stride_q_w, stride_q_h, stride_q_d,
              stride_k_l, stride_k_w, stride_k_h, stride_k_d,
              stride_v_l, stride_v_w, stride_v_h, stride_v_d,
              W: tl.constexpr, WIDEN_AT_LOAD: tl.constexpr):
    """Row n's q, k, v as loaded; q, k already fp32 with WIDEN_AT_LOAD (BuildOptions). Rows n >= W load
    zeros (the prefetch past the last row). Nothing else here uses the loaded values, so the loads are in
    flight while the previous row updates the state."""
    live = n < W
    b_q = tl.load(q + i_l * stride_q_l + n * stride_q_w + i_hk * stride_q_h + o_k * stride_q_d,
                  mask=m_k & live, other=0.0)
    b_k = tl.load(k + i_l * stride_k_l + n * stride_k_w + i_hk * stride_k_h + o_k * stride_k_d,
                  mask=m_k & live, other=0.0)
    b_v = tl.load(v + i_l * stride_v_l + n * stride_v_w + i_h * stride_v_h + o_v * stride_v_d,
                  mask=m_v & live, other=0.0)
    if WIDEN_AT_LOAD:
        b_q, b_k = widen(b_q), widen(b_k)
    return b_q, b_k, b_v


@triton.jit
def lane_gates(b_a, b_b, b_neg_A, b_dt, GATES_GIVEN: tl.constexpr):
    """gamma and beta of all a lane's rows at once ([BW] -> [BW, 2]): g = -exp(A_log) * softplus(a + dt_bias),
    gamma = exp(g), beta = sigmoid(b), in torch's roundings (exact_*: the unfused route computes them op
    by op, to the same bits) - or, GATES_GIVEN, the loads are gamma and beta already. A warp computes a
    vector as fast as a scalar: the exp / log1p / division chain runs once a program, not once a row."""
    if GATES_GIVEN:
        b_gamma, b_beta = b_a.to(tl.float32), b_b.to(tl.float32)
    else:
        b_x = b_a.to(tl.float32) + b_dt
        b_gamma = exact_exp(exact_mul(b_neg_A, tl.where(b_x > 20.0, b_x, exact_log1p(exact_exp(b_x)))))
        b_beta = tl.math.div_rn(1.0, exact_add(exact_exp(-b_b.to(tl.float32)), 1.0))
    return tl.join(b_gamma, b_beta)


@triton.jit
def row_prepare(b_q, b_k, b_v, b_gates, o_w, n, scale):
    """Row n's fp32 q, k (not normalised: the norms are scalars, applied to dv-sized vectors in row_step),
    v, gamma, beta (row n of lane_gates: the others masked to +0, so the sum is exact), 1/|k|, scale/|q|
    and k.q from its loads. |x| = sqrt(sum x^2 + 1e-6)."""
    b_gamma, b_beta = tl.split(tl.sum(tl.where((o_w == n)[:, None], b_gates, 0.0), 0))
    b_q = b_q.to(tl.float32)
    b_k = b_k.to(tl.float32)
    # q.q, k.k and k.q in one reduction over dk ([dk, 2, 2] -> [2, 2]: (q.q, k.k) and (k.q, k.q))
    b_norms, b_cross = tl.split(tl.sum(tl.join(tl.join(b_q * b_q, b_k * b_k), tl.join(b_k * b_q, b_k * b_q)), 0))
    b_qq, b_kk = tl.split(b_norms)
    b_kq, _ = tl.split(b_cross)
    b_rq = exact_rsqrt(b_qq + 1e-6) * scale
    b_rk = exact_rsqrt(b_kk + 1e-6)
    return b_q, b_k, b_v.to(tl.float32), b_gamma, b_beta, b_rk, b_rq, b_kq


@triton.jit
def decay_update(b_S, b_gamma, b_k, b_delta):
    """S' = gamma S + k delta^T on a [BK, BV] tile (b_k [BK], b_delta [BV]): one rounding for the decay,
    one fused multiply-add for the rank-1 update. The verify row and the replay commit both call this,
    so a committed state is bit-for-bit the verify recurrence's."""
    return tl.fma(b_k[:, None], b_delta[None, :], b_S * b_gamma)


@triton.jit
def row_step(b_S, b_q, b_k, b_v, b_gamma, b_beta, b_rk, b_rq, b_kq):
    """One row of the recurrence on a [BK, BV] state tile, with k, q not normalised (k_n = rk k,
    q_n = rq q): both dk sums read the parent state S (S^T k and S^T q, independent), then
        delta = beta (v - gamma rk S^T k)                 (= beta (v - gamma S^T k_n))
        d = rk delta                                     (so that k d^T = k_n delta^T)
        S' = gamma S + k d^T
        o = rq (gamma S^T q + d k.q)                     (= S'^T q_n)
    Every per-row vector op is on dv-sized vectors; the [BK, BV] tile sees two products, two sums, the
    decay and one FMA. Returns (S', o, d). The verify kernel's arithmetic, shared with the unfused route
    (README.md)."""
    # both sums in one reduction: a tile spread over several warps crosses them once a row, not twice
    b_Sk, b_Sq = tl.split(tl.sum(tl.join(b_S * b_k[:, None], b_S * b_q[:, None]), 0))
    b_d = b_rk * (b_beta * (b_v - b_gamma * (b_rk * b_Sk)))
    b_o = b_rq * tl.fma(b_d, b_kq, b_gamma * b_Sq)
    return decay_update(b_S, b_gamma, b_k, b_d), b_o, b_d


@triton.jit
def leaf_path(parents, i_l, i_leaf, o_w, stride_p_l, stride_p_w, W: tl.constexpr):
    """The root path of node i_leaf of lane i_l's tree, as this leaf's program walks it: (on [BW], 1 at
    the path's nodes; the path's first node; its node count, 0 when i_leaf has a child, so only leaves
    run; the first node this program writes). Every node is written by one program, the leaf reached
    from it by first children (its lowest-numbered child): on this path those are the nodes from the
    last one that is not its parent's first child (the root when there is none)."""
    b_par = tl.load(parents + i_l * stride_p_l + o_w * stride_p_w, mask=o_w < W, other=-2).to(tl.int32)
    is_leaf = tl.sum((b_par == i_leaf).to(tl.int32)) == 0
    b_on = tl.zeros(o_w.shape, dtype=tl.int32)
    i_c = tl.where(is_leaf, i_leaf, -1)  # an inner node's program walks nothing
    owned_from = -1
    while i_c >= 0:
        b_on = tl.where(o_w == i_c, 1, b_on)
        i_p = tl.sum(tl.where(o_w == i_c, b_par, 0))
        younger = tl.sum(((b_par == i_p) & (o_w < i_c)).to(tl.int32)) > 0  # an elder sibling: not first
        owned_from = tl.where(younger & (owned_from < 0), i_c, owned_from)
        i_c = i_p
    count = tl.sum(b_on)
    first = tl.min(tl.where(b_on > 0, o_w, W))
    return b_on, first, count, tl.where(owned_from < 0, 0, owned_from)


@triton.jit
def gdn_verify_kernel(
    q, k, v, a, b, A_log, dt_bias, recurrent_state, state_slot_ids, parents, o, replay_log,
    stride_q_l, stride_q_w, stride_q_h, stride_q_d,
    stride_k_l, stride_k_w, stride_k_h, stride_k_d,
    stride_v_l, stride_v_w, stride_v_h, stride_v_d,
    stride_a_l, stride_a_w, stride_a_h,
    stride_b_l, stride_b_w, stride_b_h,
    stride_s_s, stride_s_h, stride_s_k, stride_s_v,
    stride_p_l, stride_p_w,
    scale,
    HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    W: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BW: tl.constexpr,
    TREES: tl.constexpr, GATES_GIVEN: tl.constexpr, WIDEN_AT_LOAD: tl.constexpr,
):
    """One program: dv tile i_v, value head i_h, and a lane's chain (without TREES: every lane is a
    chain, the caller's promise; parents are not read) or one root-to-leaf path of a lane's tree (W
    programs per lane, one per node; those of inner nodes run no row). The [BK, BV] state tile lives in
    registers and each row continues from the previous row's: a path program recomputes the nodes it
    shares with other paths (the same update from the same slot state, so the same bits) and writes
    only those it owns (leaf_path), so a tree costs its depth in rows, not its node count.
    The gates of every row are computed once, before the first; row n + 1's q, k, v are loaded before row
    n updates the state and prepared (norms) after, so the loads are in flight during the update."""
    i_v, i_h, i_g = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_hk = i_h // (HV // HK)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    E: tl.constexpr = 1 + K + V  # replay log entry: [gamma, k (K), delta (V)]
    o_w = tl.arange(0, BW)
    if TREES:
        i_l = (i_g // W).to(tl.int64)
        b_on, i_n, count, owned_from = leaf_path(parents, i_l, i_g % W, o_w, stride_p_l, stride_p_w, W)
    else:
        i_l = i_g.to(tl.int64)
        i_n, count, owned_from = 0, W, 0

    i_s = tl.load(state_slot_ids + i_l).to(tl.int64)
    p_S0 = recurrent_state + i_s * stride_s_s + i_h * stride_s_h
    m_S0 = m_k[:, None] & m_v[None, :] & (i_s >= 0) & (count > 0)
    b_S = tl.load(p_S0 + o_k[:, None] * stride_s_k + o_v[None, :] * stride_s_v, mask=m_S0, other=0.0)
    b_neg_A = -exact_exp(tl.load(A_log + i_h).to(tl.float32))
    b_dt = tl.load(dt_bias + i_h).to(tl.float32)
    b_a = tl.load(a + i_l * stride_a_l + o_w * stride_a_w + i_h * stride_a_h, mask=o_w < W, other=0.0)
    b_b = tl.load(b + i_l * stride_b_l + o_w * stride_b_w + i_h * stride_b_h, mask=o_w < W, other=0.0)
    b_gates = lane_gates(b_a, b_b, b_neg_A, b_dt, GATES_GIVEN)  # [BW, 2]: every row's gamma and beta
    p_log_lane = replay_log + (i_l * W * HV + i_h) * E  # row n of this lane and head: + n * HV * E

    r_q, r_k, r_v = row_loads(
        q, k, v, i_l, i_h, i_hk, i_n, o_k, o_v, m_k, m_v,
        stride_q_l, stride_q_w, stride_q_h, stride_q_d, stride_k_l, stride_k_w, stride_k_h, stride_k_d,
        stride_v_l, stride_v_w, stride_v_h, stride_v_d, W, WIDEN_AT_LOAD)
    for _ in range(0, count):
        if TREES:  # the path's next node (W past its end)
            i_next = tl.min(tl.where((b_on > 0) & (o_w > i_n), o_w, W))
        else:
            i_next = i_n + 1
        n_q, n_k, n_v = row_loads(
            q, k, v, i_l, i_h, i_hk, i_next, o_k, o_v, m_k, m_v,
            stride_q_l, stride_q_w, stride_q_h, stride_q_d, stride_k_l, stride_k_w, stride_k_h, stride_k_d,
            stride_v_l, stride_v_w, stride_v_h, stride_v_d, W, WIDEN_AT_LOAD)
        b_q, b_k, b_v, b_gamma, b_beta, b_rk, b_rq, b_kq = row_prepare(r_q, r_k, r_v, b_gates, o_w, i_n, scale)
        b_S, b_o, b_delta = row_step(b_S, b_q, b_k, b_v, b_gamma, b_beta, b_rk, b_rq, b_kq)

        mine = i_n >= owned_from
        tl.store(o + ((i_l * W + i_n) * HV + i_h) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v & mine)
        p_n = p_log_lane + i_n * HV * E
        if (i_v == 0) & mine:
            tl.store(p_n, b_gamma)
            tl.store(p_n + 1 + o_k, b_k, mask=m_k)
        tl.store(p_n + 1 + K + o_v, b_delta, mask=m_v & mine)
        i_n = i_next
        r_q, r_k, r_v = n_q, n_k, n_v


def verify_tiles(dk: int, dv: int, programs_per_tile: int):
    """(BK, BV, num_warps) of the verify kernel; programs_per_tile = lanes * value heads. The sums over dk
    follow the tile's layout, so the bits depend on this choice: both routes call it with the same
    arguments (README.md). Device time on the H200 at the 9B shape (32 value heads), W 16, both
    BuildOptions, gates once a lane (`bench/tune_verify.py`, 2026-12-05), ms at 1 / 4 / 16 / 64 lanes:
        BV 8, 1 warp   0.009 / 0.023 / 0.079 / 0.290
        BV 16, 1 warp  0.011 / 0.017 / 0.055 / 0.195
        BV 32, 1 warp  0.013 / 0.015 / 0.044 / 0.159
        BV 64, 2 warps 0.017 / 0.019 / 0.057 / 0.210
    (before that: BV 16 x 4 warps 0.023 at one lane, 0.732 at 64). One warp keeps every dk sum inside the
    warp; a BV 32 tile holds 32 of a column's 128 rows in each thread (4 threads a column), so most of a
    sum is a thread's own FMA chain, and it shares each row's loads and norms over more columns. With too
    few programs to fill the SMs (one lane: 32), narrower tiles make more of them."""
    BV = 8 if programs_per_tile < 64 else 16 if programs_per_tile < 128 else 32
    return triton.next_power_of_2(dk), min(BV, triton.next_power_of_2(dv)), 1


def gdn_verify_fwd(q, k, v, a, b, A_log, dt_bias, recurrent_state, state_slot_ids, parents, o, replay_log,
                   chains: bool = False, gates_given: bool = False):
    """Allocate the outputs (unless given) and launch one program per (dv tile, value head, lane), or per
    (dv tile, value head, lane, node) for trees (a program per root-to-leaf path; inner nodes' exit).
    gates_given: a, b are gamma, beta (fp32) rather than the raw projections."""
    L, W, nk, dk = q.shape
    nv, dv = v.shape[2:]
    if o is None:
        o = torch.empty(L, W, nv, dv, dtype=q.dtype, device=q.device)
    if replay_log is None:
        replay_log = torch.empty(L, W, nv, 1 + dk + dv, dtype=torch.float32, device=q.device)
    if L == 0:
        return o, replay_log
    BK, BV, num_warps = verify_tiles(dk, dv, L * nv)
    grid = (triton.cdiv(dv, BV), nv, L if chains else L * W)
    gdn_verify_kernel[grid](
        q, k, v, a, b, A_log, dt_bias, recurrent_state, state_slot_ids, parents, o, replay_log,
        *q.stride(), *k.stride(), *v.stride(), *a.stride(), *b.stride(), *recurrent_state.stride(),
        *parents.stride(),
        dk ** -0.5,
        HK=nk, HV=nv, K=dk, V=dv, W=W, BK=BK, BV=BV, BW=triton.next_power_of_2(W),
        TREES=not chains, GATES_GIVEN=gates_given, WIDEN_AT_LOAD=BUILD.widen_at_load, num_warps=num_warps,
        num_stages=1, enable_fp_fusion=BUILD.fp_fusion,
        enable_reflect_ftz=False,
    )
    return o, replay_log


def check_verify_call(q, k, v, a, b, A_log, dt_bias, recurrent_state, state_slot_ids, parents, out, replay_log_out):
    """gdn_verify's argument checks (shapes, width, devices, given outputs); no host sync."""
    check_verify_shapes(q, k, v, a, b, A_log, dt_bias, recurrent_state, state_slot_ids, parents)
    L, W, nk, dk = q.shape
    nv, dv = v.shape[2:]
    if not 1 <= W <= MAX_WIDTH:
        raise ValueError(f"verify width W={W} must be in [1, {MAX_WIDTH}]")
    tensors = dict(q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias, recurrent_state=recurrent_state,
                   state_slot_ids=state_slot_ids, parents=parents)
    for name, t in tensors.items():
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    for name, t, shape, dtype in (("out", out, (L, W, nv, dv), q.dtype),
                                  ("replay_log_out", replay_log_out, (L, W, nv, 1 + dk + dv), torch.float32)):
        if t is not None and (tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous()
                              or t.device != q.device):
            raise ValueError(f"{name} must be a contiguous {dtype} tensor of shape {shape} on {q.device}")


def gdn_verify(q, k, v, a, b, A_log, dt_bias, recurrent_state, state_slot_ids, parents, *,
               out=None, replay_log_out=None, chains: bool = False):
    """Fused gdn_verify_ref (same arguments, results to fp32 tolerance). q, k: [L, W, nk, dk]; v: [L, W,
    nv, dv]; a, b: [L, W, nv] raw (strided views are fine); A_log, dt_bias: [nv]; recurrent_state
    [S, nv, dk, dv] fp32 (a layer view of the pool, read only); state_slot_ids [L] (-1 padding);
    parents [L, W]. out [L, W, nv, dv] (q's dtype) and replay_log_out [L, W, nv, 1+dk+dv] fp32,
    contiguous, may be given (e.g. one layer of a stacked log). chains: the caller knows every lane's
    parents are n - 1 (then parents are not read, and a leaner kernel runs). Returns (o, replay_log).
    No host sync."""
    check_verify_call(q, k, v, a, b, A_log, dt_bias, recurrent_state, state_slot_ids, parents, out, replay_log_out)
    return gdn_verify_fwd(q, k, v, a, b, A_log.contiguous(), dt_bias.contiguous(), recurrent_state,
                          state_slot_ids.contiguous(), parents, out, replay_log_out, chains)


def gdn_verify_unfused(q, k, v, a, b, A_log, dt_bias, recurrent_state, state_slot_ids, parents, *,
                       out=None, replay_log_out=None, chains: bool = False):
    """The unfused route's verify on a GPU (`DELTAFLASH_NO_FUSED_KERNELS=1`): op by op, the slots' states
    gathered into a copy and the gates computed by torch (naive.gdn_gates_ref), then the recurrence as
    this module's kernel over the copy - the fused kernel's own row arithmetic, so both routes give the
    same bits (README.md, bitwise contract). Arguments and results as gdn_verify."""
    check_verify_call(q, k, v, a, b, A_log, dt_bias, recurrent_state, state_slot_ids, parents, out, replay_log_out)
    copy = gather_slots_ref(recurrent_state, state_slot_ids)
    lanes = torch.arange(len(state_slot_ids), device=q.device)
    copy_ids = torch.where(state_slot_ids >= 0, lanes, -1)
    g, beta = gdn_gates_ref(a, b, A_log, dt_bias)
    return gdn_verify_fwd(q, k, v, g.exp(), beta, A_log, dt_bias, copy, copy_ids, parents, out, replay_log_out,
                          chains, gates_given=True)
