"""Tensor parallelism of the target over the ranks of one process group (torch.distributed: NCCL on
CUDA, gloo on the CPU).

Each rank holds its share of every layer: of the attention layers' query and key/value heads, of the
GDN layers' key and value heads (their projections, conv channels, gates, and so their conv history and
recurrent state in the slot pool), and of the dense MLP's intermediate width. The residual stream, the
norms, the embedding and the lm_head are replicated. The products that leave a layer (attention's
o_proj, GDN's out_proj, the MLP's down_proj) hold one share of the sum each: the model adds them over
the ranks with one all-reduce per layer output (`Qwen35Model.reduce`), so every rank sees the whole
residual stream and the same logits.

Head shares are contiguous: rank r of N holds heads [r h / N, (r + 1) h / N) of each kind. A GDN value
head j reads key head j // (nv / nk) and an attention head i the key/value head i // (nh / nkv), so the
shares of a rank read only its own key heads.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from deltaflash.config import ModelConfig
from deltaflash.errors import UnsupportedModelError
from deltaflash.models.qwen3_5 import Qwen35Model


def shard_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """The config of one rank's share: head counts and the MLP width divided by `size`."""
    if cfg.is_moe:
        raise UnsupportedModelError("tensor parallelism of MoE targets is not built yet (dense targets only)")
    counts = {"num_heads": cfg.num_heads, "num_kv_heads": cfg.num_kv_heads,
              "linear_num_key_heads": cfg.linear_num_key_heads,
              "linear_num_value_heads": cfg.linear_num_value_heads, "intermediate_size": cfg.intermediate_size}
    uneven = [f"{name} {n}" for name, n in counts.items() if n % size]
    if uneven:
        raise UnsupportedModelError(f"tensor parallel size {size} does not divide {', '.join(uneven)}")
    return dataclasses.replace(cfg, **{name: n // size for name, n in counts.items()})


def _share(n: int, rank: int, size: int, width: int = 1) -> torch.Tensor:
    """Indices of rank's contiguous share of n units of `width` rows each."""
    per = n // size
    return torch.arange(rank * per * width, (rank + 1) * per * width)


def shard_state(cfg: ModelConfig, state: dict[str, torch.Tensor], rank: int, size: int) -> dict[str, torch.Tensor]:
    """Rank's share of a full model's state_dict (parameter names of Qwen35Model)."""
    nk, nv, dk, dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    key_rows, value_rows = _share(nk, rank, size, dk), _share(nv, rank, size, dv)
    qkv_channels = torch.cat([key_rows, nk * dk + key_rows, 2 * nk * dk + value_rows])  # [q | k | v]
    v_heads = _share(nv, rank, size)
    q_rows, kv_rows = _share(nh, rank, size, 2 * hd), _share(nkv, rank, size, hd)  # q_proj: per head [q | gate]
    o_cols = _share(nh, rank, size, hd)
    mlp = _share(cfg.intermediate_size, rank, size)
    rows = {  # parameter suffix -> (dim, indices) of its share
        "linear_attn.in_proj_qkv.weight": (0, qkv_channels), "linear_attn.conv1d.weight": (0, qkv_channels),
        "linear_attn.in_proj_z.weight": (0, value_rows), "linear_attn.in_proj_b.weight": (0, v_heads),
        "linear_attn.in_proj_a.weight": (0, v_heads), "linear_attn.dt_bias": (0, v_heads),
        "linear_attn.A_log": (0, v_heads), "linear_attn.out_proj.weight": (1, value_rows),
        "self_attn.q_proj.weight": (0, q_rows), "self_attn.q_proj.bias": (0, q_rows),
        "self_attn.k_proj.weight": (0, kv_rows), "self_attn.k_proj.bias": (0, kv_rows),
        "self_attn.v_proj.weight": (0, kv_rows), "self_attn.v_proj.bias": (0, kv_rows),
        "self_attn.o_proj.weight": (1, o_cols),
        "mlp.gate_proj.weight": (0, mlp), "mlp.up_proj.weight": (0, mlp), "mlp.down_proj.weight": (1, mlp),
    }
    out = {}
    for name, tensor in state.items():
        suffix = name.split(".", 2)[-1] if name.startswith("layers.") else name
        if suffix in rows:
            dim, index = rows[suffix]
            out[name] = tensor.index_select(dim, index.to(tensor.device)).contiguous()
        elif suffix == "self_attn.o_proj.bias":  # added once to the sum of the shares
            out[name] = tensor if rank == 0 else torch.zeros_like(tensor)
        else:  # norms, embedding, lm_head: replicated
            out[name] = tensor
    return out


def all_reduce_sum(group=None):
    """The model's `reduce` for a process group: the shares of a layer output summed in place."""
    def reduce(t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
        return t
    return reduce


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
    local.reduce = all_reduce_sum(group) if size > 1 else local.reduce
    return local.eval()
