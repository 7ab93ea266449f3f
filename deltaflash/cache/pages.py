"""Pages: the token-sized state of every sequence (attention K/V of the target, the drafter's context).

A page holds `page_size` consecutive positions of one sequence. Page ids index every page store of the
engine alike (the target's K/V and the drafter's context): one allocator, one block table per slot.
- `PageAllocator` (host only; the scheduler owns it): which pages are free and which a slot holds, in
  position order. Pages are taken as a sequence grows and given back when it retires or is preempted. A
  sequence forked from another after their common prompt (engine/shares.py) holds the prompt's whole pages
  with it, read only - every write lands at or past a sequence's committed length - counted per holder; a
  shared page is free again when its last holder gives it back. The prefix cache holds the pages of the
  prompts it keeps the same way (`keep` / `unkeep`), counted apart: pages only it holds are not in use by any
  sequence (`num_in_use`), and it gives them back before anybody waits for pages.
- `BlockTables` (device): the slots' tables `[S + 1, max_pages]` int32, read by every forward to find a
  position's storage row; row S serves padding lanes and page `num_pages` is the sink that padding
  writes land in, so every write is unconditional (CUDA-graph friendly).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from deltaflash.core.batch import to_device
from deltaflash.errors import PagesExhaustedError

DEFAULT_PAGE_SIZE = 16  # ops/attention/README.md argues the choice


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


def page_store(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """Zeros for a page store. On CPU through calloc (numpy), whose large blocks are fresh zero pages of
    the OS: the memory a pool takes grows with the pages sequences write, not with the pool's size."""
    if torch.device(device).type != "cpu" or 0 in shape:  # (a model without attention layers stores nothing)
        return torch.zeros(shape, dtype=dtype, device=device)
    itemsize = torch.tensor([], dtype=dtype).element_size()
    numel = 1
    for n in shape:
        numel *= n
    return torch.from_numpy(np.zeros(numel * itemsize, dtype=np.uint8)).view(dtype).view(shape)


def copy_pages(store: torch.Tensor, pages: torch.Tensor) -> None:
    """Page pages[1, j] of a page store [layers, P + 1, page_size, ...] becomes a copy of page pages[0, j]."""
    if pages.shape[1] and store.numel():
        store.index_copy_(1, pages[1], store.index_select(1, pages[0]))


def _ids(pages: list[int]) -> np.ndarray:
    return np.fromiter(pages, dtype=np.int64, count=len(pages))


