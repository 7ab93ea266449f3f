"""Tensor parallelism of the target over the ranks of one process group (torch.distributed: NCCL on
CUDA, gloo on the CPU).

Each rank holds its share of every layer: of the attention layers' query and key/value heads (a
key/value head is repeated on the ranks whose query heads read it when there are fewer than ranks), of
the GDN layers' key and value heads (their projections, conv channels, gates, and so their conv history
and recurrent state in the slot pool), and of the dense MLP's intermediate width - or, in MoE layers, of
every expert's and the shared expert's intermediate width (tensor- rather than expert-parallel: every
rank routes every token alike and holds an equal share of each expert's weights whatever the routing,
so no rank waits on a popular expert and no tokens move between ranks; the router is replicated) - and
of the vocabulary: the embedding's and the lm_head's rows (models/vocab.py: a lookup's shares are
all-reduced, the logits' all-gathered, so every rank holds the whole logits and samples alike; the
lm_head is the largest single matrix of a 9B model, 2 GB of its 18). The residual stream and the
norms are replicated. The products that leave a layer (attention's o_proj, GDN's out_proj, the MLP's
down_proj) hold one share of the sum each: the model adds them over the ranks with one all-reduce per
layer output (`Qwen35Model.reduce`), so every rank sees the whole residual stream and the same logits.

Head shares are contiguous: rank r of N holds heads [r h / N, (r + 1) h / N) of each kind. A GDN value
head j reads key head j // (nv / nk) and an attention head i the key/value head i // (nh / nkv), so the
shares of a rank read only its own key heads.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from deltaflash.config import ModelConfig
from deltaflash.errors import UnsupportedModelError
from deltaflash.models.qwen3_5 import Qwen35Model


def _widths(cfg: ModelConfig) -> dict[str, int]:
    """The widths a rank holds a 1/N share of: heads, and the MLP's (or every expert's) intermediate width."""
    counts = {"num_heads": cfg.num_heads, "linear_num_key_heads": cfg.linear_num_key_heads,
              "linear_num_value_heads": cfg.linear_num_value_heads}
    if cfg.is_moe:
        return counts | {"moe_intermediate_size": cfg.moe_intermediate_size,
                         "shared_expert_intermediate_size": cfg.shared_expert_intermediate_size}
    return counts | {"intermediate_size": cfg.intermediate_size}


def shard_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """The config of one rank's share: head counts and intermediate widths divided by `size`. Key/value
    heads too, or, when there are fewer of them than ranks, one each (size a multiple of them: each
    key/value head is then held by size / num_kv_heads ranks, those whose query heads read it)."""
    counts = _widths(cfg)
    uneven = [f"{name} {n}" for name, n in counts.items() if n % size]
    kv = cfg.num_kv_heads
    if (kv % size if kv >= size else size % kv):
        uneven.append(f"num_kv_heads {kv} (nor is it a multiple of it)")
    if cfg.vocab_size % size:
        uneven.append(f"vocab_size {cfg.vocab_size}")
    if uneven:
        raise UnsupportedModelError(f"tensor parallel size {size} does not divide {', '.join(uneven)}")
    return dataclasses.replace(cfg, num_kv_heads=max(kv // size, 1), vocab_shards=size,
                               **{name: n // size for name, n in counts.items()})


def _share(n: int, rank: int, size: int, width: int = 1) -> torch.Tensor:
    """Indices of rank's contiguous share of n units of `width` rows each."""
    per = n // size
    return torch.arange(rank * per * width, (rank + 1) * per * width)


