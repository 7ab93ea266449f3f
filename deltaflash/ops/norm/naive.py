"""Pure-torch references of the models' RMS norms (fp32 statistics). rms_norm.py holds the
Triton kernels that CUDA uses instead; README.md gives the math."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def zero_centered_rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D], weight [D] -> `x * rsqrt(mean(x^2) + eps) * (1 + w)` in fp32, cast to x's dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (1.0 + weight.float())).type_as(x)


def plain_rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3's plain RMSNorm (the DFlash drafter's): `w * rmsnorm(x)`, the normed x (fp32 statistics) cast
    to x's dtype before the weight (x's dtype)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm_ref(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream's add and the next norm: (s = x + y, zero_centered_rms_norm_ref(s))."""
    total = x + y
    return total, zero_centered_rms_norm_ref(total, weight, eps)


def gated_rms_norm_ref(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x, gate [..., D], weight [D] (gate's dtype) -> `w * rmsnorm(x) * silu(gate)`: the normed x is
    cast to gate's dtype before the weight, the gate is applied in fp32, the result is gate's dtype."""
    dtype = gate.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return ((weight * xf.to(dtype)) * F.silu(gate.float())).to(dtype)
