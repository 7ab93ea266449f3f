"""The prefix cache: the state of prompts prefilled before, for later prompts that begin with them.

A hybrid model's state at a position is not only its K/V pages: each GDN layer's recurrent state and conv
history sum up every token before it, and exist only where a prefill or a round left them. So the cache keeps
snapshots at the positions prefills reach: when a prompt of at least `MIN_TOKENS` tokens finishes its prefill,
its slot's GDN state is copied into a row of the pool's saved state (SlotPool.save) and its pages are held by
the cache (PageAllocator.keep). A request whose prompt begins with a kept prompt and goes on past it (an agent's
next turn: its previous prompt, the answer, the tool's result) starts from there: its slot takes the saved state
(SlotPool.restore), holds the kept prompt's whole pages with the cache, gets a copy of the partial last
one, and prefills only the rest. Sequences write only at or past their committed length, so the positions a
kept prompt's pages hold for it are never written. A finished request's state is kept the same way, as the prompt
of its tokens but the last (its pending token, never fed; or all of them, where a stop token ended the last
round's accepted drafts): a chat's next turn sends the answer back, and prefills only its new message
(Scheduler.finish; not where a stop token came earlier among those drafts - the round's state went on past it).

Prompts that share only a beginning (two questions after one system prompt) part where no prefill stopped.
The second of them makes that point one: a request whose prompt shares at least `BRANCH_MIN_TOKENS` more tokens
with a kept prompt than the kept prompt it starts from (if any) prefills up to its *branch point* - the shared
tokens, down to a multiple of `BRANCH_ALIGN` and short of its last token - in a chunk of its own, and the state
there is kept like a prompt's (Scheduler._snapshots). Every later prompt with that beginning starts from it. The
price, a chunk boundary in one prefill, is paid once per beginning. Where the other prompt is still being
prefilled and not past that point (a burst of questions after one system prompt), it is the one that stops there,
and the request waits for that state (Scheduler._awaits_branch; the requests behind it in the queue start
meanwhile): the beginning is prefilled once.

Kept prompts are found by the keys of their blocks of BRANCH_ALIGN tokens (a hash chained over them): a lookup
hashes the blocks a prompt shares with kept ones and compares it with the few kept prompts that end there, not
with every kept prompt (64 kept prompts after one 2048-token system prompt: 17 us a lookup against 245 on this
CPU box by comparison). Entries are evicted least recently used first: for a new snapshot when every row is
taken, and for pages when admission or a round would otherwise wait or preempt (Scheduler). A kept prompt counts
as used whenever a longer kept prompt that begins with it is used or kept (as a radix tree's node is when its
subtree is): a system prompt's branch point outlives the questions kept beyond it, though every question keeps
a row, and a new question evicts the oldest of them, not the beginning all of them share. Host only; the
scheduler owns it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

MIN_TOKENS = 64  # shorter prompts cost less to prefill again than a snapshot of the state costs to keep
# a branch point costs one prefill a chunk boundary (a forward's fixed cost: its weight read, 5.3 ms at 9B on an
# H100 - the compute of ~200 prompt tokens); it is made where later prompts skip at least this many tokens
BRANCH_MIN_TOKENS = 256
BRANCH_ALIGN = 64  # branch points at multiples of this (fla-core's chunk; whole pages of 16): beginnings that part
#                    a few tokens apart (a chat template's user turn, then different questions) meet at one point


@dataclass(eq=False)
class CachedPrompt:
    """A kept prompt (or a kept beginning of one): its tokens (int64, read only), the row of saved state
    holding the GDN state after them, the pages holding their K/V (and the drafter's context), and the keys
    of their whole blocks (block_keys)."""

    tokens: np.ndarray
    row: int
    pages: list[int]
    keys: list[int]


def block_keys(tokens: np.ndarray, block: int, key: int = 0) -> Iterator[int]:
    """The keys of tokens' whole blocks of `block` tokens, in order: key k stands for the first k + 1 blocks (a
    hash chained over them, from `key`: that of the blocks before `tokens`, 0 for none; a kept prompt found by its
    key is compared with the tokens before it is used)."""
    width = block * tokens.itemsize
    data = tokens[:len(tokens) // block * block].tobytes()
    for start in range(0, len(data), width):
        key = hash((key, data[start:start + width]))
        yield key


class PrefixCache:
    """The kept prompts, least recently used first, found by their blocks' keys: every kept prompt's leading whole
    blocks of BRANCH_ALIGN tokens are counted under their keys (`_blocks`: how far a prompt's beginning is shared
    with any kept one), and each kept prompt is filed under the key of its whole blocks (`_ends`: which kept prompts
    a prompt could begin with) - a prompt is looked at a block at a time, never compared with every kept one."""

    def __init__(self, rows: int):
        self.rows = rows
        self.block = BRANCH_ALIGN
        self.entries: list[CachedPrompt] = []  # least recently used first
        self._blocks: dict[int, int] = {}  # block key -> kept prompts with those leading blocks
        self._ends: dict[int, list[CachedPrompt]] = {}  # the key of a kept prompt's whole blocks (0: none) -> those
        self._free_rows = list(range(rows - 1, -1, -1))

    def __len__(self) -> int:
        return len(self.entries)

    def match(self, tokens: np.ndarray) -> tuple[CachedPrompt | None, int]:
        """(the longest kept prompt that `tokens` begin with and go on past - one token at least is left to
        prefill: the first token is sampled from the last prefilled row - or None; the leading tokens `tokens`
        share with a kept prompt, counted in whole blocks of `block`)."""
        best, shared = self._longest_ending(tokens, 0, 0), 0
        for k, key in enumerate(block_keys(tokens, self.block)):
            if key not in self._blocks:
                break
            shared = (k + 1) * self.block
            best = self._longest_ending(tokens, key, shared) or best
        return best, shared

    def _longest_ending(self, tokens: np.ndarray, key: int, start: int) -> CachedPrompt | None:
        """The longest kept prompt filed under `key` (its whole blocks: tokens' first `start`) that `tokens`
        begin with and go on past."""
        best = None
        for entry in self._ends.get(key, ()):
            n = len(entry.tokens)
            if start <= n < len(tokens) and (best is None or n > len(best.tokens)) \
                    and np.array_equal(entry.tokens, tokens[:n]):
                best = entry
        return best

    def keys(self, tokens: np.ndarray, known: list[int] | tuple = ()) -> list[int]:
        """The keys of tokens' whole blocks (kept and add take them, computed once); `known`: those of their first
        len(known) blocks, computed before (a finished request's prompt's: only its answer's blocks are hashed)."""
        rest = block_keys(tokens[len(known) * self.block:], self.block, known[-1] if known else 0)
        return [*known, *rest]

    def kept(self, tokens: np.ndarray, keys: list[int] | None = None) -> CachedPrompt | None:
        """The entry of exactly these tokens (whose block keys are `keys`), if any."""
        keys = self.keys(tokens) if keys is None else keys
        return next((e for e in self._ends.get(keys[-1] if keys else 0, ())
                     if len(e.tokens) == len(tokens) and np.array_equal(e.tokens, tokens)), None)

    def touch(self, entry: CachedPrompt) -> None:
        """`entry` was used: the most recently used now, and the kept prompts it begins with just before it."""
        for used in self._beginnings(entry) + [entry]:
            self.entries.remove(used)
            self.entries.append(used)

    def _beginnings(self, entry: CachedPrompt) -> list[CachedPrompt]:
        """The other kept prompts that `entry`'s tokens begin with, shortest first (found under the keys of its
        leading blocks: a kept prompt is filed under the key of its whole blocks)."""
        n = len(entry.tokens)
        return [e for key in [0, *entry.keys] for e in sorted(self._ends.get(key, ()), key=lambda e: len(e.tokens))
                if len(e.tokens) < n and np.array_equal(e.tokens, entry.tokens[:len(e.tokens)])]

    def add(self, tokens: np.ndarray, pages: list[int], keys: list[int] | None = None) -> CachedPrompt | None:
        """A new entry (tokens with block keys `keys`) in a free row (None when every row is taken: evict first)."""
        if not self._free_rows:
            return None
        entry = CachedPrompt(tokens, self._free_rows.pop(), pages, self.keys(tokens) if keys is None else keys)
        self.entries.append(entry)
        self.touch(entry)  # (the prompts it begins with: used now too)
        for key in entry.keys:
            self._blocks[key] = self._blocks.get(key, 0) + 1
        self._ends.setdefault(entry.keys[-1] if entry.keys else 0, []).append(entry)
        return entry

    def evict(self, keep: CachedPrompt | None = None) -> CachedPrompt | None:
        """Drop the least recently used entry other than `keep` (its pages are the caller's to give back);
        None when there is none."""
        entry = next((e for e in self.entries if e is not keep), None)
        if entry is None:
            return None
        self.entries.remove(entry)
        for key in entry.keys:
            self._blocks[key] -= 1
            if not self._blocks[key]:
                del self._blocks[key]
        key = entry.keys[-1] if entry.keys else 0
        self._ends[key].remove(entry)
        if not self._ends[key]:
            del self._ends[key]
        self._free_rows.append(entry.row)
        return entry

    def branch_point(self, shared: int, start: int, total: int) -> int:
        """Where a prefill of `total` tokens, starting from a kept prompt of `start` tokens (0: none) and sharing
        `shared` leading tokens with some kept prompt (match), stops to keep its state on the way: the shared
        tokens down to a whole block, short of the last token (sampled from), where that skips BRANCH_MIN_TOKENS
        or more for the prompts after it; else 0 (no branch point)."""
        point = min(shared, total - 1) // self.block * self.block
        return point if point - start >= BRANCH_MIN_TOKENS else 0


def shared_tokens(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading tokens a and b share."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n
