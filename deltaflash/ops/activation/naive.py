"""Torch references of the activations: SwiGLU's and gated attention's output gate (CPU, and CUDA with
DELTAFLASH_NO_FUSED_KERNELS=1)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up: two launches, silu rounded to the dtype before the product."""
    return F.silu(gate) * up


def sigmoid_gate_ref(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(gate), [L, T, heads, head_dim] -> [L, T, heads * head_dim]: two launches, sigmoid rounded
    to the dtype before the product; the heads merged after the gating (flattening the strided gate first
    would copy it)."""
    return (x * torch.sigmoid(gate)).flatten(-2)
