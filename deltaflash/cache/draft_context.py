"""The drafter's context K/V in pages: every committed token's context row, projected once, per drafter layer.

Layout: key / value [num_layers, P + 1, page_size, nk, hd] in the drafter's dtype, addressed through the
same block tables as the target's K/V (cache/pages.py: one page id covers a position in every page
store). The token at position p lives at its page's row p % page_size. A lane drafting from anchor
position a reads its context rows 0..a-1 (the sequence's committed positions, all of which were
appended for the sequence now in the slot) and writes its block's own K/V at a..a+B-1 for the call:
those rows lie past the committed length and are overwritten when the accepted rows are appended.
Sliding-window layers read only the rows inside their window; nothing is kept as a ring.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from deltaflash.cache.pages import DEFAULT_PAGE_SIZE, BlockTables, copy_pages, page_store


class DraftContextCache:
    """Owner of the drafter's persistent context K/V, in pages of `tables`."""

    def __init__(self, tables: BlockTables, *, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: str | torch.device) -> None:
        self.tables = tables
        shape = (num_layers, tables.num_pages + 1, tables.page_size, num_kv_heads, head_dim)
        self.key = page_store(shape, dtype, device)
        self.value = page_store(shape, dtype, device)

    @classmethod
    def for_slots(cls, num_slots: int, max_model_len: int, *, page_size: int = DEFAULT_PAGE_SIZE,
                  **layout) -> "DraftContextCache":
        """A cache with static tables of its own (each slot owns pages for max_model_len positions)."""
        device = layout["device"]
        return cls(BlockTables(num_slots, max_model_len, page_size, device), **layout)

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()

    def reset(self, slot: int) -> None:
        """Admission: nothing to forget (a lane reads context only below its anchor position, and every
        such row is appended for the sequence the slot now holds)."""

    def copy_pages(self, pages: Tensor) -> None:
        """pages [2, N]: page pages[1, j] becomes a copy of page pages[0, j] (a fork's partial prompt page)."""
        copy_pages(self.key, pages)
        copy_pages(self.value, pages)

    def _write(self, rows: Tensor, keys: Tensor, values: Tensor) -> None:
        """keys / values [N, layers, nk, hd] at storage rows [N]."""
        self.key.flatten(1, 2)[:, rows] = keys.transpose(0, 1).to(self.key.dtype)
        self.value.flatten(1, 2)[:, rows] = values.transpose(0, 1).to(self.value.dtype)

    @torch.no_grad()
    def append(self, slot_ids: Tensor, positions: Tensor, keys: Tensor, values: Tensor) -> None:
        """Store committed rows: slot_ids [N] (-1 = padding: written to the sink), positions [N] int64,
        keys / values [N, layers, nk, hd] (the drafter's projection of the rows' target features).
        No host sync (CUDA-graph safe)."""
        if slot_ids.numel():
            self._write(self.tables.rows(slot_ids, positions[:, None])[:, 0], keys, values)

    def write_block(self, layer: int, rows: Tensor, keys: Tensor, values: Tensor) -> None:
        """A drafted block's own K/V [L, B, nk, hd] of one layer at storage rows [L, B] (for this call only)."""
        self.key[layer].view(-1, *self.key.shape[3:])[rows.flatten()] = keys.flatten(0, 1).to(self.key.dtype)
        self.value[layer].view(-1, *self.value.shape[3:])[rows.flatten()] = values.flatten(0, 1).to(self.value.dtype)


@dataclass(frozen=True)
class DraftContext:
    """One block forward's view of the context: lanes slot_ids [L] (-1 padding) drafting blocks at
    positions context_lens[l] + 0..B-1 (the anchor's position = the lane's committed length);
    block_rows [L, B] storage rows of the block; attend: the paged attention op (ops/kernels.py);
    max_pages: table entries the reference attention reads (None: all, a fixed shape)."""

    cache: DraftContextCache
    slot_ids: Tensor
    context_lens: Tensor
    block_rows: Tensor
    attend: Callable
    max_pages: int | None = None

    @classmethod
    def build(cls, cache: DraftContextCache, slot_ids: Tensor, anchor_positions: Tensor, block_size: int,
              attend: Callable, max_context_len: int | None = None) -> "DraftContext":
        positions = anchor_positions[:, None] + torch.arange(block_size, device=anchor_positions.device)
        bound = None if max_context_len is None else max_context_len + block_size
        return cls(cache, slot_ids, anchor_positions, cache.tables.rows(slot_ids, positions), attend,
                   cache.tables.pages_to_read(bound))

    def attention(self, layer: int, q: Tensor, k: Tensor, v: Tensor, window: int | None, causal: bool) -> Tensor:
        """Block queries q [L, B, nh, hd] over the context and the block's own k / v [L, B, nk, hd]."""
        self.cache.write_block(layer, self.block_rows, k, v)
        return self.attend(q, self.cache.key[layer], self.cache.value[layer], self.cache.tables.tables, self.slot_ids,
                           self.context_lens, None, scale=q.shape[-1] ** -0.5, mode="causal" if causal else "full",
                           window=window, max_pages=self.max_pages)
