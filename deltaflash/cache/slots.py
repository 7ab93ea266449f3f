"""The slot pool: persistent per-sequence state of the target model.

One slot owns one live sequence's fixed-size state: GDN conv history and fp32 recurrent state for every
GDN layer. Its token-sized state, the attention K/V of every full-attention layer, lives in pages
(cache/pages.py) that the slot's block table maps. The scheduler hands slots out (`SlotTable`) and pages
(`PageAllocator`), both host only; the runner resets a slot's device state at admission
(`SlotPool.reset`) and maps the pages the scheduler granted. A slot forked from another after their common
prompt (engine/shares.py) starts from a copy of its state (`SlotPool.fork`) and reads the prompt's whole
pages with it; nothing a slot writes is ever shared.
"""

from __future__ import annotations

import torch
from torch import Tensor

from deltaflash.cache.pages import DEFAULT_PAGE_SIZE, BlockTables, copy_pages, page_store
from deltaflash.config import ModelConfig
from deltaflash.errors import SlotsExhaustedError


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of target K/V one token position takes over all attention layers."""
    return 2 * len(cfg.attn_layer_ids) * cfg.num_kv_heads * cfg.head_dim * torch.tensor([], dtype=dtype).element_size()


class SlotPool:
    """Tensors (S slots, G GDN layers, A attention layers, C conv channels, K conv taps, P pages):
        conv_history    [S, G, C, K-1]                     activation dtype
        recurrent_state [S, G, nv, dk, dv]                 fp32 (a view of state_rows [S + 1, ...]: row S,
                                                           `state_sink`, is what padding lanes of a prefill
                                                           graph read and write; it stays zero)
        key_cache       [A, P+1, page_size, nkv, hd]       activation dtype (+1: the sink page)
        value_cache     [A, P+1, page_size, nkv, hd]
    `tables` maps each slot's positions to pages (static tables when num_pages is None: every slot owns
    pages for its whole capacity). `lengths[slot]` is the number of committed positions (host ints: read
    without a device sync).
    """

    def __init__(self, cfg: ModelConfig, num_slots: int, max_len: int, dtype: torch.dtype, device,
                 page_size: int = DEFAULT_PAGE_SIZE, num_pages: int | None = None, saved_rows: int = 0):
        G, A = len(cfg.gdn_layer_ids), len(cfg.attn_layer_ids)
        self.num_slots = num_slots
        self.conv_history = torch.zeros(num_slots, G, cfg.conv_channels, cfg.conv_kernel - 1, dtype=dtype, device=device)
        self.state_rows = torch.zeros(
            num_slots + 1, G, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim,
            dtype=torch.float32, device=device,
        )
        self.recurrent_state = self.state_rows[:num_slots]
        self.state_sink = num_slots
        self.tables = BlockTables(num_slots, max_len, page_size, device, num_pages)
        self.max_len = self.tables.capacity
        kv_shape = (A, self.tables.num_pages + 1, page_size, cfg.num_kv_heads, cfg.head_dim)
        self.key_cache = page_store(kv_shape, dtype, device)
        self.value_cache = page_store(kv_shape, dtype, device)
        self.lengths = [0] * num_slots
        # the prefix cache's rows (engine/prefix_cache.py): a slot's GDN state after a kept prompt
        self.saved_conv = torch.zeros(saved_rows, *self.conv_history.shape[1:], dtype=dtype, device=device)
        self.saved_state = torch.zeros(saved_rows, *self.recurrent_state.shape[1:], dtype=torch.float32, device=device)

    def kv_of(self, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) [A, length, nkv, hd] of a slot's positions 0..length-1, gathered from its pages."""
        positions = torch.arange(length, device=self.key_cache.device)[None]
        rows = self.tables.rows(torch.tensor([slot], device=positions.device), positions)[0]
        return (self.key_cache.flatten(1, 2)[:, rows], self.value_cache.flatten(1, 2)[:, rows])

    def reset(self, slot: int) -> None:
        """Every part of a slot back to the empty sequence (admission). K/V past the length are never read."""
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} outside 0..{self.num_slots - 1}")
        self.conv_history[slot].zero_()
        self.recurrent_state[slot].zero_()
        self.lengths[slot] = 0

    def fork(self, sources: list[int], slots: list[int]) -> None:
        """Slot slots[i] starts as a copy of slot sources[i] (its conv history, recurrent state and length; the
        partial last page of their common prompt is copied with `copy_pages`). A copy per slot and state tensor,
        from the source's own rows (no gathered temporary: 48 MiB of recurrent state a slot at the 9B shape)."""
        for source, slot in zip(sources, slots):
            self.conv_history[slot].copy_(self.conv_history[source])
            self.recurrent_state[slot].copy_(self.recurrent_state[source])
            self.lengths[slot] = self.lengths[source]

    def copy_pages(self, pages: Tensor) -> None:
        """pages [2, N] (device int64): the K/V of page pages[0, j] is copied into page pages[1, j]."""
        copy_pages(self.key_cache, pages)
        copy_pages(self.value_cache, pages)

    def save(self, slot: int, row: int) -> None:
        """The slot's GDN state (conv history, recurrent state) into saved row `row`."""
        self.saved_conv[row].copy_(self.conv_history[slot])
        self.saved_state[row].copy_(self.recurrent_state[slot])

    def restore(self, row: int, slot: int, length: int) -> None:
        """Slot `slot` starts from saved row `row`, `length` positions committed (its pages are mapped, the
        partial last one copied with `copy_pages`)."""
        self.conv_history[slot].copy_(self.saved_conv[row])
        self.recurrent_state[slot].copy_(self.saved_state[row])
        self.lengths[slot] = length


class SlotTable:
    """Which slots hold a live sequence (host only; the scheduler owns it). Slot 0 is handed out first."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_live(self) -> int:
        return self.num_slots - len(self._free)

    def take(self) -> int:
        if not self._free:
            raise SlotsExhaustedError(f"all {self.num_slots} slots hold live sequences; retire one or raise --max-concurrency")
        return self._free.pop()

    def give_back(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots or slot in self._free:
            raise ValueError(f"slot {slot} is not live")
        self._free.append(slot)
