"""The scheduler decides; it never touches the device.

Each step it retires cancelled requests; gives every decoding sequence one lane of the round with a
width (the rows it verifies, 1 + its drafts; 1 = plain decoding) and the pages those rows need,
preempting the most recently admitted sequences while pages run short; admits waiting sequences (first
come, first served) into free slots when their prompt's pages are free; and spends the prefill budget on
prompt chunks (oldest prompt first): `max_num_batched_tokens` prompt tokens per step, beside the round
(the round does not draw on it: under load a speculative round is lanes x width rows, and taking those
from the prompts' share would leave free slots waiting on prefill), scaled by the round's measured cost
over a plain round's when `scale_prefill_budget` (a costlier round, a proportionate prefill share: see
EngineConfig), and held to the tokens whose measured cost stays within `max_prefill_stall` rounds when that
is set; `idle_prefill_tokens` when nothing decodes (a prompt arriving at an idle engine stalls no
stream, and larger chunks prefill it faster). A request whose prompt another sequence is prefilling waits
for it and is forked from it in the step that completes the prompt (engine/shares.py); one whose prompt begins
with a prompt the prefix cache keeps starts from its state and prefills only the rest, and the state of each
prompt a step completes is kept, and of each branch point a prefill reaches (engine/prefix_cache.py: a prompt
sharing a long beginning with a kept one stops its prefill where they part, once; one sharing it with a prompt
being prefilled waits for that prefill to stop there). Requests that wait for another's prefill are passed
over in the queue, a slot left for each: those behind them start meanwhile. A preempted sequence
gives back its slot and pages and waits at the head of the queue; when readmitted, its prompt and generated
tokens are prefilled again (nothing is emitted twice). The runner executes the resulting `StepPlan`; the engine applies the results.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from deltaflash.cache.pages import PageAllocator, pages_for
from deltaflash.cache.slots import SlotTable
from deltaflash.core.request import Sequence, Status
from deltaflash.engine.config import EngineConfig
from deltaflash.engine.graphs import (PREFILL_ROWS, long_chunk_runs_eagerly, pads_within_reason, prefill_graph_buckets,
                                      prefill_graph_for, prefill_graph_sizes, prefill_shapes, prefill_tile)
from deltaflash.engine.prefix_cache import MIN_TOKENS, CachedPrompt, PrefixCache, shared_tokens
from deltaflash.engine.shares import PromptShares
from deltaflash.speculative.policy import RoundCosts, TreeChoice, WidthPolicy


@dataclass(frozen=True)
class Pin:
    """What Scheduler.pinned fixes for every round: a width (adaptive engines), trees or chains (tree
    engines); None: not fixed."""

    width: int | None = None
    trees: bool | None = None


@dataclass(frozen=True, eq=False)
class PrefillChunk:
    """Prefill tokens [start, start + len(tokens)) of `seq` (its prompt, or after a preemption its prompt
    and generated tokens; int64, read only); `last`: the chunk completes them; `emits`: the last chunk of a
    sequence that has generated nothing yet (its first token is sampled from the chunk's last row)."""

    seq: Sequence
    start: int
    tokens: np.ndarray
    last: bool
    emits: bool = False


@dataclass(frozen=True, eq=False)
class Fork:
    """`seq` forked from `leader` after their common prompt, which the step's prefill chunk `chunk` completes:
    the runner copies the leader's slot state into seq's slot, and its partial last prompt page into seq's
    own where the prompt ends inside a page (`page`: (leader's page, seq's page), or None), and samples
    seq's first token from the chunk's last row (engine/shares.py)."""

    seq: Sequence
    leader: Sequence
    chunk: int
    page: tuple[int, int] | None


@dataclass(frozen=True, eq=False)
class Restore:
    """`seq` starts from a kept prompt's state (engine/prefix_cache.py): row `row` of the saved state, its
    first `tokens` positions prefilled; `page`: (the kept prompt's partial last page, seq's copy), or None."""

    seq: Sequence
    row: int
    tokens: int
    page: tuple[int, int] | None


@dataclass(frozen=True, eq=False)
class Snapshot:
    """The state of `seq`'s slot after this step's prefill (its whole prompt, or up to its branch point) is saved
    to row `row`."""

    seq: Sequence
    row: int


@dataclass(frozen=True)
class StepPlan:
    """What one step runs.

    admitted: sequences given a slot this step (the runner resets those slots first).
    cancelled: sequences retired before the step (their slots and pages are free again).
    preempted: sequences sent back to the queue this step to free pages (slot and pages given back).
    saves: (slot, row) - the states of sequences finished since the last plan that the prefix cache keeps, which
        the runner copies to those rows of saved state before anything else (the slots may be taken again).
    released: slots whose pages were given back since the last plan (the runner points their table
        entries at the sink first, so no stale entry can reach a page another sequence now holds).
    pages: (slot, table index, page) entries granted this step (the runner maps them after that).
    prefill: prompt chunks, in order. forks: sequences given a slot this step as forks of a sequence whose
        prompt the step's prefill completes (their pages are among `pages`). restores: admitted sequences that start
        from a kept prompt's state (the runner restores it after the reset). snapshots: slots whose state the
        runner saves after the step's prefill (a prompt the prefix cache keeps from now on).
    decode: the round's lanes; widths[i]: 1 + the drafts lane i may accept; round_width: rows per lane of the verify forward (1, the block size W, or in a tree round
    the tree's nodes: each has a CUDA graph); tree_budget: the round verifies trees of that many nodes
    (0: chains). prefill_budget: the most prompt tokens the step could prefill (Scheduler.prefill_budget).
    prefill_graph: (rows T, lanes) of the prefill graph that replays the step's chunks - those that score no
    prompt (prompt logprobs are read from an eager forward of their own) - or None: they run eagerly
    (Scheduler.prefill_graph). A runner without prefill graphs runs them eagerly whatever it says.
    """

    admitted: tuple[Sequence, ...] = ()
    cancelled: tuple[Sequence, ...] = ()
    preempted: tuple[Sequence, ...] = ()
    saves: tuple[tuple[int, int], ...] = ()
    released: tuple[int, ...] = ()
    pages: tuple[tuple[int, int, int], ...] = ()
    prefill: tuple[PrefillChunk, ...] = ()
    forks: tuple[Fork, ...] = ()
    restores: tuple[Restore, ...] = ()
    snapshots: tuple[Snapshot, ...] = ()
    decode: tuple[Sequence, ...] = ()
    widths: tuple[int, ...] = ()
    round_width: int = 1
    tree_budget: int = 0
    prefill_budget: int = 0
    prefill_graph: tuple[int, int] | None = None

    @property
    def runs_anything(self) -> bool:
        return bool(self.admitted or self.prefill or self.decode)


class Scheduler:
    def __init__(self, config: EngineConfig, num_pages: int, policy: WidthPolicy | None = None,
                 tree_choice: TreeChoice | None = None, costs: RoundCosts | None = None, dense_prefill: bool = False):
        """policy: chooses each round's width (load-adaptive speculation); None: the block, always.
        tree_choice: a tree engine's choice of trees or chains per round (config.costed_trees); None: the
        fixed rule (config.trees_for). costs: the rounds' costs, which scale the prefill budget beside a
        speculative round (config.scale_prefill_budget); None: the budget is not scaled. dense_prefill: a
        prompt's later chunk may attend over its gathered context (ModelRunner.dense_prefill), which only an
        eager step does (prefill_graph)."""
        self.config, self.policy, self.tree_choice, self.costs = config, policy, tree_choice, costs
        self.dense_prefill = dense_prefill
        self.pin = Pin()  # nothing pinned: the policy and the tree choice decide (see pinned)
        # the rows of prefill-graph work an eager prefill step's launching costs (ModelRunner.eager_prefill_rows;
        # measured on CUDA at start): 0 weighs an eager step by its rows alone, and prompts are then never cut
        self.eager_prefill_rows = 0.0
        self.slots = SlotTable(config.max_slots)
        self.pages = PageAllocator(num_pages, config.page_size, config.max_slots)
        # pages kept free when admitting beside running sequences, so their next rounds rarely preempt
        self.watermark = max(1, num_pages // 100)
        self.waiting: deque[Sequence] = deque()
        self.running: dict[str, Sequence] = {}  # admission order
        self.preemptions = 0
        self._released: list[int] = []  # slots whose pages went back since the last plan
        self._cancels = 0  # abort calls since the last plan (none: no sequence to look for)
        self.shares = PromptShares()  # who waits to fork from whom (config.share_prompts)
        self.prefix = PrefixCache(config.prefix_cache) if config.prefix_cache else None
        self._branches: dict[str, int] = {}  # request id -> the branch point its prefill stops at (prefix_cache.py)
        self._saves: list[tuple[int, int]] = []  # (slot, row): finished sequences' states the prefix cache keeps
        self._prompt_keys: dict[str, list[int]] = {}  # request id -> its prompt's block keys, once it was prefilled

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        if self.config.share_prompts:
            self.shares.add(seq)

    def abort(self, request_id: str) -> None:
        """Cancel a request; it is retired at the next step boundary."""
        for seq in self.waiting:
            if seq.request_id == request_id:
                seq.cancel_requested = True
                self._cancels += 1
        if request_id in self.running:
            self.running[request_id].cancel_requested = True
            self._cancels += 1

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str, dropped: int | None = None) -> None:
        """Retire a sequence: its slot and pages are free for the next admission. `dropped`: how many of the
        tokens its last step produced the output did not take (a stop token or the grammar's end cut them off;
        None: retired between steps). A step commits the state through all of them but the last, so the slot's
        state holds the sequence's tokens but the pending one (none dropped) or all of them (the last dropped):
        the prefix cache keeps it, for a next turn that sends the answer back (the runner saves it first thing
        next step). Where more were dropped the state is past the answer's end."""
        seq.finish_reason, seq.status = reason, Status.FINISHED
        held = seq.position + dropped if dropped is not None and dropped <= 1 else 0  # tokens the state holds
        if self.prefix is not None and held >= MIN_TOKENS and held > len(seq.prompt_ids):
            answer = np.asarray(seq.output_ids[:held - len(seq.prompt_ids)], dtype=np.int64)
            tokens = np.concatenate([seq.prompt_array, answer])
            row = self._keep(tokens, self.prefix.keys(tokens, self._prompt_keys.get(seq.request_id, ())), seq.slot)
            if row is not None:
                self._saves.append((seq.slot, row))
        self._free(seq)
        self.running.pop(seq.request_id, None)
        self.shares.forget(seq)

    def _free(self, seq: Sequence) -> None:
        self._branches.pop(seq.request_id, None)
        self._prompt_keys.pop(seq.request_id, None)
        if seq.slot >= 0:
            self.pages.release(seq.slot)
            self._released.append(seq.slot)
            self.slots.give_back(seq.slot)
            seq.slot = -1

    def schedule(self) -> StepPlan:
        cancelled = self._retire_cancelled()
        decode, (widths, round_width, tree_budget), preempted, short = self._make_room()
        grants = [g for slot, tokens in short for g in self.pages.grow(slot, tokens)]
        admitted, restores, size = [], [], self.config.page_size
        # requests that wait for another's prefill (a leader's prompt, a branch point) are passed over - those behind
        # them need not wait for it too - and a slot is left for each: the queue's first `passed` requests
        passed = 0
        while not preempted and passed < len(self.waiting) and self.slots.num_free > passed:  # (no readmission
            seq = self.waiting[passed]                                                      # in a step that preempts)
            if self._follows(seq):
                passed += 1  # it forks when its leader's prompt is done (_forks)
                continue
            kept, branch = self._kept_prefix(seq)
            start = len(kept.tokens) if kept is not None else 0  # positions the kept prompt's pages hold
            if self._awaits_branch(seq, start):
                passed += 1  # it starts where a prompt prefilling now stops for it
                continue
            need = pages_for(seq.prefill_len, size) - start // size
            while need > self.pages.num_free - (self.watermark if self.running else 0) and self._evict(kept):
                pass
            if need > self.pages.num_free - (self.watermark if self.running else 0):
                break  # first come, first served: nobody overtakes a request waiting for pages
            del self.waiting[passed]
            seq.slot, seq.status, seq.num_prefilled = self.slots.take(), Status.PREFILLING, start
            seq.cached_tokens = start
            if branch:
                self._branches[seq.request_id] = branch
            if kept is not None:
                grants += self.pages.adopt(seq.slot, kept.pages[:start // size])
            grants += self.pages.grow(seq.slot, seq.prefill_len)
            if kept is not None:
                page = (kept.pages[start // size], self.pages.held[seq.slot][start // size]) if start % size else None
                restores.append(Restore(seq, kept.row, start, page))
                self.prefix.touch(kept)
            self.running[seq.request_id] = seq
            admitted.append(seq)
        released, self._released = tuple(self._released), []
        saves, self._saves = tuple(self._saves), []
        budget = self.prefill_budget(len(decode), round_width)
        fill = bool(decode) and self._scaled(round_width) and bool(self.config.prefill_graphs)
        prefill = tuple(self._prefill_chunks(budget, self.prefill_slack(budget, len(decode), round_width), fill))
        budget = max(budget, sum(len(c.tokens) for c in prefill))  # (the plan's: what the step could take)
        forks = self._forks(prefill, grants, passed) if not preempted else ()
        graph = self.prefill_graph([c for c in prefill if c.seq.params.prompt_logprobs is None], alone=not decode)
        return StepPlan(admitted=tuple(admitted), cancelled=tuple(cancelled), preempted=tuple(preempted),
                        saves=saves, released=released, pages=tuple(grants), prefill=prefill, forks=tuple(forks),
                        restores=tuple(restores), snapshots=tuple(self._snapshots(prefill)),
                        decode=tuple(decode), widths=tuple(widths), round_width=round_width, tree_budget=tree_budget,
                        prefill_budget=budget, prefill_graph=graph)

    def prefill_graph(self, chunks: list[PrefillChunk], alone: bool) -> tuple[int, int] | None:
        """(rows T, lanes) of the prefill graph that replays `chunks` (`alone`: the step decodes nothing), or
        None where they run eagerly: without prefill graphs, where no graph holds them or one would pad past
        reason (prefill_graph_for, with the eager step's measured cost), and for a long prompt's long later
        chunk at an idle engine, whose attention over its gathered context no graph can run
        (long_chunk_runs_eagerly)."""
        if not chunks or not self.config.prefill_graphs:
            return None
        one = chunks[0]
        if self.dense_prefill and alone and len(chunks) == 1 and \
                long_chunk_runs_eagerly(one.start, len(one.tokens), self.eager_prefill_rows):
            return None
        return prefill_graph_for([len(c.tokens) for c in chunks], self._graph_buckets(), self.eager_prefill_rows)

    def _graph_buckets(self) -> dict[int, tuple[int, ...]]:
        """Each prefill graph shape's lane buckets: the runner captures the same table."""
        return prefill_graph_buckets(*prefill_graph_sizes(self.config))

    def _kept_prefix(self, seq: Sequence) -> tuple[CachedPrompt | None, int]:
        """(the longest prompt the prefix cache keeps that `seq`'s tokens to prefill begin with, or None; the
        branch point its prefill stops at to keep the state there, or 0) - neither for a request scoring its
        prompt: every row of it is needed."""
        if self.prefix is None or not self.prefix.entries or seq.params.prompt_logprobs is not None:
            return None, 0
        kept, shared = self.prefix.match(seq.prefill_array(0, seq.prefill_len))
        return kept, self.prefix.branch_point(shared, len(kept.tokens) if kept is not None else 0, seq.prefill_len)

    def _awaits_branch(self, seq: Sequence, start: int) -> bool:
        """Whether `seq` (waiting, able to start from a kept prompt of `start` tokens) waits for a
        prompt being prefilled to reach the end of the beginning they share, to start from there: where that
        skips BRANCH_MIN_TOKENS more (PrefixCache.branch_point) and the other prefill is not past that point,
        it stops there (its branch point, unless it has another) and its state is kept - a burst of questions
        after one system prompt prefills the system prompt once."""
        if self.prefix is None or seq.params.prompt_logprobs is not None:
            return False
        tokens = seq.prefill_array(0, seq.prefill_len)
        for other in self.running.values():
            if other.status is Status.PREFILLING:
                point = self.prefix.branch_point(shared_tokens(tokens, other.prefill_array(0, other.prefill_len)),
                                                 start, len(tokens))
                if other.num_prefilled < point and self._branches.setdefault(other.request_id, point) == point:
                    return True
        return False

    def _evict(self, keep: CachedPrompt | None = None) -> bool:
        """Drop the least recently used kept prompt but `keep`, its pages given back; False when none is left."""
        entry = self.prefix.evict(keep) if self.prefix is not None else None
        if entry is not None:
            self.pages.unkeep(entry.pages)
        return entry is not None

    def clear_prefix_cache(self) -> None:
        """Drop every kept prompt (the engine's warm-up requests are nobody's prefix), and the finished states
        still to be saved for them."""
        while self._evict():
            pass
        self._saves.clear()

    def _snapshots(self, chunks: tuple[PrefillChunk, ...]) -> list[Snapshot]:
        """The prompts of at least MIN_TOKENS tokens the `chunks` complete, and the branch points they reach, kept
        from this step on: a row of saved state each (the least recently used entry evicted when none is free)
        and their pages held. Tokens kept already are only marked used."""
        if self.prefix is None:
            return []
        snapshots = []
        for chunk in chunks:
            seq, end = chunk.seq, chunk.start + len(chunk.tokens)
            if end == self._branches.get(seq.request_id):
                del self._branches[seq.request_id]
                tokens = seq.prefill_array(0, end)
            elif chunk.emits and len(seq.prompt_ids) >= MIN_TOKENS:
                tokens = seq.prompt_array
            else:
                continue
            keys = self.prefix.keys(tokens)
            if tokens is seq.prompt_array:
                self._prompt_keys[seq.request_id] = keys  # (its answer's entry goes on from them: finish)
            row = self._keep(tokens, keys, seq.slot)
            if row is not None:
                snapshots.append(Snapshot(seq, row))
        return snapshots

    def _keep(self, tokens: np.ndarray, keys: list[int], slot: int) -> int | None:
        """`tokens` (whose blocks' keys are `keys`), whose state slot `slot` holds (or will after this step's
        prefill), kept by the prefix cache with the pages holding them: the row of saved state to copy that state to
        (the least recently used entry evicted when none is free), or None where they are kept already (only marked
        used)."""
        kept = self.prefix.kept(tokens, keys)
        if kept is not None:
            self.prefix.touch(kept)
            return None
        pages = self.pages.held[slot][:pages_for(len(tokens), self.config.page_size)]
        entry = self.prefix.add(tokens, pages, keys)
        if entry is None and self._evict():
            entry = self.prefix.add(tokens, pages, keys)
        self.pages.keep(pages)
        return entry.row

    def _follows(self, seq: Sequence) -> bool:
        """Whether `seq` (waiting) waits for its leader, which is prefilling their prompt. A
        follower whose leader is anywhere else goes on alone (PromptShares keeps leaders ahead of their
        followers: a leader waiting is ahead in the queue, so this is only a safeguard)."""
        leader = self.shares.leader(seq)
        if leader is not None and leader.status is not Status.PREFILLING:
            self.shares.forget(seq)
            return False
        return leader is not None

    def _forks(self, chunks: tuple[PrefillChunk, ...], grants: list[tuple[int, int, int]], passed: int) -> list[Fork]:
        """The step's forks: the sequences at the head of the queue whose leader's prompt one of the `chunks`
        completes, while slots and pages (within the watermark) are free, in queue order - past the queue's first
        `passed` requests that wait for another prefill (schedule), a slot left for each. A fork holds the
        leader's whole prompt pages with it and takes a page of its own for the rest; its page entries go into
        `grants`. Then those leaders lead no more: their followers left go on alone (PromptShares.forget)."""
        ending = {id(c.seq): i for i, c in enumerate(chunks) if c.emits}
        if not ending:
            return []
        forks, size, i = [], self.config.page_size, 0
        while i < len(self.waiting) and self.slots.num_free > i:
            seq = self.waiting[i]
            leader = self.shares.leader(seq)
            if leader is None or id(leader) not in ending:
                if i >= passed:
                    break
                i += 1
                continue
            n = len(seq.prompt_ids)
            whole = n // size  # pages the prompt fills: held with the leader; a partial last one is copied
            if pages_for(n, size) - whole > self.pages.num_free - self.watermark:
                break
            del self.waiting[i]
            passed -= i < passed
            self.shares.forget(seq)
            seq.slot, seq.status, seq.num_prefilled = self.slots.take(), Status.PREFILLING, n
            seq.cached_tokens = n
            grants += self.pages.share(leader.slot, seq.slot, whole) + self.pages.grow(seq.slot, n)
            page = (self.pages.held[leader.slot][whole], self.pages.held[seq.slot][whole]) if n % size else None
            self.running[seq.request_id] = seq
            forks.append(Fork(seq, leader, ending[id(leader)], page))
        for i in ending.values():
            self.shares.forget(chunks[i].seq)
        return forks

    def prefill_budget(self, lanes: int, round_width: int) -> int:
        """Prompt tokens a step may prefill beside a round of `lanes` lanes x `round_width` rows: the idle
        budget with no lane; else the step budget (stall_budget: held to the running streams' stall), and
        beside a speculative round with costs to go by (config.scale_prefill_budget) that times the round's
        cost over a plain round's, at most config.round_prefill_tokens."""
        config = self.config
        if not lanes:
            return config.idle_prefill_tokens
        budget = self.stall_budget(lanes)
        if not self._scaled(round_width):
            return budget
        scaled = int(budget * self.costs.cost_ratio(lanes, round_width))
        return max(budget, min(scaled, config.round_prefill_tokens))

    def stall_budget(self, lanes: int) -> int:
        """The step budget beside a plain round of `lanes` lanes: config.max_num_batched_tokens, or, with
        config.max_prefill_stall S and the measured cost of prompt rows beside a round (RoundCosts.prefill),
        the rows whose prefill costs S plain rounds (so a step with a prompt chunk takes about 1 + S rounds: a
        stream's inter-token p99 against its p50), at least PREFILL_ROWS - or the step budget where even
        those would cost more (PrefillCost.tokens_within). With prefill graphs, rows below the step budget
        go down to a graph's chunk rows (prefill_tile): a chunk of 451 tokens would replay the 512-row graph
        and cost what 512 rows do."""
        budget, stall, costs = self.config.max_num_batched_tokens, self.config.max_prefill_stall, self.costs
        if not stall or costs is None:
            return budget
        rows = costs.prefill.tokens_within(stall * costs.cost(costs.bucket(lanes), 1), min(PREFILL_ROWS, budget),
                                           budget)
        if rows < budget and self.config.prefill_graphs and rows != prefill_tile(rows):
            rows = max(PREFILL_ROWS, prefill_tile(rows) // 2)
        return min(rows, budget)

    def prefill_slack(self, budget: int, lanes: int, round_width: int) -> int:
        """Tokens a scaled budget (prefill_budget) may be exceeded by to finish a prompt: an eighth of it, within
        config.round_prefill_tokens (the prefill graphs' reach). A prompt cut a few tokens short of its end
        would take a graph lane of its own, padded to a whole chunk, in the next step (the C = 64 wave of
        256-token prompts under a ~745-token budget: 23-token rests in 4 x 256-row steps). The step budget
        and the idle budget are the user's, exact."""
        if not lanes or not self._scaled(round_width):
            return 0
        return max(0, min(budget // 8, self.config.round_prefill_tokens - budget))

    def _scaled(self, round_width: int) -> bool:
        """Whether a step beside a round of `round_width` rows scales its prefill budget (a speculative round)."""
        return round_width > 1 and self.costs is not None and self.config.scale_prefill_budget

    def width(self, seq: Sequence) -> int:
        """Most rows the sequence may verify this round: the block, or fewer when fewer tokens are left."""
        return max(1, min(self.config.block_size, seq.remaining))

    def widths(self, decode: list[Sequence]) -> tuple[list[int], int, int]:
        """(each lane's width: 1 + the drafts it may accept, the round's rows per lane, the round's tree
        budget or 0 for chains): the policy's choice, or every lane at its most and the block - a tree's
        nodes when the round verifies trees (trees()) - when any speculates."""
        if self.config.block_size <= 1:  # no drafter: every lane decodes one row
            return [1] * len(decode), 1, 0
        caps = [self.width(s) for s in decode]
        if self.pin.width is not None:
            lanes = [min(self.pin.width, cap) for cap in caps]
            return lanes, (self.pin.width if any(w > 1 for w in lanes) else 1), 0
        if self.policy is not None and decode:  # (adaptive engines verify chains: config.adaptive excludes trees)
            round_width, lanes = self.policy.choose(decode, caps)
            return lanes, round_width, 0
        if not any(w > 1 for w in caps):
            return caps, 1, 0
        if self.trees(decode):
            return caps, self.config.tree_budget, self.config.tree_budget
        return caps, self.config.block_size, 0

    def trees(self, decode: list[Sequence]) -> bool:
        """Whether a speculative round of these lanes verifies trees: always when one is a seeded sampled
        request (its output must not depend on the load), else the tree choice or the fixed rule."""
        if not self.config.tree_budget:
            return False
        if self.pin.trees is not None:
            return self.pin.trees
        if any(s.params.seeded_sampling for s in decode):
            return True
        if self.tree_choice is not None:
            return self.tree_choice.choose(len(decode))
        return self.config.trees_for(len(decode))

    @contextmanager
    def pinned(self, width: int | None = None, trees: bool | None = None) -> Iterator[None]:
        """Within: every round at `width` with every lane at its most (an adaptive engine's widths), or
        every speculative round trees / chains (`trees`), whatever the policy or the tree choice would
        pick - the warm-up runs each graph it captures this way."""
        self.pin = Pin(width, trees)
        try:
            yield
        finally:
            self.pin = Pin()

    def reach(self, round_width: int) -> int:
        """Positions past its committed length that a round of `round_width` rows writes for every lane
        (whatever its own width): the verify rows, and the drafter's block when the round drafts."""
        return max(round_width, self.config.block_size) if round_width > 1 else 1

    def _make_room(self) -> tuple[list[Sequence], tuple[list[int], int, int], list[Sequence], list[tuple[int, int]]]:
        """The round's lanes and what widths() chose for them, after preempting the most recently admitted sequences
        until the pages every lane's rows reach are free (prefilling sequences took theirs at admission);
        and the (slot, positions) of the lanes that must take pages for it."""
        preempted = []
        while True:
            decode = [s for s in self.running.values() if s.status is Status.DECODING]
            chosen = self.widths(decode)  # (lane widths, round width, tree budget)
            reach = self.reach(chosen[1])
            short = self.pages.short_of([s.slot for s in decode], [s.position + reach for s in decode])
            if sum(self.pages.missing(slot, tokens) for slot, tokens in short) <= self.pages.num_free:
                return decode, chosen, preempted, short
            if self._evict():  # kept prompts go before running sequences
                continue
            victim = next(reversed(self.running.values()))
            self._preempt(victim)
            preempted.append(victim)

    def _preempt(self, seq: Sequence) -> None:
        """Give back the sequence's slot and pages and queue it first; it is recomputed when readmitted."""
        self._free(seq)
        del self.running[seq.request_id]
        seq.status, seq.num_prefilled = Status.WAITING, 0
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    def _prefill_chunks(self, budget: int, slack: int = 0, fill: bool = False) -> list[PrefillChunk]:
        """Prompt chunks of at most `budget` tokens in all, oldest prompt first; a prompt whose rest would be
        at most `slack` tokens goes in whole (the step then takes up to `slack` more: prefill_slack) where
        the whole pads to the same graph shape as the cut chunk. `fill` (a scaled budget, prefill graphs): a
        chunk the budget cuts grows to its graph's rows (prefill_tile; within config.round_prefill_tokens),
        prompt tokens in place of padding the replay would compute anyway - a 768-token cut of a long prompt
        replays the 1024-row graph, so it takes 1024 tokens for the same device time - where the step replays
        a graph (pads_within_reason, by the rule prefill_graph decides by; not where its padding sends it down
        the eager path, where rows cost).
        With prefill graphs, several prompts are cut to the rows of a graph the step can replay
        (_graph_fit) where they would not fit one whole."""
        waiting = [seq for seq in self.running.values() if seq.status is Status.PREFILLING and seq.prompt_left > 0]
        rows, lanes = self._graph_fit(waiting, budget, slack, fill) if self.config.prefill_graphs and len(waiting) > 1 \
            else (budget, len(waiting))
        chunks = []
        for seq, n in zip(waiting, self._chunk_lens(waiting, budget, rows, lanes, slack, fill)):
            start = seq.num_prefilled
            last = n == seq.prompt_left
            chunks.append(PrefillChunk(seq, start, seq.prefill_array(start, start + n), last,
                                       emits=last and not seq.output_ids))
        return chunks

    def _chunk_lens(self, waiting: list[Sequence], budget: int, rows: int, lanes: int, slack: int,
                    fill: bool) -> list[int]:
        """The tokens each of the first `lanes` waiting prompts takes in a step of `budget` tokens, cut at
        `rows` each: _prefill_chunks' rule, which _graph_fit also plays through for each graph shape."""
        lens: list[int] = []
        for seq in waiting[:lanes]:
            if budget <= 0:
                break
            left = self._left(seq)
            n = min(left, budget, rows)
            if left - n <= slack and prefill_tile(left) == prefill_tile(n):
                n = left  # (not where the whole would need a longer graph shape than the cut)
            elif fill and n < left and prefill_tile(n) <= self.config.round_prefill_tokens and \
                    pads_within_reason(len(lens) + 1, prefill_tile(max(lens + [n])), sum(lens) + n,
                                       self.eager_prefill_rows):
                n = min(left, prefill_tile(n))
            lens.append(n)
            budget -= n
        return lens

    def _left(self, seq: Sequence) -> int:
        """The tokens `seq`'s next prefill chunk may take: up to its branch point first (prefix_cache.py)."""
        branch = self._branches.get(seq.request_id, 0)
        return (branch if branch > seq.num_prefilled else seq.prefill_len) - seq.num_prefilled

    def _graph_fit(self, waiting: list[Sequence], budget: int, slack: int = 0, fill: bool = False) -> tuple[int, int]:
        """(most rows per chunk, most chunks) of a step prefilling the `waiting` prompts with prefill graphs.
        Cut by the budget alone, prompts of straddling lengths often make a step no graph holds (16 prompts
        of 80-150 tokens need 16 lanes of 256 rows) or one padded past reason, which the runner launches
        eagerly (the demo pair: ~20 ms of host time; its graphs ~1 ms). Each graph shape (prefill_shapes: T,
        most lanes) could take them cut to T rows instead. Of the cuts whose prompt tokens per graph row beat
        the eager step's tokens per row-equivalent (its rows, or the eager_prefill_rows its launching costs
        where more), the one taking the most tokens is taken, the larger T among equals. Otherwise, and where
        the step replays a graph uncut, no cut. Each plan is played through _chunk_lens with the step's slack
        and fill, so the chunks scored are the chunks taken."""
        def step(rows: int, most: int) -> tuple[int, ...]:
            return tuple(self._chunk_lens(waiting, budget, rows, most, slack, fill))

        shapes, buckets = prefill_shapes(*prefill_graph_sizes(self.config)), self._graph_buckets()

        def graph_rows(lens: tuple[int, ...]) -> int | None:
            """The rows the runner's graph for these chunks computes; None: the step runs eagerly."""
            fit = prefill_graph_for(lens, buckets, self.eager_prefill_rows)
            return None if fit is None else fit[0] * fit[1]

        uncut = step(budget, len(waiting))
        if graph_rows(uncut) is not None or not self.eager_prefill_rows:
            return budget, len(waiting)
        eager = sum(uncut) / max(sum(uncut), self.eager_prefill_rows)  # tokens per row-equivalent
        cuts = [(sum(lens), T, most) for T, most in shapes
                if (rows := graph_rows(lens := step(T, most))) is not None and sum(lens) / rows > eager]
        best = max(cuts, default=None)
        return (budget, len(waiting)) if best is None else (best[1], best[2])

    def _retire_cancelled(self) -> list[Sequence]:
        if not self._cancels:
            return []
        self._cancels = 0
        gone = [s for s in self.waiting if s.cancel_requested]
        for seq in gone:
            self.waiting.remove(seq)
            seq.finish_reason, seq.status = "cancelled", Status.FINISHED
            self.shares.forget(seq)
        for seq in [s for s in self.running.values() if s.cancel_requested]:
            self.finish(seq, "cancelled")
            gone.append(seq)
        return gone
