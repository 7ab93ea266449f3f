"""Torch reference of the SwiGLU activation (CPU, and CUDA with DELTAFLASH_NO_FUSED_KERNELS=1)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up: two launches, silu rounded to the dtype before the product."""
    return F.silu(gate) * up
