"""Pure-torch references for the GDN verify route: gates, mapped verify, replay commit.

Shapes: L lanes, W rows per lane (a tree given by `parents`), nk / nv key / value heads, dk / dv head
dims, S slots, G GDN layers. Math and the bitwise contract are in README.md; verify.py and commit.py
are the Triton kernels that must match these functions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deltaflash.errors import CommitRejectedError

L2_EPS = 1e-6


def gdn_gates_ref(a, b, A_log, dt_bias):
    """a, b: [..., nv] raw projections; A_log, dt_bias: [nv]. Returns fp32 (g, beta) [..., nv]:
    g = -exp(A_log) * softplus(a + dt_bias) (log decay <= 0; softplus is x above 20), beta = sigmoid(b)."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, torch.sigmoid(b.float())


def l2_normalize_ref(x):
    """fp32 `x * rsqrt(sum(x^2) + 1e-6)` over the last dim."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def gather_slots_ref(pool_view, state_slot_ids):
    """pool_view [S, ...] read through slot ids [L] (-1: zeros) -> a copy [L, ...] (no host sync)."""
    ids = state_slot_ids.long()
    picked = pool_view[ids.clamp(min=0)]
    keep = (ids >= 0).view(-1, *([1] * (picked.dim() - 1)))
    return torch.where(keep, picked, torch.zeros((), dtype=picked.dtype, device=picked.device))


def gdn_verify_ref(q, k, v, a, b, A_log, dt_bias, recurrent_state, state_slot_ids, parents, chains: bool = False):
    """Verify every lane's rows against its slot's recurrent state, which is only read.

    q, k: [L, W, nk, dk] conv outputs, not normalised; v: [L, W, nv, dv]; a, b: [L, W, nv] raw;
    A_log, dt_bias: [nv]; recurrent_state: [S, nv, dk, dv] fp32 (one layer's view of the pool);
    state_slot_ids: [L] (-1: padding lane, starts from zeros); parents: [L, W] (parents[:, 0] = -1,
    parents[l, n] < n; -1 means "starts from the slot state").
    Returns o [L, W, nv, dv] in q's dtype and replay_log [L, W, nv, 1 + dk + dv] fp32 =
    [gamma, k (fp32, not normalised), d = delta / |k|]: k d^T is the rank-1 update k_n delta^T, and the
    normalisation stays off the dk-sized vectors (|k| = sqrt(sum k^2 + 1e-6), k_n = k / |k|).

    Row n's delta is taken against its parent's state, the decayed form of the recurrence:
    decayed = gamma * S_parent; delta = beta * (v - decayed^T k_n); S_n = decayed + k d^T; o = S_n^T q_n
    (the kernels rearrange this and round differently: they match it to fp32 tolerance, README.md; the
    state update is the commit's, so a committed state is this function's state bit for bit).
    Keeps every node's state ([L, W, nv, dk, dv] fp32), so memory grows with W.
    chains: the caller knows every lane's parents are n - 1 (each row continues from the previous
    row's state without looking parents up; same results).
    """
    L, W, nk, dk = q.shape
    nv, dv = v.shape[-2:]
    check_verify_shapes(q, k, v, a, b, A_log, dt_bias, recurrent_state, state_slot_ids, parents)
    g, beta = gdn_gates_ref(a, b, A_log, dt_bias)  # [L, W, nv]
    gamma = g.exp()
    rep = nv // nk
    q_n = (l2_normalize_ref(q) * dk ** -0.5).repeat_interleave(rep, dim=2)  # [L, W, nv, dk]
    k_f = k.float().repeat_interleave(rep, dim=2)
    r_k = torch.rsqrt((k_f * k_f).sum(-1) + L2_EPS)  # 1 / |k|: [L, W, nv]
    k_n = k_f * r_k[..., None]
    v_f = v.float()

    root = gather_slots_ref(recurrent_state, state_slot_ids).float()  # [L, nv, dk, dv]
    states = torch.zeros(L, W, nv, dk, dv, dtype=torch.float32, device=q.device)
    delta = torch.empty(L, W, nv, dv, dtype=torch.float32, device=q.device)
    lanes = torch.arange(L, device=q.device)
    par = parents.long()
    s = root
    for n in range(W):
        if chains:
            s_parent = s
        else:
            p = par[:, n]
            from_parent = states[lanes, p.clamp(min=0)]
            s_parent = torch.where((p >= 0).view(L, 1, 1, 1), from_parent, root)
        decayed = gamma[:, n, :, None, None] * s_parent
        d = r_k[:, n, :, None] * (beta[:, n, :, None] * (v_f[:, n] - (decayed * k_n[:, n, :, :, None]).sum(-2)))
        s = decayed + k_f[:, n, :, :, None] * d[:, :, None, :]
        states[:, n] = s
        delta[:, n] = d
    o = (states * q_n[..., None]).sum(-2)  # every row's S_n^T q at once
    replay_log = torch.cat([gamma[..., None], k_f, delta], dim=-1)
    return o.to(q.dtype), replay_log


def check_verify_shapes(q, k, v, a, b, A_log, dt_bias, recurrent_state, state_slot_ids, parents):
    """Shape checks only (no data-dependent checks: verify must not sync the host)."""
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"q, k must be [L, W, nk, dk] and equal; got q {tuple(q.shape)}, k {tuple(k.shape)}")
    L, W, nk, dk = q.shape
    if v.dim() != 4 or v.shape[:2] != (L, W):
        raise ValueError(f"v must be [L={L}, W={W}, nv, dv]; got {tuple(v.shape)}")
    nv, dv = v.shape[2:]
    if nv % nk:
        raise ValueError(f"value heads nv={nv} must be a multiple of key heads nk={nk}")
    for name, t in (("a", a), ("b", b)):
        if tuple(t.shape) != (L, W, nv):
            raise ValueError(f"{name} must be [L={L}, W={W}, nv={nv}]; got {tuple(t.shape)}")
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
        if tuple(t.shape) != (nv,):
            raise ValueError(f"{name} must be [nv={nv}]; got {tuple(t.shape)}")
    if recurrent_state.dim() != 4 or tuple(recurrent_state.shape[1:]) != (nv, dk, dv):
        raise ValueError(f"recurrent_state must be [S, nv={nv}, dk={dk}, dv={dv}]; got {tuple(recurrent_state.shape)}")
    if recurrent_state.dtype != torch.float32:
        raise ValueError(f"recurrent_state must be fp32; got {recurrent_state.dtype}")
    if tuple(state_slot_ids.shape) != (L,):
        raise ValueError(f"state_slot_ids must be [L={L}]; got {tuple(state_slot_ids.shape)}")
    if tuple(parents.shape) != (L, W):
        raise ValueError(f"parents must be [L={L}, W={W}]; got {tuple(parents.shape)}")


# ----------------------------------------------------------------------------------------------
# Commit: validation shared by the replay commit and the conv commit (refs and kernels).


def check_commit_lanes(state_slot_ids, accepted_nodes, accepted_len, num_slots: int, width: int, what: str):
    """Validate one commit transaction with a single host sync; raise CommitRejectedError before any
    mutation. state_slot_ids [L] (-1 padding, ignored), accepted_nodes [L, W], accepted_len [L] in 0..W;
    the first accepted_len node ids of a lane lie in [0, W) and increase (a root path: parent < child).
    Returns the host rows [(lane, slot, accepted_len, nodes[:accepted_len]), ...] of lanes with rows
    to commit."""
    for name, t in (("state_slot_ids", state_slot_ids), ("accepted_nodes", accepted_nodes),
                    ("accepted_len", accepted_len)):
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise CommitRejectedError(f"{what}: {name} must be an integer tensor; got {t.dtype}")
    if state_slot_ids.dim() != 1:
        raise CommitRejectedError(f"{what}: state_slot_ids must be [L]; got {tuple(state_slot_ids.shape)}")
    L = state_slot_ids.shape[0]
    if tuple(accepted_nodes.shape) != (L, width):
        raise CommitRejectedError(
            f"{what}: accepted_nodes must be [L={L}, W={width}]; got {tuple(accepted_nodes.shape)}")
    if tuple(accepted_len.shape) != (L,):
        raise CommitRejectedError(f"{what}: accepted_len must be [L={L}]; got {tuple(accepted_len.shape)}")
    table = torch.cat([state_slot_ids.view(L, 1).long(), accepted_len.view(L, 1).long(),
                       accepted_nodes.long()], dim=1).cpu().tolist()  # the one host sync
    lanes, seen = [], {}
    for lane, (slot, n_acc, *nodes) in enumerate(table):
        if slot == -1:
            continue
        if not 0 <= slot < num_slots:
            raise CommitRejectedError(f"{what}: state_slot_ids[{lane}] = {slot} is outside [0, {num_slots}) and not -1")
        if slot in seen:
            raise CommitRejectedError(f"{what}: slot {slot} appears in lanes {seen[slot]} and {lane}")
        seen[slot] = lane
        if not 0 <= n_acc <= width:
            raise CommitRejectedError(f"{what}: accepted_len[{lane}] = {n_acc} is outside [0, W={width}]")
        path = nodes[:n_acc]
        if any(not 0 <= x < width for x in path) or any(x >= y for x, y in zip(path, path[1:])):
            raise CommitRejectedError(
                f"{what}: accepted_nodes[{lane}, :{n_acc}] = {path} must be increasing node ids in [0, {width})")
        if n_acc:
            lanes.append((lane, slot, n_acc, path))
    return lanes


def check_replay_commit_shapes(recurrent_state, replay_log, state_slot_ids):
    """recurrent_state [S, G, nv, dk, dv] fp32; replay_log [G, L, W, nv, 1+dk+dv] fp32. Returns W."""
    if recurrent_state.dim() != 5 or recurrent_state.dtype != torch.float32:
        raise CommitRejectedError(
            f"replay commit: recurrent_state must be [S, G, nv, dk, dv] fp32; got "
            f"{tuple(recurrent_state.shape)} {recurrent_state.dtype}")
    _, G, nv, dk, dv = recurrent_state.shape
    L = state_slot_ids.shape[0] if state_slot_ids.dim() == 1 else -1
    if (replay_log.dim() != 5 or replay_log.dtype != torch.float32
            or (replay_log.shape[0], replay_log.shape[1], replay_log.shape[3], replay_log.shape[4])
            != (G, L, nv, 1 + dk + dv)):
        raise CommitRejectedError(
            f"replay commit: replay_log must be [G={G}, L={L}, W, nv={nv}, 1+dk+dv={1 + dk + dv}] fp32; "
            f"got {tuple(replay_log.shape)} {replay_log.dtype}")
    if replay_log.device != recurrent_state.device:
        raise CommitRejectedError(
            f"replay commit: replay_log on {replay_log.device}, recurrent_state on {recurrent_state.device}")
    return replay_log.shape[2]


def replay_commit_ref(recurrent_state, replay_log, state_slot_ids, accepted_nodes, accepted_len):
    """Commit each lane's accepted path into its slot's state, in place, all GDN layers at once.

    recurrent_state: the whole pool [S, G, nv, dk, dv] fp32; replay_log [G, L, W, nv, 1+dk+dv] fp32
    (gdn_verify's logs stacked over layers); accepted_nodes [L, W]; accepted_len [L] in 0..W.
    For t < accepted_len: S = gamma_t * S + k_t delta_t^T, the verify recurrence's update (the kernels'
    commit is bit-identical to their verify's state; this reference, to tolerance). Validates first
    (CommitRejectedError, nothing changed).
    """
    W = check_replay_commit_shapes(recurrent_state, replay_log, state_slot_ids)
    lanes = check_commit_lanes(state_slot_ids, accepted_nodes, accepted_len, recurrent_state.shape[0], W,
                               "replay commit")
    replay_lanes_ref(recurrent_state, replay_log, lanes)


def replay_lanes_ref(recurrent_state, replay_log, lanes):
    """replay_commit_ref's update for a validated transaction: lanes [(lane, slot, accepted_len, path)]
    host values (no host sync)."""
    dk = recurrent_state.shape[3]
    for lane, slot, n_acc, path in lanes:
        s = recurrent_state[slot]  # [G, nv, dk, dv]
        for node in path:
            entry = replay_log[:, lane, node]  # [G, nv, 1+dk+dv]
            gamma, k_t, delta = entry[..., 0], entry[..., 1:1 + dk], entry[..., 1 + dk:]
            s = gamma[..., None, None] * s + k_t[..., :, None] * delta[..., None, :]
        recurrent_state[slot] = s