@dataclass(frozen=True)
class Shard:
    """What rank `rank` of `size` keeps of a model whose whole config is `full`: its own config, and per
    parameter the indices along one dim that it holds (`rows`); everything else is held whole."""

    full: ModelConfig
    rank: int
    size: int

    @property
    def config(self) -> ModelConfig:
        return shard_config(self.full, self.size)

    @functools.cached_property
    def _rows(self) -> dict[str, tuple[int, torch.Tensor]]:
        cfg, rank, size = self.full, self.rank, self.size
        nk, nv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                          cfg.linear_value_head_dim)
        nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        key_rows, value_rows = _share(nk, rank, size, dk), _share(nv, rank, size, dv)
        qkv_channels = torch.cat([key_rows, nk * dk + key_rows, 2 * nk * dk + value_rows])  # [q | k | v]
        v_heads = _share(nv, rank, size)
        q_rows, o_cols = _share(nh, rank, size, 2 * hd), _share(nh, rank, size, hd)  # q_proj: per head [q | gate]
        if nkv >= size:
            kv_rows = _share(nkv, rank, size, hd)
        else:  # the one key/value head this rank's query heads read
            head = rank * nkv // size
            kv_rows = torch.arange(head * hd, (head + 1) * hd)
        vocab = _share(cfg.vocab_size, rank, size)
        rows = {  # parameter suffix -> (dim, indices) of its share
            "embed_tokens.weight": (0, vocab), "lm_head.weight": (0, vocab),
            "linear_attn.in_proj_qkv.weight": (0, qkv_channels), "linear_attn.conv1d.weight": (0, qkv_channels),
            "linear_attn.in_proj_z.weight": (0, value_rows), "linear_attn.in_proj_b.weight": (0, v_heads),
            "linear_attn.in_proj_a.weight": (0, v_heads), "linear_attn.dt_bias": (0, v_heads),
            "linear_attn.A_log": (0, v_heads), "linear_attn.out_proj.weight": (1, value_rows),
            "self_attn.q_proj.weight": (0, q_rows), "self_attn.q_proj.bias": (0, q_rows),
            "self_attn.k_proj.weight": (0, kv_rows), "self_attn.k_proj.bias": (0, kv_rows),
            "self_attn.v_proj.weight": (0, kv_rows), "self_attn.v_proj.bias": (0, kv_rows),
            "self_attn.o_proj.weight": (1, o_cols),
        }
        if cfg.is_moe:  # every expert's intermediate width shared out: each rank routes every token alike
            expert = _share(cfg.moe_intermediate_size, rank, size)
            gate_up = torch.cat([expert, cfg.moe_intermediate_size + expert])  # gate_up_proj rows: [gate | up]
            shared = _share(cfg.shared_expert_intermediate_size, rank, size)
            rows |= {"mlp.experts.gate_up_proj": (1, gate_up), "mlp.experts.down_proj": (2, expert),
                     "mlp.experts.gate_proj.weight": (0, expert), "mlp.experts.up_proj.weight": (0, expert),
                     "mlp.experts.down_proj.weight": (1, expert),  # one expert's parts, as checkpoints store them
                     "mlp.shared_expert.gate_proj.weight": (0, shared), "mlp.shared_expert.up_proj.weight": (0, shared),
                     "mlp.shared_expert.down_proj.weight": (1, shared)}
        else:
            mlp = _share(cfg.intermediate_size, rank, size)
            rows |= {"mlp.gate_proj.weight": (0, mlp), "mlp.up_proj.weight": (0, mlp), "mlp.down_proj.weight": (1, mlp)}
        return rows

    def rows(self, name: str) -> tuple[int, torch.Tensor] | None:
        """(dim, indices) of parameter `name`'s share (Qwen35Model names; a checkpoint's per-expert
        `layers.i.mlp.experts.e.gate_proj.weight` too), or None where the rank holds it whole."""
        suffix = name.split(".", 2)[-1] if name.startswith("layers.") else name
        if ".experts." in suffix:
            head, _, tail = suffix.partition(".experts.")
            suffix = f"{head}.experts.{tail.split('.', 1)[1]}" if tail.split(".", 1)[0].isdigit() else suffix
        return self._rows.get(suffix)

    def finish(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What loading a share leaves to do: o_proj's bias is added once to the sum of the shares (kept on
        rank 0, zero elsewhere)."""
        if self.rank:
            for name in [n for n in state if n.endswith("self_attn.o_proj.bias")]:
                state[name] = torch.zeros_like(state[name])
        return state


def shard_state(cfg: ModelConfig, state: dict[str, torch.Tensor], rank: int, size: int) -> dict[str, torch.Tensor]:
    """Rank's share of a full model's state_dict (parameter names of Qwen35Model)."""
    shard = Shard(cfg, rank, size)
    out = {}
    for name, tensor in state.items():
        rows = shard.rows(name)
        out[name] = tensor if rows is None else tensor.index_select(rows[0], rows[1].to(tensor.device)).contiguous()
    return shard.finish(out)


def all_reduce_sum(group=None):
    """The model's `reduce` for a process group: the shares of a layer output summed in place."""
    def reduce(t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
        return t
    return reduce


def all_gather_last(size: int, group=None):
    """The model's `gather` for a process group of `size` ranks: the ranks' [..., n] shares of the
    logits concatenated in rank order into [..., size * n]."""
    # torch 2.13 renames all_gather_into_tensor (deprecated there) to all_gather_single
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    def gather(t: torch.Tensor) -> torch.Tensor:
        parts = torch.empty((size * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
        all_gather(parts, t, group=group)  # the ranks' shares one after another along dim 0
        return parts.view(size, *t.shape).movedim(0, -2).flatten(-2)
    return gather


def connect(model: Qwen35Model, rank: int, size: int, group=None) -> Qwen35Model:
    """Make a rank's share of the model add its layer outputs and assemble its vocabulary over `group`."""
    if size > 1:
        model.reduce, model.gather = all_reduce_sum(group), all_gather_last(size, group)
        model.vocab_start = rank * model.cfg.vocab_rows
    return model


@torch.no_grad()
def shard_model(model: Qwen35Model, rank: int, size: int, group=None) -> Qwen35Model:
    """Rank's share of a loaded full model, as a model of its own (same device and dtype) whose layer
    outputs are summed over `group`. The full model's tensors are not changed."""
    cfg = shard_config(model.cfg, size)
    param = model.embed_tokens.weight
    with torch.device("meta"):
        local = Qwen35Model(cfg)
    local.load_state_dict(shard_state(model.cfg, model.state_dict(), rank, size), assign=True, strict=True)
    local.to(device=param.device)
    local.merge_projections()
    return connect(local, rank, size, group).eval()