class PageAllocator:
    """Page ids 0..num_pages-1 and the pages each slot holds. Never-used pages are handed out in order
    (no list of all ids is built, so a pool of millions of pages starts at once), given-back ones first."""

    def __init__(self, num_pages: int, page_size: int, num_slots: int):
        self.num_pages, self.page_size = num_pages, page_size
        self._fresh = 0                 # pages _fresh.. have never been handed out
        self._returned: list[int] = []  # pages given back, reused first
        self.held: list[list[int]] = [[] for _ in range(num_slots)]
        # per page (zeros from calloc: a pool of millions of pages costs nothing until pages are shared): its
        # holders past the first (slots, kept prompts), and the kept prompts among its holders (keep)
        self._extra = np.zeros(num_pages, dtype=np.int32)
        self._kept = np.zeros(num_pages, dtype=np.int32)
        self._num_extra = 0  # the sum of _extra: 0 (no page shared) lets a slot give its pages back at once
        self.num_kept_only = 0  # pages held by kept prompts alone

    @property
    def num_free(self) -> int:
        return self.num_pages - self._fresh + len(self._returned)

    @property
    def num_used(self) -> int:
        return self.num_pages - self.num_free

    @property
    def num_in_use(self) -> int:
        """Pages some sequence holds (num_used but those only kept prompts hold)."""
        return self.num_used - self.num_kept_only

    def missing(self, slot: int, tokens: int) -> int:
        """Pages `slot` must still take to hold positions 0..tokens-1."""
        return max(0, pages_for(tokens, self.page_size) - len(self.held[slot]))

    def short_of(self, slots: list[int], tokens: list[int]) -> list[tuple[int, int]]:
        """The (slot, tokens) pairs whose slot holds too few pages for positions 0..tokens-1 (most rounds:
        none - a lane crosses into a new page once every page_size / width rounds)."""
        held, size = self.held, self.page_size
        return [(slot, n) for slot, n in zip(slots, tokens) if n > len(held[slot]) * size]

    def grow(self, slot: int, tokens: int) -> list[tuple[int, int, int]]:
        """Take the pages `slot` lacks for positions 0..tokens-1; returns the new (slot, table index, page)
        entries. PagesExhaustedError (nothing taken) when too few are free: callers check `missing` first."""
        n = self.missing(slot, tokens)
        if n > self.num_free:
            raise PagesExhaustedError(f"slot {slot} needs {n} more pages for {tokens} tokens; {self.num_free} free")
        reused = min(n, len(self._returned))  # given-back pages first, last given back first
        pages = self._returned[len(self._returned) - reused:][::-1] + list(range(self._fresh, self._fresh + n - reused))
        del self._returned[len(self._returned) - reused:]
        self._fresh += n - reused
        held = self.held[slot]
        grants = [(slot, index, page) for index, page in enumerate(pages, len(held))]
        held.extend(pages)
        return grants

    def share(self, source: int, slot: int, count: int) -> list[tuple[int, int, int]]:
        """`slot` (holding nothing) holds the first `count` pages of `source` too, read only (a fork after their
        common prompt); returns the new (slot, table index, page) entries."""
        pages = self.held[source][:count]
        if len(pages) < count:
            raise ValueError(f"slot {source} holds {len(pages)} pages, not {count}")
        return self.adopt(slot, pages)

    def adopt(self, slot: int, pages: list[int]) -> list[tuple[int, int, int]]:
        """`slot` (holding nothing) holds `pages` (held already: by another slot, or kept by the prefix cache)
        as its first pages, read only; returns the new (slot, table index, page) entries."""
        if self.held[slot]:
            raise ValueError(f"slot {slot} already holds pages")
        self.hold(pages)
        self.held[slot] = list(pages)
        return [(slot, index, page) for index, page in enumerate(pages)]

    def hold(self, pages: list[int]) -> None:
        """One more holder of each of `pages` (held already); `give_back` ends it."""
        if pages:
            page = _ids(pages)
            self.num_kept_only -= self._kept_only(page)
            self._share(page, 1)

    def keep(self, pages: list[int]) -> None:
        """A kept prompt (the prefix cache's) holds `pages` too (held already); `unkeep` ends it."""
        if pages:
            page = _ids(pages)
            self._share(page, 1)
            self._kept[page] += 1

    def release(self, slot: int) -> int:
        """Give back every page of `slot` (retirement, cancellation, preemption); returns how many are free
        again (a page another holder still holds is not)."""
        pages, self.held[slot] = self.held[slot], []
        return self.give_back(pages)

    def give_back(self, pages: list[int]) -> int:
        """One holder lets `pages` go; those nobody holds any more are free again (returns how many)."""
        if self._num_extra and pages:
            page = _ids(pages)
            shared = self._extra[page] > 0
            if shared.any():  # (most often all of them or none)
                pages = [] if shared.all() else page[~shared].tolist()
                page = page[shared]
                self._share(page, -1)
                self.num_kept_only += self._kept_only(page)
        self._returned.extend(reversed(pages))
        return len(pages)

    def unkeep(self, pages: list[int]) -> int:
        """A kept prompt lets `pages` go; those nobody holds any more are free again (returns how many)."""
        if not pages:
            return 0
        page = _ids(pages)
        self._kept[page] -= 1
        alone = self._extra[page] == 0  # (its last holder: a page kept prompts alone held)
        self._share(page[~alone], -1)
        free = page[alone].tolist()
        self.num_kept_only -= len(free)
        self._returned.extend(reversed(free))
        return len(free)

    def _kept_only(self, page: np.ndarray) -> int:
        """How many of `page` kept prompts alone hold (all their holders are kept prompts)."""
        kept = self._kept[page]
        return int(np.count_nonzero((kept > 0) & (self._extra[page] + 1 == kept)))

    def _share(self, page: np.ndarray, holders: int) -> None:
        """`holders` more holders (or fewer) of each of `page` (distinct ids)."""
        self._extra[page] += holders
        self._num_extra += holders * len(page)


