"""Causal attention of prefill rows that start a sequence: they see only their own block, so no page is read.

A chunk at positions 0..T-1 (nothing committed before it) attends to its own K/V alone, which the layer
holds as dense [L, T, nkv, hd] tensors before writing them to pages. Such a chunk runs on a library's
flash-attention kernel (torch SDPA's FlashAttention-2 backend on CUDA, its flash kernel on CPU) instead
of the paged kernel: on the H200 a 2048-token chunk of the 9B shape takes ~0.57 ms per layer in the
paged kernel (64-row x 16-key tiles: head dim 256 leaves no registers for larger ones) and a fraction
of it here (docs/benchmarks.md). cuDNN's backend is not used: it builds a graph per new sequence length
(ops/attention/naive.py), and every prompt has its own.

Both kernel sets run this same function (ops/kernels.py), so the fused and unfused routes stay bit for bit
equal for prefill. A batch-invariant engine does not use it (the paged kernel's tiles are fixed; a
library kernel's may follow the shape)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

MAX_HEAD_DIM = 256  # FlashAttention-2's widest head


def supports(dtype: torch.dtype, device: torch.device, head_dim: int) -> bool:
    """Whether the flash backend takes these rows (CUDA: half precision only; CPU: any float)."""
    if head_dim > MAX_HEAD_DIM:
        return False
    return device.type == "cpu" or dtype in (torch.float16, torch.bfloat16)


def causal_block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [L, T, nh, hd], k / v [L, T, nkv, hd] (nh a multiple of nkv: GQA without copying K / V) ->
    [L, T, nh, hd]: row t of lane l attends to rows 0..t of lane l. Rows past a lane's valid rows give
    values nobody reads (the valid rows come first and see none of them)."""
    if not supports(q.dtype, q.device, q.shape[-1]):
        raise ValueError(f"flash attention takes no {q.dtype} rows of head dim {q.shape[-1]} on {q.device.type}")
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                             scale=scale, enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)
