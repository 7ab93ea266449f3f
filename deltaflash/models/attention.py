"""Gated full attention with partial RoPE and GQA over paged K/V (cache/pages.py, ops/attention)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from deltaflash.cache.slots import SlotPool
from deltaflash.config import ModelConfig
from deltaflash.models.layers import MergedProjections, ZeroCenteredRMSNorm, rows_at
from deltaflash.ops.kernels import Kernels


@dataclass(frozen=True)
class AttentionRows:
    """What every attention layer of one forward shares (ops/attention/README.md has the contract).

    kv_rows [L, T] long: storage row of each row's K/V (the sink for rows that must land nowhere);
    slot_ids [L] (-1 padding); context_lens [L] long: committed keys before the rows; n_rows [L] long:
    valid rows; mode "causal" | "tree" with tree_mask [L, T, T] bool; max_pages: table entries the
    reference attention reads (a host bound; None: the whole table, a fixed shape for CUDA graphs);
    split: the kernel may cut the key range (flash-decoding, for the few rows of verify and decode; a
    prefill chunk's rows fill the GPU alone and run as one piece); fresh: every lane's rows start at
    position 0 (a first prefill chunk), so they attend to their own K/V alone and the layer runs
    `kernels.prefill_attention` on it, reading no page; dense_keys [1, S] long: the storage rows of
    keys 0..S-1 of a one-lane chunk whose rows are the last of them, gathered into one dense run for
    `kernels.prefill_attention` (a long prompt's later chunks: ops/attention/dense.py); fixed_shape: the
    forward is a CUDA graph's (its shape comes again at every replay); queries [L] long: the one row of
    each lane whose output is read (`at_queries`)."""

    kv_rows: torch.Tensor
    slot_ids: torch.Tensor
    context_lens: torch.Tensor
    n_rows: torch.Tensor
    mode: str = "causal"
    tree_mask: torch.Tensor | None = None
    max_pages: int | None = None
    split: bool = True
    fresh: bool = False
    dense_keys: torch.Tensor | None = None
    fixed_shape: bool = False
    queries: torch.Tensor | None = None

    def at_queries(self, queries: torch.Tensor) -> AttentionRows:
        """These rows for a layer whose output is read at row queries[l] of each lane alone (a prefill chunk's
        last layer: each lane's last row, for its logits): every row's K/V is written, that row's query alone
        attends - over the pages, as a decode row at its position does - and the layer returns [L, 1, H]."""
        return dataclasses.replace(self, queries=queries, context_lens=self.context_lens + queries,
                                   n_rows=self.n_rows.clamp(max=1), split=True, fresh=False, dense_keys=None)


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

    def forward(self, x, rope, rows: AttentionRows, pool: SlotPool, kernels: Kernels):
        """x [L, T, H]; rope (cos, sin) [L, T, rd]. Writes the rows' K/V into their pages, then attends
        over each lane's pages up to its length. No host syncs: CUDA-graph safe. Returns [L, T, H] ([L, 1, H]
        with rows.queries)."""
        a_i = self.attn_index
        q_rope = rope
        if rows.queries is None:
            q, k, v = self.project(x)
        else:  # every row's keys and values, one query a lane: [L, 1, ...]
            k, v = self.project_from(x, 1)
            q = self.q_proj(rows_at(x, rows.queries))
            q_rope = tuple(rows_at(t, rows.queries) for t in rope)
        q, gate = q.unflatten(-1, (self.nh, 2 * self.hd)).chunk(2, dim=-1)
        q = kernels.rope(self.q_norm(q, kernels), *q_rope)
        k = kernels.rope(self.k_norm(k.unflatten(-1, (self.nkv, self.hd)), kernels), *rope)
        v = v.unflatten(-1, (self.nkv, self.hd))
        kernels.write_kv(pool.key_cache[a_i], pool.value_cache[a_i], rows.kv_rows, k, v)
        if rows.fresh or rows.dense_keys is not None:
            if rows.dense_keys is not None:  # this lane's committed keys and its own rows, in position order
                k = pool.key_cache[a_i].flatten(0, 1)[rows.dense_keys]
                v = pool.value_cache[a_i].flatten(0, 1)[rows.dense_keys]
            out = kernels.prefill_attention(q, k, v, self.hd ** -0.5, fixed_shape=rows.fixed_shape)
            return self.o_proj(kernels.sigmoid_gate(out, gate))
        out = kernels.paged_attention(q.contiguous(), pool.key_cache[a_i], pool.value_cache[a_i], pool.tables.tables,
                                      rows.slot_ids, rows.context_lens, rows.n_rows, scale=self.hd ** -0.5,
                                      mode=rows.mode, tree_mask=rows.tree_mask, max_pages=rows.max_pages,
                                      split=rows.split)
        # gate: a strided view of the projection (each head's [q | gate] columns), gated per head in place
        return self.o_proj(kernels.sigmoid_gate(out, gate))