class BlockTables:
    """tables [S + 1, max_pages] int32 on the device: entry (slot, i) is the page of positions
    i * page_size .. (i + 1) * page_size - 1. With `num_pages` None the tables are static: slot s owns
    pages s * max_pages .. (s + 1) * max_pages - 1 for its whole capacity (kernels, tests and benchmarks
    that drive a model without a scheduler); otherwise entries start at the sink and `map` fills them."""

    def __init__(self, num_slots: int, max_len: int, page_size: int, device, num_pages: int | None = None):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.num_slots, self.page_size = num_slots, page_size
        self.max_pages = pages_for(max_len, page_size)
        self.static = num_pages is None
        self.num_pages = num_slots * self.max_pages if self.static else num_pages
        self.sink_page = self.num_pages
        self.tables = torch.full((num_slots + 1, self.max_pages), self.sink_page, dtype=torch.int32, device=device)
        if self.static:
            self.tables[:num_slots] = torch.arange(self.num_pages, dtype=torch.int32, device=device).view(
                num_slots, self.max_pages)

    @property
    def capacity(self) -> int:
        """Positions one slot can hold."""
        return self.max_pages * self.page_size

    def map(self, grants: Sequence[tuple[int, int, int]]) -> None:
        """Write (slot, table index, page) entries (`update` without releases)."""
        self.update((), grants)

    def unmap(self, slots: Sequence[int]) -> None:
        """Point every entry of `slots` at the sink (`update` without grants)."""
        self.update(slots, ())

    def update(self, released: Sequence[int], grants: Sequence[tuple[int, int, int]]) -> None:
        """Point every entry of the `released` slots at the sink (their pages were given back: no stale
        entry of a reused slot can reach a page that another sequence holds now), then write the (slot,
        table index, page) `grants`. One host -> device transfer (the flat entry indices and the pages
        side by side in one byte buffer) and a kernel for each part; no sync."""
        if not released and not grants:
            return
        if self.static:
            raise ValueError("static block tables are not mapped")
        entries = np.asarray(grants, dtype=np.int64).reshape(-1, 3)
        index = np.concatenate([np.asarray(released, dtype=np.int64), entries[:, 0] * self.max_pages + entries[:, 1]])
        payload = np.concatenate([index.view(np.uint8), entries[:, 2].astype(np.int32).view(np.uint8)])
        data = to_device(payload, self.tables.device, dtype=torch.uint8)
        index = data[:8 * len(index)].view(torch.int64)
        if len(released):
            self.tables.index_fill_(0, index[:len(released)], self.sink_page)
        if len(entries):
            self.tables.view(-1).index_copy_(0, index[len(released):], data[8 * len(index):].view(torch.int32))

    def rows(self, slot_ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """Storage rows (page * page_size + offset) of positions [L, T] of lanes slot_ids [L]; the sink's
        first row for padding lanes (slot -1) and where keep [L, T] is False. No host sync."""
        lanes = torch.where(slot_ids < 0, self.num_slots, slot_ids)
        index = (positions // self.page_size).clamp(0, self.max_pages - 1)
        page = self.tables[lanes].gather(1, index).long()
        rows = page * self.page_size + positions % self.page_size
        drop = (slot_ids < 0)[:, None] if keep is None else (slot_ids < 0)[:, None] | ~keep
        return torch.where(drop, self.sink_page * self.page_size, rows)

    def pages_to_read(self, length: int | None) -> int | None:
        """Table entries that cover `length` positions (None: all, a fixed shape)."""
        return None if length is None else min(self.max_pages, pages_for(length, self.page_size))
