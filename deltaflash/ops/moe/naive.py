"""Pure-torch reference of the MoE expert computation (SwiGLU experts weighted by the router).
fused_moe.py holds the Triton grouped GEMM that CUDA uses instead; README.md gives the math."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def moe_experts_ref(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                    gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> torch.Tensor:
    """x [N, H]; topk_weights [N, k] (x's dtype); topk_ids [N, k] long in [0, E); gate_up_proj
    [E, 2I, H] (rows [gate | up]); down_proj [E, H, I] -> [N, H] in x's dtype:
    out[n] = sum_j topk_weights[n, j] * down_e(silu(gate_e(x_n)) * up_e(x_n)), e = topk_ids[n, j].

    No host sync: every expert runs on every token (a static loop over E) and its output is weighted
    by the token's routing weight for it, zero when not routed. That costs E / k times the routed
    FLOPs, which is fine for the CPU / unfused route this serves."""
    out = torch.zeros_like(x)
    for e in range(gate_up_proj.shape[0]):
        weight = (topk_weights * (topk_ids == e)).sum(-1, keepdim=True)  # [N, 1]; one nonzero term per row
        gate, up = F.linear(x, gate_up_proj[e]).chunk(2, dim=-1)
        out += (F.linear(F.silu(gate) * up, down_proj[e]) * weight).to(out.dtype)
    return out
