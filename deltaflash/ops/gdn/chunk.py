"""Chunked gated delta rule for prefill: the torch reference, and fla-core's kernel on CUDA.

Math (per value head, one chunk of C rows, S0 the state entering the chunk, G_t the cumulative log
decay inside the chunk, Gam_t = exp(G_t)):
    delta = T (beta * V) - T (beta * Gam * K) S0,   T = (I + A)^-1,
    A[t, s] = beta_t exp(G_t - G_s) <k_t, k_s>      for s < t (strictly lower),
    o_t     = Gam_t S0^T q_t + sum_{s<=t} exp(G_t - G_s) <q_t, k_s> delta_s,
    S_C     = Gam_C S0 + sum_s exp(G_C - G_s) k_s delta_s^T.
This is the same recurrence as the per-token step (see README.md), regrouped into matmuls.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deltaflash.ops.gdn import fla_launch
from deltaflash.ops.gdn.prefill_gates import prefill_gates

CHUNK = 64


def chunk_gated_delta_rule_ref(q, k, v, g, beta, initial_state, chunk: int = CHUNK):
    """One sequence. q, k: [T, H, dk] (normalised, q scaled); v: [T, H, dv]; g, beta: [T, H] fp32;
    initial_state: [H, dk, dv] fp32. Returns (o [T, H, dv] fp32, final_state [H, dk, dv] fp32)."""
    T = q.shape[0]
    q, k, v = (x.float().transpose(0, 1) for x in (q, k, v))  # [H, T, d]
    g, beta = g.float().transpose(0, 1), beta.float().transpose(0, 1)  # [H, T]
    state = initial_state.float().clone()
    out = torch.empty_like(v)
    for t0 in range(0, T, chunk):
        sl = slice(t0, min(t0 + chunk, T))
        qc, kc, vc, bc = q[:, sl], k[:, sl], v[:, sl], beta[:, sl]
        cum = g[:, sl].cumsum(-1)  # [H, C]
        n = cum.shape[-1]
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        decay = (cum[:, :, None] - cum[:, None, :]).masked_fill(~causal, float("-inf")).exp()  # [H, C, C]
        strict = decay.masked_fill(torch.eye(n, dtype=torch.bool, device=q.device), 0.0)
        a = bc[:, :, None] * strict * (kc @ kc.transpose(-1, -2))
        eye = torch.eye(n, device=q.device).expand_as(a)
        tri = eye + a
        u = torch.linalg.solve_triangular(tri, bc[..., None] * vc, upper=False, unitriangular=True)
        w = torch.linalg.solve_triangular(tri, (bc * cum.exp())[..., None] * kc, upper=False, unitriangular=True)
        delta = u - w @ state  # [H, C, dv]
        out[:, sl] = cum.exp()[..., None] * (qc @ state) + (decay * (qc @ kc.transpose(-1, -2))) @ delta
        tail = (cum[:, -1:] - cum).exp()  # [H, C]
        state = cum[:, -1].exp()[:, None, None] * state + (kc * tail[..., None]).transpose(-1, -2) @ delta
    return out.transpose(0, 1), state


def chunk_gated_delta_rule_varlen(q, k, v, a, b, A_log, dt_bias, initial_states, seq_lens: list[int], cu_seqlens=None,
                                  cu_seqlens_host=None):
    """Several sequences packed along rows. q, k: [N, Hk, dk] L2-normalised, Hk key heads dividing the H
    value heads, value head h reading key head h // (H / Hk) (ops/conv/extend.conv_extend_heads: q is
    scaled by dk^-0.5 here); v: [N, H, dv] (activation dtype);
    a, b: [N, H] the raw gate inputs (`gdn_gates`; any strides); A_log, dt_bias [H]; initial_states
    [B, H, dk, dv] fp32; seq_lens: host list of B row counts summing to N. cu_seqlens (device) /
    cu_seqlens_host (CPU) [B+1]: their offsets, if the caller has them; passing the same tensors to
    every layer lets fla-core reuse its chunk index tables instead of copying new ones to the device
    per call. Returns (o [N, H, dv] in v's dtype, final_states [B, H, dk, dv] fp32). Uses fla-core on
    CUDA, which also computes the gates (and their chunk sums) in its kernels and reads each key head for
    its value heads (GVA) where the reference repeats it."""
    if q.is_cuda:
        if cu_seqlens_host is None:
            cu_seqlens_host = torch.tensor([0] + list(seq_lens)).cumsum(0)
        if cu_seqlens is None:
            cu_seqlens = cu_seqlens_host.to(q.device)
        o, final = _fla(q[None], k[None], v[None], a[None], b[None], A_log, dt_bias, initial_states, max(seq_lens),
                        cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_host)
        return o[0], final
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    q, k = (value_heads(x, v.shape[-2]) for x in (q, k))
    q = q.float() * q.shape[-1] ** -0.5
    outs, finals, row = [], [], 0
    for i, n in enumerate(seq_lens):
        o, s = chunk_gated_delta_rule_ref(q[row:row + n], k[row:row + n], v[row:row + n],
                                          g[row:row + n], beta[row:row + n], initial_states[i])
        outs.append(o)
        finals.append(s)
        row += n
    return torch.cat(outs).to(v.dtype), torch.stack(finals)


def chunk_gated_delta_rule_padded(q, k, v, a, b, A_log, dt_bias, initial_states, rows_valid):
    """Lanes of equal padded length, for fixed shapes (CUDA graphs). q, k: [L, T, Hk, dk] as for
    `chunk_gated_delta_rule_varlen`; v: [L, T, H, dv]; a, b: [L, T, H] raw gate inputs; initial_states
    [L, H, dk, dv] fp32 (None: zeros); rows_valid [L, T] bool (device): each lane's valid rows, first in the lane
    (ExtendBatch.rows_valid). A padding row gets
    a = b = -inf, so g = 0 and beta = 0: it writes nothing (its delta is beta times something, so zero)
    and decays nothing, and it comes after every valid row, so each lane's valid outputs and final
    state are those of its valid rows alone (the chunks start at row 0 as in the packed layout).
    Returns (o [L, T, H, dv] in v's dtype, garbage at padding rows; final_states [L, H, dk, dv] fp32)."""
    if q.is_cuda:
        return _fla(q, k, v, a, b, A_log, dt_bias, initial_states, q.shape[1], rows_valid)
    a, b = (torch.where(rows_valid[..., None], x, float("-inf")) for x in (a, b))
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    q, k = (value_heads(x, v.shape[-2]) for x in (q, k))
    q = q.float() * q.shape[-1] ** -0.5
    if initial_states is None:
        initial_states = q.new_zeros(q.shape[0], v.shape[-2], q.shape[-1], v.shape[-1])
    outs = [chunk_gated_delta_rule_ref(q[i], k[i], v[i], g[i], beta[i], initial_states[i]) for i in range(q.shape[0])]
    return torch.stack([o for o, _ in outs]).to(v.dtype), torch.stack([s for _, s in outs])


def _fla(q, k, v, a, b, A_log, dt_bias, initial_states, rows: int, rows_valid=None, **varlen):
    """fla-core's chunked rule on [B, T, H, d] rows, its gate (-exp(A_log) softplus(a + dt_bias), summed
    per chunk) computed in its kernels, beta = sigmoid(b) in ours with a made contiguous (rows_valid [B, T]:
    the rows of a fixed-shape batch, the others made inert; prefill_gates.py); launched with the engine's
    launch table's configs for `rows` (the longest sequence's rows), if it has one (fla_launch.py)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    fla_launch.select(rows)
    a, beta = prefill_gates(a, b, rows_valid)
    o, final = chunk_gated_delta_rule(
        q, k, v, a, beta, scale=q.shape[-1] ** -0.5,
        initial_state=None if initial_states is None else initial_states.contiguous(), output_final_state=True,
        use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=False, **varlen,
    )
    return o, final.float()


def value_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """x [..., Hk, d] per key head -> [..., heads, d] per value head (value head h reads key head
    h // (heads / Hk)): what fla-core's kernels index, for the torch routes."""
    rep = heads // x.shape[-2]
    return x.repeat_interleave(rep, dim=-2) if rep > 1 else x


def recurrent_gated_delta_step_ref(q, k, v, g, beta, state):
    """One row per lane, state updated in place. q, k: [L, H, dk] fp32 (normalised, q scaled);
    v: [L, H, dv] fp32; g, beta: [L, H] fp32; state: [L, H, dk, dv] fp32. Returns o [L, H, dv] fp32."""
    gamma = g.exp()[..., None, None]
    decayed = gamma * state
    delta = beta[..., None] * (v - (decayed * k[..., None]).sum(-2))
    state.copy_(decayed + k[..., None] * delta[..., None, :])
    return (state * q[..., None]).sum(-2)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """fp32 `x * rsqrt(sum(x^2) + eps)` over the last dim."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gdn_gates(a, b, A_log, dt_bias):
    """g = -exp(A_log) * softplus(a + dt_bias) (log decay <= 0), beta = sigmoid(b); fp32 [..., nv]."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, b.float().sigmoid()
