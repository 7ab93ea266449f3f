"""Commit of a verify round: replay the accepted rows of each lane into its slot's recurrent state and
roll its conv history forward, all lanes and all GDN layers: `replay_commit`, `conv_commit`, or both in
one launch (`state_commit`: what the engine runs; a round's commit was two launches of host time).

References: naive.replay_commit_ref, conv.naive.conv_commit_ref. Math and the bitwise contract: README.md.
"""

from __future__ import annotations

import triton
import triton.language as tl

from deltaflash.errors import CommitRejectedError
from deltaflash.ops.conv.naive import check_conv_commit_shapes
from deltaflash.ops.gdn.naive import check_commit_lanes, check_replay_commit_shapes
from deltaflash.ops.gdn.verify import decay_update


@triton.jit
def _replay_program(
    i_gl, i_h, i_v,
    recurrent_state, replay_log, state_slot_ids, accepted_nodes, accepted_len,
    stride_s_s, stride_s_g, stride_s_h, stride_s_k, stride_s_v,
    stride_r_g, stride_r_l, stride_r_w, stride_r_h,
    stride_n_l, stride_n_w,
    L,
    W: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):
    """(layer, lane) i_gl, value head i_h, dv tile i_v: S = gamma S + k delta^T for the lane's accepted
    rows in token order, with the verify kernel's own update (verify.decay_update)."""
    i_g, i_l = (i_gl // L).to(tl.int64), (i_gl % L).to(tl.int64)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V

    i_s = tl.load(state_slot_ids + i_l).to(tl.int64)
    n_acc = tl.load(accepted_len + i_l).to(tl.int32)
    if (i_s >= 0) & (n_acc > 0):
        p_S = (recurrent_state + i_s * stride_s_s + i_g * stride_s_g + i_h * stride_s_h
               + o_k[:, None].to(tl.int64) * stride_s_k + o_v[None, :].to(tl.int64) * stride_s_v)
        m_S = m_k[:, None] & m_v[None, :]
        b_S = tl.load(p_S, mask=m_S, other=0.0)
        for t in range(0, W):
            if t < n_acc:
                i_n = tl.load(accepted_nodes + i_l * stride_n_l + t * stride_n_w).to(tl.int64)
                p_log = replay_log + i_g * stride_r_g + i_l * stride_r_l + i_n * stride_r_w + i_h * stride_r_h
                b_gamma = tl.load(p_log)
                b_k = tl.load(p_log + 1 + o_k, mask=m_k, other=0.0)
                b_delta = tl.load(p_log + 1 + K + o_v, mask=m_v, other=0.0)
                b_S = decay_update(b_S, b_gamma, b_k, b_delta)
        tl.store(p_S, b_S, mask=m_S)


@triton.jit
def _conv_program(
    i_gl, i_c,
    conv_history, windows, state_slot_ids, accepted_nodes, accepted_len,
    stride_h_s, stride_h_g, stride_h_c, stride_h_t,
    stride_x_g, stride_x_l, stride_x_c, stride_x_t,
    stride_n_l, stride_n_w,
    L, C,
    K: tl.constexpr, BC: tl.constexpr,
):
    """(layer, lane) i_gl, channel tile i_c: history column i := element accepted_len + i of the sequence
    (history (K-1) | accepted path rows), read from the window."""
    i_g, i_l = (i_gl // L).to(tl.int64), (i_gl % L).to(tl.int64)
    o_c = i_c * BC + tl.arange(0, BC)
    i_s = tl.load(state_slot_ids + i_l).to(tl.int64)
    n_acc = tl.load(accepted_len + i_l).to(tl.int32)
    m_c = (o_c < C) & (i_s >= 0) & (n_acc > 0)
    p_win = windows + i_g * stride_x_g + i_l * stride_x_l + o_c.to(tl.int64) * stride_x_c
    p_hist = conv_history + i_s * stride_h_s + i_g * stride_h_g + o_c.to(tl.int64) * stride_h_c
    for i in tl.static_range(K - 1):
        i_pos = n_acc + i
        i_node = tl.load(accepted_nodes + i_l * stride_n_l + tl.maximum(i_pos - (K - 1), 0) * stride_n_w,
                         mask=(i_pos >= K - 1) & (n_acc > 0), other=0)
        i_col = tl.where(i_pos < K - 1, i_pos, K - 1 + i_node)
        b_x = tl.load(p_win + i_col * stride_x_t, mask=m_c, other=0.0)
        tl.store(p_hist + i * stride_h_t, b_x.to(conv_history.dtype.element_ty), mask=m_c)


# Any number of lanes, one binary (no compile mid-serving): L and the strides that scale with it (the log's and
# the window's per-layer stride is L times a row) are not specialised by value.
@triton.jit(do_not_specialize=["L", "stride_r_g", "stride_x_g", "REPLAY_PROGRAMS"])
def state_commit_kernel(
    recurrent_state, replay_log, conv_history, windows, state_slot_ids, accepted_nodes, accepted_len,
    stride_s_s, stride_s_g, stride_s_h, stride_s_k, stride_s_v,
    stride_r_g, stride_r_l, stride_r_w, stride_r_h,
    stride_h_s, stride_h_g, stride_h_c, stride_h_t,
    stride_x_g, stride_x_l, stride_x_c, stride_x_t,
    stride_n_l, stride_n_w,
    L, C, REPLAY_PROGRAMS,
    W: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr,
    V_TILES: tl.constexpr, KC: tl.constexpr, BC: tl.constexpr, C_TILES: tl.constexpr,
):
    """Programs 0..REPLAY_PROGRAMS-1 replay (layer x lane, value head, dv tile), flattened; the rest roll
    the conv history (layer x lane, channel tile). A launch may hold either kind alone."""
    pid = tl.program_id(0)
    if pid < REPLAY_PROGRAMS:
        _replay_program(pid // (NV * V_TILES), (pid // V_TILES) % NV, pid % V_TILES,
                        recurrent_state, replay_log, state_slot_ids, accepted_nodes, accepted_len,
                        stride_s_s, stride_s_g, stride_s_h, stride_s_k, stride_s_v,
                        stride_r_g, stride_r_l, stride_r_w, stride_r_h, stride_n_l, stride_n_w, L, W, K, V, BK, BV)
    else:
        pid = pid - REPLAY_PROGRAMS
        _conv_program(pid // C_TILES, pid % C_TILES,
                      conv_history, windows, state_slot_ids, accepted_nodes, accepted_len,
                      stride_h_s, stride_h_g, stride_h_c, stride_h_t, stride_x_g, stride_x_l, stride_x_c, stride_x_t,
                      stride_n_l, stride_n_w, L, C, KC, BC)


def state_commit_fwd(recurrent_state, replay_log, conv_history, windows, state_slot_ids, accepted_nodes,
                     accepted_len):
    """One launch: the replay (recurrent_state, replay_log; None, None: none) and the conv history roll
    (conv_history, windows; None, None: none) of every (layer, lane). An absent part launches no program:
    its pointers and strides stand in from the other part, its tile sizes are placeholders."""
    L = state_slot_ids.shape[0]
    replay, conv = recurrent_state is not None, conv_history is not None
    G = (recurrent_state if replay else conv_history).shape[1]
    if G * L == 0:
        return
    if replay:
        _, _, nv, dk, dv = recurrent_state.shape
        W = replay_log.shape[2]
        BK, BV = triton.next_power_of_2(dk), min(triton.next_power_of_2(dv), 32)
        v_tiles = triton.cdiv(dv, BV)
        replay_args = (*recurrent_state.stride(), *replay_log.stride()[:4])
    else:
        nv, dk, dv, BK, BV, v_tiles = 1, 16, 16, 16, 16, 1
        replay_args = (0,) * 9
    if conv:
        C, Km1 = conv_history.shape[2:]
        W = windows.shape[-1] - Km1
        BC = min(triton.next_power_of_2(C), 256)
        c_tiles = triton.cdiv(C, BC)
        conv_args = (*conv_history.stride(), *windows.stride())
    else:
        C, Km1, BC, c_tiles = 0, 1, 16, 1
        conv_args = (0,) * 8
    replay_programs = G * L * nv * v_tiles if replay else 0
    programs = replay_programs + (G * L * c_tiles if conv else 0)
    state_commit_kernel[(programs,)](
        recurrent_state if replay else conv_history, replay_log if replay else windows,
        conv_history if conv else recurrent_state, windows if conv else replay_log,
        state_slot_ids, accepted_nodes, accepted_len,
        *replay_args, *conv_args, *accepted_nodes.stride(),
        L, C, replay_programs,
        W=W, K=dk, V=dv, BK=BK, BV=BV, NV=nv, V_TILES=v_tiles, KC=Km1 + 1, BC=BC, C_TILES=c_tiles,
        num_warps=4, num_stages=1, enable_fp_fusion=False, enable_reflect_ftz=False,
    )


def _check_plan_device(pool, state_slot_ids, accepted_nodes, accepted_len, what):
    for name, t in (("state_slot_ids", state_slot_ids), ("accepted_nodes", accepted_nodes),
                    ("accepted_len", accepted_len)):
        if t.device != pool.device:
            raise CommitRejectedError(f"{what}: {name} is on {t.device}, the pool on {pool.device}")


def state_commit(recurrent_state, replay_log, conv_history, windows, state_slot_ids, accepted_nodes, accepted_len, *,
                 validate=True):
    """The fused commit, in place, in one launch: replay_commit_ref on (recurrent_state, replay_log) and
    conv_commit_ref on (conv_history, windows) - either pair may be None. recurrent_state: the whole pool
    [S, G, nv, dk, dv] fp32; replay_log [G, L, W, nv, 1+dk+dv] fp32 (last dim contiguous); conv_history
    [S, G, C, K-1]; windows [G, L, C, K-1+W]; accepted_nodes [L, W]; accepted_len [L] in 0..W. Validates
    the whole transaction first (one host sync) and raises CommitRejectedError with nothing changed;
    validate=False skips the data checks when the caller already ran check_commit_lanes for it."""
    widths, pools = [], []
    if recurrent_state is not None:
        widths.append(check_replay_commit_shapes(recurrent_state, replay_log, state_slot_ids))
        if replay_log.stride(-1) != 1:
            raise CommitRejectedError("replay commit: replay_log must be contiguous in its last dim")
        _check_plan_device(recurrent_state, state_slot_ids, accepted_nodes, accepted_len, "replay commit")
        pools.append(recurrent_state)
    if conv_history is not None:
        widths.append(check_conv_commit_shapes(conv_history, windows, state_slot_ids))
        _check_plan_device(conv_history, state_slot_ids, accepted_nodes, accepted_len, "conv commit")
        pools.append(conv_history)
    if len(set(widths)) > 1 or len({pool.shape[:2] for pool in pools}) > 1:
        raise CommitRejectedError(f"state commit: the replay log and the conv windows disagree (rows per lane "
                                  f"{widths}; slots x GDN layers {[tuple(pool.shape[:2]) for pool in pools]})")
    if validate:
        check_commit_lanes(state_slot_ids, accepted_nodes, accepted_len, pools[0].shape[0], widths[0], "commit")
    state_commit_fwd(recurrent_state, replay_log, conv_history, windows, state_slot_ids.contiguous(), accepted_nodes,
                     accepted_len.contiguous())


def replay_commit(recurrent_state, replay_log, state_slot_ids, accepted_nodes, accepted_len, *, validate=True):
    """state_commit of the recurrent state alone (replay_commit_ref's arguments)."""
    state_commit(recurrent_state, replay_log, None, None, state_slot_ids, accepted_nodes, accepted_len,
                 validate=validate)


def conv_commit(conv_history, windows, state_slot_ids, accepted_nodes, accepted_len, *, validate=True):
    """state_commit of the conv history alone (conv_commit_ref's arguments)."""
    state_commit(None, None, conv_history, windows, state_slot_ids, accepted_nodes, accepted_len, validate=validate)
