"""Building blocks of the Qwen3.5 text stack. Ops with a kernel (norms, MoE experts) run the
implementation of the `Kernels` set passed to the forward (ops/kernels.py). Products run through each
module's `linear` (F.linear; `route_products` swaps in another GEMM: ops/gemm's batch-invariant or
skinny kernels)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deltaflash.ops.kernels import Kernels
from deltaflash.ops.rope.naive import apply_rope_ref


def rows_at(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """t [L, T, ...] -> [L, 1, ...]: row index[l] of each lane l (one gather, no host sync)."""
    shape = (t.shape[0], 1, *t.shape[2:])
    return t.gather(1, index.view(-1, *[1] * (t.dim() - 1)).expand(shape))


class RoutedLinear(nn.Linear):
    """nn.Linear whose product is `self.product(x, weight, bias)` (what `route_products` turns a Linear into)."""

    product = staticmethod(F.linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x, self.weight, self.bias)


def route_products(model: nn.Module, linear) -> nn.Module:
    """Every product of `model` (its nn.Linear layers, merged projections, router and lm_head) through
    `linear(x, weight, bias=None)`, a drop-in for F.linear. In place; returns the model."""
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = RoutedLinear
        if isinstance(module, RoutedLinear):
            module.product = linear
        if hasattr(type(module), "linear"):
            module.linear = linear
    return model


def product_weights(model: nn.Module) -> list[torch.Tensor]:
    """The weight [N, K] of each product one forward of `model` runs: a merged projection's matrix once (not
    its parts), every other nn.Linear, and the embedding where it is also the lm_head (tied)."""
    merged, weights = set(), []
    for module in model.modules():
        if isinstance(module, MergedProjections) and module.merged_weight is not None:
            weights.append(module.merged_weight)
            merged.update(id(getattr(module, name)) for name in module.PROJECTIONS)
    weights += [m.weight for m in model.modules() if isinstance(m, nn.Linear) and id(m) not in merged]
    cfg = getattr(model, "cfg", None)
    if cfg is not None and getattr(cfg, "tie_word_embeddings", False):
        weights.append(model.embed_tokens.weight)
    return weights


def is_routed(model: nn.Module) -> bool:
    """Whether `route_products` has run on `model` (its products may not be F.linear)."""
    return any(isinstance(m, RoutedLinear) for m in model.modules())


class MergedProjections(nn.Module):
    """Base of a module whose input projections (the nn.Linear children named in PROJECTIONS, all of
    the same input) run as one GEMM: one launch instead of several, and the small ones (GDN's a and b
    are nv rows each) stop costing a launch and a split-K reduction of their own.

    `merge_projections()`, called once after the weights are loaded, moves the parts' weights (and
    biases) into one row-concatenated matrix and makes each part's parameter a view of its rows: no
    second copy, and checkpoint names, state_dict and loading stay those of the parts."""

    PROJECTIONS: tuple[str, ...] = ()
    linear = staticmethod(F.linear)

    def __init__(self):
        super().__init__()
        self.register_buffer("merged_weight", None, persistent=False)
        self.register_buffer("merged_bias", None, persistent=False)
        self.merged_sizes: list[int] = []

    @torch.no_grad()
    def merge_projections(self) -> None:
        parts = [getattr(self, name) for name in self.PROJECTIONS]
        biased = {p.bias is not None for p in parts}
        if len(biased) > 1:
            raise ValueError(f"{type(self).__name__}: {self.PROJECTIONS} mix biased and unbiased projections")
        self.merged_sizes = [p.out_features for p in parts]
        self.merged_weight = torch.cat([p.weight for p in parts])
        for p, rows in zip(parts, self.merged_weight.split(self.merged_sizes)):
            p.weight = nn.Parameter(rows, requires_grad=False)
        if biased == {True}:
            self.merged_bias = torch.cat([p.bias for p in parts])
            for p, rows in zip(parts, self.merged_bias.split(self.merged_sizes)):
                p.bias = nn.Parameter(rows, requires_grad=False)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [..., in] -> the parts' outputs in PROJECTIONS order (column views of one GEMM's output)."""
        if self.merged_weight is None:
            raise RuntimeError(f"{type(self).__name__}: projections not merged; call merge_projections() "
                               "once the weights are loaded")
        return self.linear(x, self.merged_weight, self.merged_bias).split(self.merged_sizes, dim=-1)

    def project_from(self, x: torch.Tensor, first: int) -> tuple[torch.Tensor, ...]:
        """The outputs of PROJECTIONS[first:] alone: one GEMM over their rows of the merged matrix (a view)."""
        start = sum(self.merged_sizes[:first])
        bias = None if self.merged_bias is None else self.merged_bias[start:]
        return self.linear(x, self.merged_weight[start:], bias).split(self.merged_sizes[first:], dim=-1)


class ZeroCenteredRMSNorm(nn.Module):
    """fp32 `x * rsqrt(mean(x^2) + eps) * (1 + w)`, cast back to x's dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, kernels: Kernels) -> torch.Tensor:
        return kernels.zero_centered_rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, y: torch.Tensor, kernels: Kernels) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + y, this norm of it): the residual stream's add and the next layer's norm in one pass."""
        return kernels.add_rms_norm(x, y, self.weight, self.eps)


class GatedRMSNorm(nn.Module):
    """Per-head output norm of the GDN layer: `w * rmsnorm(o) * silu(z)` (plain weight)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, o: torch.Tensor, z: torch.Tensor, kernels: Kernels) -> torch.Tensor:
        return kernels.gated_rms_norm(o, z, self.weight, self.eps)


class SwiGLU(MergedProjections):
    PROJECTIONS = ("gate_proj", "up_proj")

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor, kernels: Kernels) -> torch.Tensor:
        gate, up = self.project(x)
        return self.down_proj(kernels.silu_mul(gate, up))


class Router(nn.Module):
    def __init__(self, num_experts: int, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden))


class Experts(nn.Module):
    """Fused expert weights: gate_up_proj [E, 2I, H], down_proj [E, H, I]."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))


class SparseMoE(nn.Module):
    """fp32 softmax router, top-k renormalised, SwiGLU experts, plus a sigmoid-gated shared expert."""

    linear = staticmethod(F.linear)

    def __init__(self, hidden: int, num_experts: int, top_k: int, intermediate: int, shared_intermediate: int):
        super().__init__()
        self.top_k = top_k
        self.gate = Router(num_experts, hidden)
        self.experts = Experts(num_experts, hidden, intermediate)
        self.shared_expert = SwiGLU(hidden, shared_intermediate)
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def forward(self, x: torch.Tensor, kernels: Kernels) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        router_logits = self.linear(x, self.gate.weight)
        probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).to(router_logits.dtype)
        # ops/moe: no host sync in either implementation, so MoE layers can be graph-captured
        out = kernels.moe_experts(x, weights, experts, self.experts.gate_up_proj, self.experts.down_proj)
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x, kernels)
        return (out + shared).reshape(shape)


def rope_cos_sin(positions: torch.Tensor, rotary_dim: int, theta: float, dtype: torch.dtype):
    """positions [...] long -> cos, sin [..., rotary_dim] (fp32 math, cast to dtype)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=positions.device) / rotary_dim))
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


apply_rope = apply_rope_ref  # the drafter's and the trainer's RoPE: the torch route (ops/rope)
