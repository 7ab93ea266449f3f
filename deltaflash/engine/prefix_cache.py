"""The prefix cache: the state of prompts prefilled before, for later prompts that begin with them.

A hybrid model's state at a position is not only its K/V pages: each GDN layer's recurrent state and conv
history sum up every token before it, and exist only where a prefill or a round left them. So the cache keeps
whole-prompt snapshots: when a prompt of at least `MIN_TOKENS` tokens finishes its prefill, its slot's GDN
state is copied into a row of the pool's saved state (SlotPool.save) and its pages are held by the cache
(PageAllocator.hold). A request whose prompt begins with a kept prompt and goes on past it (an agent's next
turn: its previous prompt, the answer, the tool's result) starts from there: its slot takes the saved state
(SlotPool.restore), holds the kept prompt's whole pages with the cache, gets a copy of the partial last
one, and prefills only the rest. Sequences write only at or past their committed length, so held pages are
never written.

Entries are evicted least recently used first: for a new snapshot when every row is taken, and for pages
when admission or a round would otherwise wait or preempt (Scheduler). Host only; the scheduler owns it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MIN_TOKENS = 64  # shorter prompts cost less to prefill again than a snapshot of the state costs to keep


@dataclass(eq=False)
class CachedPrompt:
    """A kept prompt: its tokens (int64, read only), the row of saved state holding the GDN state after them,
    and the pages holding their K/V (and the drafter's context)."""

    tokens: np.ndarray
    row: int
    pages: list[int]


class PrefixCache:
    def __init__(self, rows: int):
        self.rows = rows
        self.entries: list[CachedPrompt] = []  # least recently used first
        self._free_rows = list(range(rows - 1, -1, -1))

    def __len__(self) -> int:
        return len(self.entries)

    def longest(self, tokens: np.ndarray) -> CachedPrompt | None:
        """The longest kept prompt that `tokens` begin with and go on past (one token at least is left to
        prefill: the first token is sampled from the last prefilled row), or None."""
        best = None
        for entry in self.entries:
            n = len(entry.tokens)
            if n < len(tokens) and (best is None or n > len(best.tokens)) and np.array_equal(tokens[:n], entry.tokens):
                best = entry
        return best

    def touch(self, entry: CachedPrompt) -> None:
        """`entry` was used: the most recently used now."""
        self.entries.remove(entry)
        self.entries.append(entry)

    def kept(self, tokens: np.ndarray) -> CachedPrompt | None:
        """The entry of exactly these tokens, if any."""
        return next((e for e in self.entries if len(e.tokens) == len(tokens) and np.array_equal(e.tokens, tokens)),
                    None)

    def add(self, tokens: np.ndarray, pages: list[int]) -> CachedPrompt | None:
        """A new entry in a free row (None when every row is taken: evict first)."""
        if not self._free_rows:
            return None
        entry = CachedPrompt(tokens, self._free_rows.pop(), pages)
        self.entries.append(entry)
        return entry

    def evict(self, keep: CachedPrompt | None = None) -> CachedPrompt | None:
        """Drop the least recently used entry other than `keep` (its pages are the caller's to give back);
        None when there is none."""
        entry = next((e for e in self.entries if e is not keep), None)
        if entry is not None:
            self.entries.remove(entry)
            self._free_rows.append(entry.row)
        return entry
