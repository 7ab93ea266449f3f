"""The Qwen3.5 target model (dense and MoE) over the slot pool.

Two forwards share the layers:
- `extend`: prefill chunks and plain decode rows; GDN and attention state are written.
- `verify`: W rows per lane forming a tree; persistent GDN state is only read, and the forward
  returns the conv windows and replay log that a later commit uses (DESIGN.md §2-3).
"""

from __future__ import annotations

import torch
from torch import nn

from deltaflash.cache.slots import SlotPool
from deltaflash.config import ModelConfig
from deltaflash.core.batch import ExtendBatch, VerifyBatch, VerifyOutput
from deltaflash.models.attention import AttentionRows, GatedAttention
from deltaflash.models.gdn import GatedDeltaNet
from deltaflash.models.layers import (MergedProjections, SparseMoE, SwiGLU, ZeroCenteredRMSNorm, rope_cos_sin,
                                      rows_at)
from deltaflash.models.vocab import Vocab
from deltaflash.ops.attention import dense as dense_attention
from deltaflash.ops.kernels import Kernels


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.is_gdn = cfg.layer_types[layer_id] == "linear_attention"
        if self.is_gdn:
            self.linear_attn = GatedDeltaNet(cfg, cfg.gdn_layer_ids.index(layer_id))
        else:
            self.self_attn = GatedAttention(cfg, cfg.attn_layer_ids.index(layer_id))
        self.is_moe = cfg.is_moe
        if cfg.is_moe:
            self.mlp = SparseMoE(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok,
                                 cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size)
        else:
            self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen35Model(nn.Module):
    """Parameter names are those of the checkpoint's text stack without its `model.` prefix."""

    linear = staticmethod(torch.nn.functional.linear)  # the lm_head's product (models/layers.py)
    # what adds a layer output's shares over the ranks under tensor parallelism (parallel/tensor.py);
    # one rank: the output is whole already
    reduce = staticmethod(lambda t: t)
    # vocab-parallel ranks: the share's first row, and what concatenates the shares' logits (models/vocab.py)
    vocab_start = 0
    gather = staticmethod(lambda t: t)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_rows, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_rows, bias=False)

    def merge_projections(self) -> Qwen35Model:
        """Each layer's input projections as one GEMM (layers.MergedProjections); once, after loading."""
        for module in self.modules():
            if isinstance(module, MergedProjections):
                module.merge_projections()
        return self

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.cfg.tie_word_embeddings else self.lm_head.weight

    @property
    def vocab(self) -> Vocab:
        """The embedding and lm_head (this rank's share of them under tensor parallelism)."""
        return Vocab(self.embed_tokens.weight, self.lm_head_weight, self.cfg.vocab_size, self.vocab_start,
                     self.reduce, self.gather)

    def logits(self, hidden: torch.Tensor, kernels: Kernels, gather: bool = True) -> torch.Tensor:
        """Final norm + lm_head on [..., H] -> fp32 [..., V] (gather False, tensor parallel: this rank's
        share of the vocabulary, models/vocab.py)."""
        return self.vocab.project(self.norm(hidden, kernels), self.linear, gather).float()

    def _run_layers(self, x, attend, gdn, tap_layer_ids, kernels: Kernels, last_rows=None):
        """Each residual add is done by the norm that follows it (kernels.add_rms_norm: one pass), but
        for a tapped layer's and the last layer's MLP output, added on its own. last_rows [L] (x [L, T, H];
        the caller's promise: the last layer untapped): only those rows of each lane go on past the last
        layer's mixer - its norm and MLP act on each row alone, and the other rows' outputs are never read -
        and the result is [L, H]; an attention layer there computes those rows' queries alone
        (`attend(attn, h, last_rows)`)."""
        taps, pending = [], None  # pending: the previous MLP output, not yet added to x
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            if pending is None:
                h = layer.input_layernorm(x, kernels)
            else:
                x, h = layer.input_layernorm.add_and_norm(x, pending, kernels)
            if i == last and last_rows is not None:
                x = rows_at(x, last_rows)[:, 0]
                if layer.is_gdn:
                    out = rows_at(self.reduce(gdn(layer.linear_attn, h)), last_rows)[:, 0]
                else:
                    out = self.reduce(attend(layer.self_attn, h, last_rows))[:, 0]
            else:
                out = self.reduce(gdn(layer.linear_attn, h) if layer.is_gdn else attend(layer.self_attn, h))
            x, h = layer.post_attention_layernorm.add_and_norm(x, out, kernels)
            pending = self.reduce(layer.mlp(h, kernels))
            if i in tap_layer_ids or i == last:
                x, pending = x + pending, None
            if i in tap_layer_ids:  # the last layer's tap is the final-normed output, as transformers reports it
                taps.append(self.norm(x, kernels) if i == last else x)
        return x, (torch.cat(taps, dim=-1) if taps else None)

    def _dense_route(self, batch: ExtendBatch, kernels: Kernels, x: torch.Tensor, pool: SlotPool
                     ) -> tuple[bool, torch.Tensor | None]:
        """(AttentionRows.fresh, .dense_keys) of this chunk: fresh when every live lane starts at position
        0 (by the host mirrors; a fixed-shape batch has none and says so itself); dense_keys, the storage
        rows [1, S] of keys 0..S-1, for a one-lane chunk after committed keys within dense.gathers' bounds
        (all its rows valid: they are the run's last). Neither without kernels.prefill_attention."""
        if kernels.prefill_attention is None or not dense_attention.supports(x.dtype, x.device, self.cfg.head_dim):
            return False, None
        if batch.fixed_shape:
            return batch.starts_sequences, None
        starts = [s for s, slot in zip(batch.start_host, batch.slot_ids_host) if slot >= 0]
        if starts and not any(starts):
            return True, None
        if len(batch.start_host) == 1 and batch.slot_ids_host[0] >= 0 and batch.n_rows_host[0] == x.shape[1] \
                and dense_attention.gathers(batch.start_host[0], batch.n_rows_host[0]):
            S = batch.start_host[0] + batch.n_rows_host[0]
            return False, pool.tables.rows(batch.slot_ids[:1], torch.arange(S, device=x.device)[None])
        return False, None

    @torch.inference_mode()
    def extend(self, batch: ExtendBatch, pool: SlotPool, kernels: Kernels, tap_layer_ids=(), all_logits: bool = False,
               all_hidden: bool = False, last_hidden: bool = False):
        """Returns (logits fp32: [L, V] at each lane's last valid row, or [L, T, V] if all_logits, or with
        all_hidden every row's last hidden state [L, T, H] (before the final norm: `logits` projects any
        rows of it, a few at a time where every row's logits would not fit), or with last_hidden that of each
        lane's last valid row [L, H] (the caller projects the rows whose logits it needs); taps [L, T, n_taps*H]
        or None).
        A fixed-shape batch (ExtendBatch.padded) syncs nothing: CUDA-graph safe."""
        x = self.vocab.embed(batch.input_ids)
        rope = rope_cos_sin(batch.positions, self.cfg.rotary_dim, self.cfg.rope_theta, x.dtype)
        kmax = max((s + n for s, n in zip(batch.start_host, batch.n_rows_host)), default=None)  # None: fixed shape
        fresh, dense_keys = self._dense_route(batch, kernels, x, pool)
        rows = AttentionRows(kv_rows=pool.tables.rows(batch.slot_ids, batch.positions, batch.rows_valid),
                             slot_ids=batch.slot_ids, n_rows=batch.n_rows,
                             context_lens=batch.positions[:, 0].contiguous(),  # once, not in every layer's kernel call
                             max_pages=pool.tables.pages_to_read(kmax), split=False, fresh=fresh,
                             dense_keys=dense_keys, fixed_shape=batch.fixed_shape)

        attend = lambda attn, h, queries=None: attn(  # noqa: E731
            h, rope, rows if queries is None else rows.at_queries(queries), pool, kernels)
        gdn = lambda mixer, h: mixer.extend(h, batch, pool, kernels)  # noqa: E731
        # each lane's last row is all that leaves the forward (its logits), unless every row's logits do or the
        # last layer is tapped: past the last layer's K/V (or GDN state) only those rows are computed
        last = (batch.n_rows - 1).clamp(min=0)
        every = all_logits or all_hidden
        trim = not every and len(self.layers) - 1 not in tap_layer_ids
        x, taps = self._run_layers(x, attend, gdn, tap_layer_ids, kernels, last if trim else None)
        for slot, start, n in zip(batch.slot_ids_host, batch.start_host, batch.n_rows_host):  # (a fixed-shape
            if slot >= 0:  # batch has no host mirrors: its caller records the lengths)
                pool.lengths[slot] = start + n
        if all_hidden:
            return x, taps
        if not trim and not every:
            x = rows_at(x, last)[:, 0]
        return (x if last_hidden else self.logits(x, kernels)), taps

    @torch.inference_mode()
    def verify(self, batch: VerifyBatch, pool: SlotPool, kernels: Kernels, tap_layer_ids=(),
               kmax: int | None = None, gather_logits: bool = True) -> VerifyOutput:
        """All lanes' W rows in one forward. GDN state is read only; attention K/V of row n is
        written at start + n (past the committed length, so harmless until commit). No host syncs.
        kmax: a host bound on every lane's start + W, so the reference attention reads no more pages
        (None: from start_host, or with none the whole table, a fixed shape for CUDA graphs; the Triton
        kernel reads each lane's own length either way). gather_logits False (tensor parallel): the
        logits are this rank's vocabulary share (the runner gathers them, or only their argmax)."""
        L, W = batch.input_ids.shape
        device = batch.input_ids.device
        x = self.vocab.embed(batch.input_ids)
        rope = rope_cos_sin(batch.positions, self.cfg.rotary_dim, self.cfg.rope_theta, x.dtype)
        if kmax is None and batch.start_host:
            kmax = max(batch.start_host) + W
        store = batch.start[:, None] + torch.arange(W, device=device)  # row n's K/V at start + n
        rows = AttentionRows(kv_rows=pool.tables.rows(batch.slot_ids, store), slot_ids=batch.slot_ids,
                             context_lens=batch.start, n_rows=torch.full_like(batch.start, W),
                             mode="causal" if batch.chain_host else "tree",
                             tree_mask=None if batch.chain_host else kernels.ancestor_mask(batch.parents),
                             max_pages=pool.tables.pages_to_read(kmax))

        cfg = self.cfg
        G, dk, dv = len(cfg.gdn_layer_ids), cfg.linear_key_head_dim, cfg.linear_value_head_dim
        # each GDN layer writes its slice in place (stacking afterwards would copy them all once more)
        windows = torch.empty(G, L, cfg.conv_channels, cfg.conv_kernel - 1 + W, dtype=x.dtype, device=device)
        logs = torch.empty(G, L, W, cfg.linear_num_value_heads, 1 + dk + dv, dtype=torch.float32, device=device)
        gdn = lambda mixer, h: mixer.verify(h, batch, pool, kernels, windows[mixer.gdn_index],  # noqa: E731
                                            logs[mixer.gdn_index])
        attend = lambda attn, h: attn(h, rope, rows, pool, kernels)  # noqa: E731
        x, taps = self._run_layers(x, attend, gdn, tap_layer_ids, kernels)
        return VerifyOutput(logits=self.logits(x, kernels, gather_logits), taps=taps, conv_windows=windows,
                            replay_log=logs)
