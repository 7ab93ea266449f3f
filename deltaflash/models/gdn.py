"""Gated DeltaNet mixer: extend (prefill / decode, writes state) and verify (read-only, replay log)."""

from __future__ import annotations

import torch
from torch import nn

from deltaflash.cache.slots import SlotPool
from deltaflash.config import ModelConfig
from deltaflash.core.batch import ExtendBatch, VerifyBatch
from deltaflash.models.layers import GatedRMSNorm, MergedProjections
from deltaflash.ops.kernels import Kernels
from deltaflash.ops.gdn.chunk import (
    chunk_gated_delta_rule_padded,
    chunk_gated_delta_rule_varlen,
    gdn_gates,
    recurrent_gated_delta_step_ref,
    value_heads,
)


class GatedDeltaNet(MergedProjections):
    PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")

    def __init__(self, cfg: ModelConfig, gdn_index: int):
        super().__init__()
        self.gdn_index = gdn_index  # index into the pool's GDN layer dim
        self.nk, self.nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        C, H = cfg.conv_channels, cfg.hidden_size
        self.in_proj_qkv = nn.Linear(H, C, bias=False)
        self.in_proj_z = nn.Linear(H, self.nv * self.dv, bias=False)
        self.in_proj_b = nn.Linear(H, self.nv, bias=False)
        self.in_proj_a = nn.Linear(H, self.nv, bias=False)
        self.conv1d = nn.Conv1d(C, C, cfg.conv_kernel, groups=C, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.nv))
        self.A_log = nn.Parameter(torch.zeros(self.nv))
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(self.nv * self.dv, H, bias=False)

    @property
    def conv_weight(self) -> torch.Tensor:
        return self.conv1d.weight[:, 0, :]  # [C, K]

    def _split_qkv(self, x: torch.Tensor):
        """x [..., C] -> q, k [..., nk, dk], v [..., nv, dv] (views)."""
        kd = self.nk * self.dk
        q, k, v = x.split([kd, kd, self.nv * self.dv], dim=-1)
        return (q.unflatten(-1, (self.nk, self.dk)), k.unflatten(-1, (self.nk, self.dk)),
                v.unflatten(-1, (self.nv, self.dv)))

    def _output(self, o: torch.Tensor, z: torch.Tensor, kernels: Kernels) -> torch.Tensor:
        """o [..., nv, dv], z [..., nv*dv] -> out_proj(gated norm)."""
        o = self.norm(o.to(z.dtype), z.unflatten(-1, (self.nv, self.dv)), kernels)
        return self.out_proj(o.flatten(-2))

    def _conv(self, qkv, batch: ExtendBatch, pool: SlotPool, kernels: Kernels):
        """The short conv of the rows into the chunked rule's inputs (q, k normalised per key head, v per
        value head), each lane's conv history read from and its new one written to its slot (a lane without
        one: zeros, nothing written); ops/conv/extend.py."""
        return kernels.conv_extend_heads(qkv, pool.conv_history[:, self.gdn_index], batch.slot_ids, self.conv_weight,
                                         batch.n_rows, self.nk, self.nv, self.dk)

    def extend(self, x: torch.Tensor, batch: ExtendBatch, pool: SlotPool, kernels: Kernels) -> torch.Tensor:
        """x [L, T, H] normed hidden. Reads and writes the lanes' conv history and recurrent state."""
        L, T, _ = x.shape
        if batch.state_slots is not None:
            return self._extend_padded(x, batch, pool, kernels)
        g_i = self.gdn_index
        qkv, z, b, a = self.project(x)  # column views of one GEMM output
        full = batch.full_host  # every lane live with T rows: no gathers, no scatters
        lane_idx = batch.live_lanes
        slot_idx = batch.slot_ids[lane_idx]
        q, k, v = self._conv(qkv, batch, pool, kernels)

        state = pool.recurrent_state[slot_idx, g_i]  # gathered copy [L', nv, dk, dv]
        if T == 1:
            g, beta = gdn_gates(a[lane_idx, 0], b[lane_idx, 0], self.A_log, self.dt_bias)
            q1, k1 = (value_heads(t[lane_idx, 0], self.nv).float() for t in (q, k))  # q, k per key head
            o_live = recurrent_gated_delta_step_ref(q1 * self.dk ** -0.5, k1, v[lane_idx, 0].float(), g, beta,
                                                    state).to(v.dtype)[:, None]
        else:
            lens = [batch.n_rows_host[i] for i in batch.live_lanes_host]
            pack = (lambda t: t.flatten(0, 1)) if full else (lambda t: t.flatten(0, 1)[batch.packed_rows])  # noqa: E731
            o_live, state = chunk_gated_delta_rule_varlen(pack(q), pack(k), pack(v), pack(a), pack(b), self.A_log,
                                                          self.dt_bias, state, lens, batch.cu_seqlens,
                                                          batch.cu_seqlens_host)
        pool.recurrent_state[slot_idx, g_i] = state
        if full:
            o = o_live.view(L, T, self.nv, self.dv)
        else:  # what the gated norm takes: zeros at padding rows
            o = torch.zeros(L, T, self.nv, self.dv, dtype=v.dtype, device=x.device)
            if T == 1:
                o[lane_idx] = o_live
            else:
                o.flatten(0, 1)[batch.packed_rows] = o_live
        return self._output(o, z, kernels)

    def _extend_padded(self, x: torch.Tensor, batch: ExtendBatch, pool: SlotPool, kernels: Kernels) -> torch.Tensor:
        """extend of a fixed-shape batch (ExtendBatch.padded): every lane's T rows through the padded
        chunked rule, from its state slot's state (first chunks: from zeros, nothing read), its final state
        written there unconditionally (a padding lane's slot is the pool's state sink, which stays zero: its
        rows change nothing)."""
        g_i, slots = self.gdn_index, batch.state_slots
        qkv, z, b, a = self.project(x)
        q, k, v = self._conv(qkv, batch, pool, kernels)  # a padding lane (slot -1) writes no history
        state = None if batch.starts_sequences else pool.state_rows[slots, g_i]
        o, final = chunk_gated_delta_rule_padded(q, k, v, a, b, self.A_log, self.dt_bias, state, batch.rows_valid)
        pool.state_rows[slots, g_i] = final
        return self._output(o, z, kernels)

    def verify(self, x: torch.Tensor, batch: VerifyBatch, pool: SlotPool, kernels: Kernels, window: torch.Tensor,
               replay_log: torch.Tensor) -> torch.Tensor:
        """x [L, W, H] -> out [L, W, H]. Persistent state is read only; this layer's conv window
        [L, C, K-1+W] (x's dtype) and replay log [L, W, nv, 1+dk+dv] (fp32) are written into the
        given contiguous tensors (one layer of the round's stacked outputs)."""
        g_i = self.gdn_index
        qkv, z, b, a = self.project(x)  # column views of one GEMM output
        conv_out, _ = kernels.conv_tree_step(
            qkv, pool.conv_history[:, g_i], batch.slot_ids, batch.parents, self.conv_weight, window_out=window)
        q, k, v = self._split_qkv(conv_out)
        o, _ = kernels.gdn_verify(q, k, v, a, b, self.A_log, self.dt_bias, pool.recurrent_state[:, g_i],
                                     batch.slot_ids, batch.parents, replay_log_out=replay_log, chains=batch.chain_host)
        return self._output(o, z, kernels)
