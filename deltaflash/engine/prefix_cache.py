"""The prefix cache: the state of prompts prefilled before, for later prompts that begin with them.

A hybrid model's state at a position is not only its K/V pages: each GDN layer's recurrent state and conv
history sum up every token before it, and exist only where a prefill or a round left them. So the cache keeps
snapshots at the positions prefills reach: when a prompt of at least `MIN_TOKENS` tokens finishes its prefill,
its slot's GDN state is copied into a row of the pool's saved state (SlotPool.save) and its pages are held by
the cache (PageAllocator.hold). A request whose prompt begins with a kept prompt and goes on past it (an agent's
next turn: its previous prompt, the answer, the tool's result) starts from there: its slot takes the saved state
(SlotPool.restore), holds the kept prompt's whole pages with the cache, gets a copy of the partial last
one, and prefills only the rest. Sequences write only at or past their committed length, so the positions a
kept prompt's pages hold for it are never written.

Prompts that share only a beginning (two questions after one system prompt) part where no prefill stopped.
The second of them makes that point one: a request whose prompt shares at least `BRANCH_MIN_TOKENS` more tokens
with a kept prompt than the kept prompt it starts from (if any) prefills up to its *branch point* - the shared
tokens, down to a multiple of `BRANCH_ALIGN` and short of its last token - in a chunk of its own, and the state
there is kept like a prompt's (Scheduler._snapshots). Every later prompt with that beginning starts from it. The
price, a chunk boundary in one prefill, is paid once per beginning.

Entries are evicted least recently used first: for a new snapshot when every row is taken, and for pages
when admission or a round would otherwise wait or preempt (Scheduler). Host only; the scheduler owns it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MIN_TOKENS = 64  # shorter prompts cost less to prefill again than a snapshot of the state costs to keep
# a branch point costs one prefill a chunk boundary (a forward's fixed cost: its weight read, ~5 ms at 9B on an
# H100, the time of ~200 prompt tokens' compute); it is made where later prompts skip at least this many tokens
BRANCH_MIN_TOKENS = 256
BRANCH_ALIGN = 64  # branch points at multiples of this (fla-core's chunk; whole pages of 16): beginnings that part
#                    a few tokens apart (a chat template's user turn, then different questions) meet at one point


@dataclass(eq=False)
class CachedPrompt:
    """A kept prompt (or a kept beginning of one): its tokens (int64, read only), the row of saved state
    holding the GDN state after them, and the pages holding their K/V (and the drafter's context)."""

    tokens: np.ndarray
    row: int
    pages: list[int]


def _head(tokens: np.ndarray) -> bytes | None:
    """The key kept prompts are looked up by: their first MIN_TOKENS tokens (None for shorter token runs,
    which no kept prompt's tokens begin with and no later prompt would find)."""
    return tokens[:MIN_TOKENS].tobytes() if len(tokens) >= MIN_TOKENS else None


class PrefixCache:
    def __init__(self, rows: int):
        self.rows = rows
        self.entries: list[CachedPrompt] = []  # least recently used first
        self._by_head: dict[bytes, list[CachedPrompt]] = {}  # entries by _head: only these can share a beginning
        self._free_rows = list(range(rows - 1, -1, -1))

    def __len__(self) -> int:
        return len(self.entries)

    def match(self, tokens: np.ndarray) -> tuple[CachedPrompt | None, int]:
        """(the longest kept prompt that `tokens` begin with and go on past - one token at least is left to
        prefill: the first token is sampled from the last prefilled row - or None; the most leading tokens
        `tokens` share with any kept prompt)."""
        best, shared = None, 0
        for entry in self._by_head.get(_head(tokens), ()):
            n = min(len(entry.tokens), len(tokens))
            differ = np.flatnonzero(entry.tokens[:n] != tokens[:n])
            same = int(differ[0]) if differ.size else n
            shared = max(shared, same)
            if same == len(entry.tokens) < len(tokens) and (best is None or same > len(best.tokens)):
                best = entry
        return best, shared

    def kept(self, tokens: np.ndarray) -> CachedPrompt | None:
        """The entry of exactly these tokens, if any."""
        return next((e for e in self._by_head.get(_head(tokens), ())
                     if len(e.tokens) == len(tokens) and np.array_equal(e.tokens, tokens)), None)

    def touch(self, entry: CachedPrompt) -> None:
        """`entry` was used: the most recently used now."""
        self.entries.remove(entry)
        self.entries.append(entry)

    def add(self, tokens: np.ndarray, pages: list[int]) -> CachedPrompt | None:
        """A new entry in a free row (None when every row is taken: evict first). `tokens`: MIN_TOKENS at least."""
        if not self._free_rows:
            return None
        entry = CachedPrompt(tokens, self._free_rows.pop(), pages)
        self.entries.append(entry)
        self._by_head.setdefault(_head(tokens), []).append(entry)
        return entry

    def evict(self, keep: CachedPrompt | None = None) -> CachedPrompt | None:
        """Drop the least recently used entry other than `keep` (its pages are the caller's to give back);
        None when there is none."""
        entry = next((e for e in self.entries if e is not keep), None)
        if entry is not None:
            self.entries.remove(entry)
            key = _head(entry.tokens)
            self._by_head[key].remove(entry)
            if not self._by_head[key]:
                del self._by_head[key]
            self._free_rows.append(entry.row)
        return entry


def branch_point(shared: int, start: int, total: int) -> int:
    """Where a prefill of `total` tokens, starting from a kept prompt of `start` tokens (0: none) and sharing
    `shared` leading tokens with some kept prompt, stops to keep its state on the way: the shared tokens down
    to a multiple of BRANCH_ALIGN, short of the last token (sampled from), where that skips BRANCH_MIN_TOKENS
    or more for the prompts after it; else 0 (no branch point)."""
    point = min(shared, total - 1) // BRANCH_ALIGN * BRANCH_ALIGN
    return point if point - start >= BRANCH_MIN_TOKENS else 0
