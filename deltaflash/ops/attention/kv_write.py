"""A layer's new keys and values into their pages, in one launch: the torch route's two index_put launches
(keys, then values; H100, a 2048-token prefill of the 9B shape: 13 us each a layer) become one pass that
reads each row's key from the RoPE kernel's output and its value where the projection wrote it (a strided
view), and writes both to the row's storage row.

Reference and contract: naive.write_kv_ref. Rows of padding lanes and rows past a lane's valid rows all
point at the sink page's first row (BlockTables.rows), which several programs may write at once: nobody
reads it. A pure copy (a cast where the cache's dtype differs): the bits are the reference's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def write_kv_kernel(key_cache, value_cache, rows, keys, values, T,
                    stride_k_l, stride_k_t, stride_k_h, stride_v_l, stride_v_t, stride_v_h,
                    HD: tl.constexpr, D: tl.constexpr, BD: tl.constexpr):
    """Token i_n = l * T + t: its D = kv heads x head dim key and value elements (head o // HD) to storage
    row rows[i_n] of each cache (rows of D contiguous elements)."""
    i_n = tl.program_id(0).to(tl.int64)
    i_l, i_t = i_n // T, i_n % T
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    o_h, o_e = o_d // HD, o_d % HD
    i_r = tl.load(rows + i_n).to(tl.int64)
    b_k = tl.load(keys + i_l * stride_k_l + i_t * stride_k_t + o_h * stride_k_h + o_e, mask=m_d)
    b_v = tl.load(values + i_l * stride_v_l + i_t * stride_v_t + o_h * stride_v_h + o_e, mask=m_d)
    tl.store(key_cache + i_r * D + o_d, b_k.to(key_cache.dtype.element_ty), mask=m_d)
    tl.store(value_cache + i_r * D + o_d, b_v.to(value_cache.dtype.element_ty), mask=m_d)


def write_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, rows: torch.Tensor, keys: torch.Tensor,
             values: torch.Tensor) -> None:
    """In place: naive.write_kv_ref's contract. The caches must be contiguous (one layer of the pool's);
    keys and values need unit feature stride (any token / head strides)."""
    if key_cache.shape != value_cache.shape or key_cache.dim() != 4:
        raise ValueError(f"key / value caches must be one shape [P+1, page, nkv, hd], got {tuple(key_cache.shape)} "
                         f"and {tuple(value_cache.shape)}")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("key / value caches must be contiguous")
    L, T, nkv, hd = keys.shape
    if values.shape != keys.shape or key_cache.shape[2:] != (nkv, hd) or rows.shape != (L, T):
        raise ValueError(f"keys / values [L, T, nkv, hd] matching the caches' rows and rows [L, T] expected, got "
                         f"{tuple(keys.shape)}, {tuple(values.shape)}, {tuple(rows.shape)}")
    if keys.stride(-1) != 1 or values.stride(-1) != 1:
        raise ValueError("keys and values need unit feature stride")
    if L * T == 0:
        return
    D = nkv * hd
    write_kv_kernel[(L * T,)](key_cache, value_cache, rows.contiguous(), keys, values, T, *keys.stride()[:3],
                              *values.stride()[:3], HD=hd, D=D, BD=triton.next_power_of_2(D), num_warps=4)
