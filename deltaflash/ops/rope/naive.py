"""Partial rotary position embedding, the torch route: the first `rd` dims of each head rotated by
(cos, sin), the rest kept. Op by op: neg, two cats, two products and a sum, each rounded to the dtype."""

from __future__ import annotations

import torch


def apply_rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., heads, hd]; cos/sin [..., rd] broadcast over heads; rotates the first rd dims."""
    rd = cos.shape[-1]
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    rot, keep = x[..., :rd], x[..., rd:]
    half = rd // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    return torch.cat([rot * cos + rotated * sin, keep], dim=-1)
