"""The K/V moves of a tree commit, in one launch: verify wrote node n of lane l at position start[l] + n;
the accepted path's t-th node belongs at start[l] + t.

Reference and contract: naive.move_tree_rows_ref. One program per (lane, attention layer) copies, key
and value, the row of each accepted node that is not already in place, in token order: node t of a path
sits at depth t, and nodes are numbered depth by depth, so its id is >= t - every row a program reads
lies at or past every position it has written, and in-order copies never read a moved row. Rows are read
in place through the lane's block table (positions within the rows the verify wrote). A pure copy: the
bits are the reference's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def move_tree_rows_kernel(
    key_cache, value_cache, block_tables, slot_ids, start, nodes, rows,
    stride_c_a, stride_c_p, stride_c_r,
    stride_b_s, stride_n_l, stride_n_t,
    T, PAGE: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
):
    """Lane i_l, attention layer i_a: for t < rows[i_l], the row of node nodes[i_l, t] to position
    start + t (D = kv heads x head dim elements a row, contiguous)."""
    i_l, i_a = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    i_s = tl.load(slot_ids + i_l).to(tl.int64)
    n_rows = tl.load(rows + i_l).to(tl.int32)
    if i_s >= 0:
        p_table = block_tables + i_s * stride_b_s
        first = tl.load(start + i_l).to(tl.int64)
        o_d = tl.arange(0, BD)
        m_d = o_d < D
        base = i_a * stride_c_a
        for t in range(0, T):
            i_n = tl.load(nodes + i_l * stride_n_l + t * stride_n_t).to(tl.int64)
            if (t < n_rows) & (i_n != t):
                src, dst = first + i_n, first + t
                r_src = tl.load(p_table + src // PAGE).to(tl.int64) * stride_c_p + (src % PAGE) * stride_c_r
                r_dst = tl.load(p_table + dst // PAGE).to(tl.int64) * stride_c_p + (dst % PAGE) * stride_c_r
                b_k = tl.load(key_cache + base + r_src + o_d, mask=m_d)
                b_v = tl.load(value_cache + base + r_src + o_d, mask=m_d)
                tl.store(key_cache + base + r_dst + o_d, b_k, mask=m_d)
                tl.store(value_cache + base + r_dst + o_d, b_v, mask=m_d)


def move_tree_rows_fwd(key_cache, value_cache, block_tables, slot_ids, start, nodes, rows) -> None:
    A, _, page, nkv, hd = key_cache.shape
    L, T = nodes.shape
    if L == 0 or A == 0:
        return
    D = nkv * hd
    move_tree_rows_kernel[(L, A)](
        key_cache, value_cache, block_tables, slot_ids, start, nodes, rows,
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        block_tables.stride(0), nodes.stride(0), nodes.stride(1),
        T, PAGE=page, D=D, BD=triton.next_power_of_2(D), num_warps=4)


def move_tree_rows(key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
                   slot_ids: torch.Tensor, start: torch.Tensor, nodes: torch.Tensor, rows: torch.Tensor) -> None:
    """In place: naive.move_tree_rows_ref's contract (the caller validated the lanes: slots, room, paths
    that are root paths of the verified trees, as acceptance builds them)."""
    if key_cache.shape != value_cache.shape or key_cache.dim() != 5:
        raise ValueError(f"key / value caches must be one shape [A, P+1, page, nkv, hd], got "
                         f"{tuple(key_cache.shape)} and {tuple(value_cache.shape)}")
    if key_cache.stride() != value_cache.stride() or key_cache.stride(3) != key_cache.shape[4] \
            or key_cache.stride(4) != 1:
        raise ValueError("key / value caches must share strides, each row's kv heads x head dim contiguous")
    L = slot_ids.shape[0]
    if nodes.dim() != 2 or nodes.shape[0] != L or start.shape != (L,) or rows.shape != (L,):
        raise ValueError(f"slot_ids [L], start [L], nodes [L, T], rows [L] expected, got {tuple(slot_ids.shape)}, "
                         f"{tuple(start.shape)}, {tuple(nodes.shape)}, {tuple(rows.shape)}")
    move_tree_rows_fwd(key_cache, value_cache, block_tables, slot_ids.contiguous(), start.contiguous(), nodes,
                       rows.contiguous())
