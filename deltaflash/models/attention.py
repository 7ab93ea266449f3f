"""Gated full attention with partial RoPE and GQA over the slot pool's per-slot K/V cache."""

from __future__ import annotations

import torch
from torch import nn

from deltaflash.cache.slots import SlotPool
from deltaflash.config import ModelConfig
from deltaflash.models.layers import MergedProjections, ZeroCenteredRMSNorm, apply_rope, masked_attention
from deltaflash.ops.kernels import Kernels


class GatedAttention(MergedProjections):
    PROJECTIONS = ("q_proj", "k_proj", "v_proj")

    def __init__(self, cfg: ModelConfig, attn_index: int):
        super().__init__()
        self.attn_index = attn_index  # index into the pool's attention layer dim
        self.nh, self.nkv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        H, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = nn.Linear(H, self.nh * self.hd * 2, bias=bias)  # per head [q | gate]
        self.k_proj = nn.Linear(H, self.nkv * self.hd, bias=bias)
        self.v_proj = nn.Linear(H, self.nkv * self.hd, bias=bias)
        self.o_proj = nn.Linear(self.nh * self.hd, H, bias=bias)
        self.q_norm = ZeroCenteredRMSNorm(self.hd, cfg.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(self.hd, cfg.rms_norm_eps)

    def forward(self, x, rope, slot_ids, store_index, visible, pool: SlotPool, write_slots, kernels: Kernels):
        """x [L, T, H]; rope (cos, sin) [L, T, rd]; slot_ids [L] (-1 padding);
        store_index [L, T] cache row where each row's K/V is stored; visible [L, T, Kmax] bool mask
        over cache rows 0..Kmax-1; write_slots [L, T] the slot each row's K/V goes to (the pool's sink
        for rows that must not land anywhere). No host syncs: CUDA-graph safe. Returns [L, T, H]."""
        L, T, _ = x.shape
        a_i = self.attn_index
        q, k, v = self.project(x)
        q, gate = q.unflatten(-1, (self.nh, 2 * self.hd)).chunk(2, dim=-1)
        q = apply_rope(self.q_norm(q, kernels), *rope)
        k = apply_rope(self.k_norm(k.unflatten(-1, (self.nkv, self.hd)), kernels), *rope)
        v = v.unflatten(-1, (self.nkv, self.hd))

        pos = store_index.clamp(max=pool.max_len - 1)
        pool.key_cache[write_slots, a_i, pos] = k.to(pool.key_cache.dtype)
        pool.value_cache[write_slots, a_i, pos] = v.to(pool.value_cache.dtype)

        kmax = visible.shape[-1]
        read = slot_ids.clamp(min=0)
        keys = pool.key_cache[read, a_i, :kmax].transpose(1, 2)  # [L, nkv, Kmax, hd]
        values = pool.value_cache[read, a_i, :kmax].transpose(1, 2)
        out = masked_attention(q.transpose(1, 2), keys.to(q.dtype), values.to(q.dtype), visible[:, None],
                               self.hd ** -0.5)
        out = out.transpose(1, 2).flatten(-2) * torch.sigmoid(gate.flatten(-2))
        return self.o_proj(out)
