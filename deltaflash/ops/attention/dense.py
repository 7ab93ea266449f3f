"""Causal attention of prefill chunks over dense K/V, on a library's flash-attention kernel.

A chunk at positions 0..T-1 (nothing committed before it) attends to its own K/V alone, which the layer
holds as dense [L, T, nkv, hd] tensors before writing them to pages; a one-lane chunk after committed
keys (a long prompt's later chunks) gathers them and its own rows from the pages into one dense run
(up to MAX_DENSE_KEYS; the page pool reserves the largest run: `gather_bytes`). Either runs on torch
SDPA's FlashAttention-2 backend (its flash kernel on CPU) instead of the paged kernel: on the H200 a
2048-token first chunk of the 9B shape takes 0.52 ms per layer in the paged kernel (64-row x 16-key
tiles: head dim 256 leaves no registers for larger ones) and 0.20 ms here, after 30,720 keys 15.5
against 3.4 ms with the gather (`bench/prefill_attention.py`, docs/benchmarks.md).

A first chunk of a fixed shape (a prefill graph's capture and its warm-ups) runs on SDPA's cuDNN backend:
on the H100 a 2048-row first chunk of the 9B shape takes 94 us there against 181 us in the flash kernel
(1024 rows: 30 us replayed from a graph, 55 eager, against 65 eager; `bench/prefill_levers.py`). cuDNN builds an
execution plan per new shape (~8 ms of host time), which a graph's shape pays once, at engine start;
chunks of varying shapes (eager steps) keep the flash kernel, and so do later chunks over a gathered
context, where cuDNN's lower-right causal mask costs it 1.3x the flash kernel's time (H100, 2048 rows after
2,048-14,336 keys).

Both kernel sets run this same function (ops/kernels.py), so the fused and unfused routes stay bit for bit
equal for prefill. A batch-invariant engine does not use it (the paged kernel's tiles are fixed; a
library kernel's may follow the shape)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

MAX_HEAD_DIM = 256  # FlashAttention-2's widest head
# A one-lane chunk after committed keys gathers them from the pages into one dense run when the run
# is at most this long: a transient copy of 2 x keys x nkv x hd (the 9B shape at 32,768 keys: 128 MiB,
# well inside the memory the page pool leaves), against attention in the paged kernel at a third of the
# flash kernel's rate. Longer contexts keep the paged kernel.
MAX_DENSE_KEYS = 32768
MIN_DENSE_ROWS = 64  # below this many query rows the gather costs more than the paged kernel's reads


def gather_bytes(max_model_len: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """The dense route's largest transient: one layer's K and V run of a later chunk, at most
    MAX_DENSE_KEYS keys (the page pool's sizing reserves it: engine/memory.py)."""
    keys = min(MAX_DENSE_KEYS, max_model_len)
    return 2 * keys * kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()


def gathers(start: int, rows: int) -> bool:
    """Whether a one-lane chunk of `rows` rows after `start` committed keys runs the dense route over its
    gathered context (MIN_DENSE_ROWS, MAX_DENSE_KEYS); the model and the runner's graph choice ask this."""
    return start > 0 and rows >= MIN_DENSE_ROWS and start + rows <= MAX_DENSE_KEYS


def supports(dtype: torch.dtype, device: torch.device, head_dim: int) -> bool:
    """Whether the flash backend takes these rows (CUDA: half precision only; CPU: any float)."""
    if head_dim > MAX_HEAD_DIM:
        return False
    return device.type == "cpu" or dtype in (torch.float16, torch.bfloat16)


def backends(q: torch.Tensor, first_chunk: bool, fixed_shape: bool) -> list[SDPBackend]:
    """SDPA's backends for these rows, in priority order: cuDNN first for a first chunk of a fixed shape on
    CUDA (the module's note), the flash kernel always (cuDNN's own checks may still turn a shape down)."""
    if first_chunk and fixed_shape and q.is_cuda and torch.backends.cudnn.is_available():
        return [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]
    return [SDPBackend.FLASH_ATTENTION]


def causal_block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                           fixed_shape: bool = False) -> torch.Tensor:
    """q [L, T, nh, hd], k / v [L, S, nkv, hd] with S >= T (nh a multiple of nkv: GQA without copying
    K / V) -> [L, T, nh, hd]. The query rows are the last T of the S key positions: row t sees keys
    0..S-T+t (S == T: a first chunk, row t sees rows 0..t; S > T: a chunk after S - T committed keys,
    gathered with it into one dense run). Rows past a lane's valid rows give values nobody reads (the
    valid rows come first and see none of them). fixed_shape: the caller runs this shape again and again
    (a CUDA graph), so a first chunk may take cuDNN's kernel, whose plan is built per shape."""
    if not supports(q.dtype, q.device, q.shape[-1]):
        raise ValueError(f"flash attention takes no {q.dtype} rows of head dim {q.shape[-1]} on {q.device.type}")
    T, S = q.shape[1], k.shape[1]
    if S < T:
        raise ValueError(f"{T} query rows need at least as many keys, got {S}")
    mask = {} if S == T else {"attn_mask": causal_lower_right(T, S)}
    with sdpa_kernel(backends(q, S == T, fixed_shape), set_priority=True):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=S == T, scale=scale, enable_gqa=q.shape[2] != k.shape[2],
                                             **mask)
    return out.transpose(1, 2)
