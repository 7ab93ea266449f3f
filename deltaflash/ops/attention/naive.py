"""Pure-torch reference of paged attention: gather the lanes' pages, then masked SDPA.

The contract (shared with paged.py, derived in README.md). Lane l holds `context_lens[l]` committed
keys at positions 0..ctx-1 and this call's block of `n_rows[l]` rows at positions ctx..ctx+n-1; every
key of position p lives in page `block_tables[slot, p // page_size]` at row `p % page_size`. Query row
t of the block sees every committed key and, inside the block, row m when
    causal: m <= t        full: every row        tree: tree_mask[l, t, m]
and with a window, only keys whose position differs from ctx + t by less than `window`. Padding lanes
(slot -1) and rows that see no key give zeros.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

MODES = ("causal", "full", "tree")

# Not cuDNN: it builds a new graph for every new key length (~8 ms of host time per call), and decode
# and drafting see a new key length every round.
_SDPA_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """SDPA over [L, heads, T, hd] queries and [L, kv_heads, S, hd] keys / values with a bool mask
    [L, 1, T, S]; returns [L, heads, T, hd]. GQA without copying K / V per query head: the query
    heads that share a kv head are stacked as extra query rows of that head (same keys, same mask)."""
    L, heads, T, hd = q.shape
    kv_heads = k.shape[1]
    rep = heads // kv_heads
    if rep > 1:
        q = q.reshape(L, kv_heads, rep * T, hd)  # head g * rep + r -> kv head g, rows r * T + t
        mask = mask.expand(L, 1, T, mask.shape[-1]).repeat(1, 1, rep, 1)
    with sdpa_kernel(_SDPA_BACKENDS):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.reshape(L, heads, T, hd)


def visible_keys(context_lens: torch.Tensor, n_rows: torch.Tensor, slot_ids: torch.Tensor, T: int, K: int,
                 mode: str, tree_mask: torch.Tensor | None, window: int | None) -> torch.Tensor:
    """[L, T, K] bool: query row t of lane l sees the key at position k (the contract above)."""
    device = context_lens.device
    ctx = context_lens.view(-1, 1, 1)
    t = torch.arange(T, device=device).view(1, T, 1)
    key = torch.arange(K, device=device).view(1, 1, K)
    block = key - ctx  # index of a key inside the block (negative: committed)
    in_block = (block >= 0) & (block < n_rows.view(-1, 1, 1))
    if mode == "causal":
        in_block = in_block & (block <= t)
    elif mode == "tree":
        in_block = in_block & tree_mask.gather(2, block.clamp(0, T - 1).expand(-1, T, -1))
    visible = (key < ctx) | in_block
    if window is not None:
        visible = visible & ((ctx + t - key).abs() < window)
    return visible & (slot_ids >= 0).view(-1, 1, 1)


def paged_attention_ref(q: torch.Tensor, key_pages: torch.Tensor, value_pages: torch.Tensor,
                        block_tables: torch.Tensor, slot_ids: torch.Tensor, context_lens: torch.Tensor,
                        n_rows: torch.Tensor | None = None, *, scale: float, mode: str = "causal",
                        tree_mask: torch.Tensor | None = None, window: int | None = None,
                        max_pages: int | None = None, split: bool = True) -> torch.Tensor:
    """q [L, T, nh, hd]; key_pages / value_pages [P, page_size, nkv, hd]; block_tables [S, n_max] of
    page ids; slot_ids [L] (-1 padding); context_lens, n_rows [L] long (n_rows None: T); tree_mask
    [L, T, T] bool (mode "tree"). Reads the first `max_pages` entries of each lane's table (None: all:
    a fixed shape, as CUDA graphs need). Returns [L, T, nh, hd] in q's dtype. `split` is the kernel's
    (whether it may cut the key range); the reference takes every key in one softmax either way."""
    L, T, nh, hd = q.shape
    page_size = key_pages.shape[1]
    n_rows = torch.full_like(context_lens, T) if n_rows is None else n_rows
    n_pages = block_tables.shape[1] if max_pages is None else min(max_pages, block_tables.shape[1])
    pages = block_tables[slot_ids.clamp(min=0), :n_pages].long()  # [L, n]
    K = n_pages * page_size
    written = torch.arange(K, device=q.device)[None] < (context_lens + n_rows)[:, None]  # [L, K]
    # storage past the written keys may hold anything (stale rows, uninitialised pages): read as zeros
    keys = torch.where(written[..., None, None], key_pages[pages].flatten(1, 2), 0).to(q.dtype)
    values = torch.where(written[..., None, None], value_pages[pages].flatten(1, 2), 0).to(q.dtype)
    visible = visible_keys(context_lens, n_rows, slot_ids, T, K, mode, tree_mask, window)
    out = masked_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), visible[:, None], scale)
    return torch.where(visible.any(-1)[:, :, None, None], out.transpose(1, 2), 0)


def write_kv_ref(key_cache: torch.Tensor, value_cache: torch.Tensor, rows: torch.Tensor, keys: torch.Tensor,
                 values: torch.Tensor) -> None:
    """A layer's new K/V into its pages, in place: key_cache / value_cache [P+1, page, nkv, hd] (one layer
    of the pool's); rows [L, T] storage rows (page * page_size + offset: BlockTables.rows; the sink's for
    rows that must land nowhere); keys / values [L, T, nkv, hd], cast to the caches' dtype."""
    for cache, new in ((key_cache, keys), (value_cache, values)):
        cache.view(-1, *cache.shape[2:])[rows.flatten()] = new.flatten(0, 1).to(cache.dtype)


def move_tree_rows_ref(key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
                       slot_ids: torch.Tensor, start: torch.Tensor, nodes: torch.Tensor, rows: torch.Tensor) -> None:
    """A tree commit's K/V moves, in place. key_cache / value_cache [A, P+1, page, nkv, hd]; block_tables
    [S+1, max_pages] (row S: padding lanes'); slot_ids [L] (-1: padding, moves nothing); start [L]: the
    lane's first verified position; nodes [L, T]: the accepted path's node ids in token order, its first
    rows[l] accepted. Verify stored node n at start + n; accepted node t goes to start + t. Every source
    row is gathered before any row is written; a row not moved is written back as it was."""
    L, T = nodes.shape
    page, max_pages = key_cache.shape[2], block_tables.shape[1]
    t = torch.arange(T, device=nodes.device)
    moves = (t < rows[:, None]) & (nodes != t)
    lanes = torch.where(slot_ids < 0, block_tables.shape[0] - 1, slot_ids)[:, None]

    def storage_rows(positions):
        pages = block_tables[lanes, (positions // page).clamp(max=max_pages - 1)].long()
        return (pages * page + positions % page).flatten()

    dst = start[:, None] + t
    src = storage_rows(torch.where(moves & (slot_ids >= 0)[:, None], start[:, None] + nodes, dst))
    dst = storage_rows(dst)
    for cache in (key_cache, value_cache):
        flat = cache.flatten(1, 2)  # [A, (P+1) * page, nkv, hd], a view
        flat[:, dst] = flat[:, src]
