"""Where drafts come from. A draft source proposes W-1 tokens per lane (and the q they were drawn
from, for sampled lanes) and keeps whatever per-slot context it needs.

- `DFlashSource`: a DFlash / DFlash2 drafter conditioned on target tap features (DESIGN.md §1.2).
- `ScriptedSource`: replays a recorded continuation with a set fraction of corrupted tokens, to run
  the engine at a chosen acceptance (tests, and benchmarks labelled "scripted").

Every source has the same surface (`DraftSource`); the runner calls it and never looks inside.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from deltaflash.cache.draft_context import DraftContextCache
from deltaflash.cache.pages import BlockTables
from deltaflash.core.batch import to_device
from deltaflash.core.request import Sequence as Seq
from deltaflash.models.vocab import Vocab
from deltaflash.ops.kernels import Kernels, reference_kernels
from deltaflash.ops.tree.naive import build_ranked_tree_ref
from deltaflash.speculative.draft import choose_tokens, draft_hidden, full_vocab_probs
from deltaflash.speculative.sampling import ALL_GREEDY, LaneSampling
from deltaflash.speculative.tree import DraftTree, build_tree, dflash2_children, dflash_candidates

# (name, fn, per-lane input specs [(shape, dtype, padding value)]) -> an object whose `run(*inputs)`
# replays fn from CUDA graphs (None when no graph fits), or None: the runner's graph factory
GraphFactory = Callable[[str, Callable, Sequence[tuple]], object]


class DraftSource(Protocol):
    block_size: int                   # W: rows a speculating lane verifies (anchor + W-1 drafts)
    tap_layer_ids: tuple[int, ...]    # target layers whose hidden states the source reads

    def use_kernels(self, kernels: Kernels) -> None:
        """Draft (and build trees) with the engine's kernel set (the runner calls this once, at start)."""

    def reset(self, slot: int) -> None:
        """Forget the slot's context (admission of a new sequence)."""

    def copy_pages(self, pages: Tensor) -> None:
        """pages [2, N] (device int64): the context in page pages[0, j] is copied into page pages[1, j] (a
        fork's partial prompt page: engine/shares.py; the whole pages it reads with its leader)."""

    def append(self, slot_ids: Tensor, positions: Tensor, taps: Tensor | None, graphs: bool = True) -> None:
        """Committed rows become context: slot_ids [L, T] (-1: a row that was not committed, or a
        padding lane), positions [L, T], taps [L, T, n_taps*H]. graphs=False: run eagerly (the call is
        itself being captured into a CUDA graph)."""

    def draft(self, seqs: Sequence[Seq], slot_ids: Tensor, anchors: Tensor, start: Tensor,
              sampling: LaneSampling) -> tuple[Tensor, Tensor | None]:
        """(drafts [L, W-1] long, q [L, W-1, V] fp32 the drafts were drawn from, or None when the drafts
        are deterministic or every lane is greedy). Lanes past len(seqs) are padding (slot -1)."""

    def draft_tree(self, seqs: Sequence[Seq], slot_ids: Tensor, anchors: Tensor, start: Tensor, budget: int,
                   top_k: int) -> DraftTree:
        """Trees of `budget` nodes over W-1 depths, top_k candidates per depth (speculative/tree.py)."""


def pad_rows(slot_ids: Tensor, positions: Tensor, taps: Tensor, width: int) -> tuple[Tensor, Tensor, Tensor]:
    """Committed rows [L, T] padded to `width` columns with rows that land nowhere (slot -1)."""
    extra = width - slot_ids.shape[1]
    if not extra:
        return slot_ids, positions, taps
    return (F.pad(slot_ids, (0, extra), value=-1), F.pad(positions, (0, extra)), F.pad(taps, (0, 0, 0, extra)))


class DFlashSource:
    def __init__(self, drafter, vocab: Vocab, tables: BlockTables,
                 block_size: int = 0, graph_factory: GraphFactory | None = None, kernels: Kernels | None = None,
                 tree: tuple[int, int] | None = None, chains: bool = True):
        """vocab: the target's embedding and lm_head (models/vocab.py). tables: the target's block tables (the context lives in pages of the same ids). block_size: the
        verify width W (default: the drafter's own). graph_factory: when given, the block forward and the
        context append replay CUDA graphs per lane bucket (the reference attention then reads the whole
        table, a fixed shape; the Triton kernel reads each lane's own length). kernels: the engine's kernel
        set (paged attention, and for DFlash trees the vocabulary top-k and the tree builder; default the
        reference set). tree: (budget, top_k) of the engine's draft trees: with graphs, the block forward
        and the tree built from it replay as one. chains: whether an engine of trees also drafts chains (its
        rounds of many lanes): the block forward's graphs are captured then too."""
        self.drafter, self.vocab = drafter, vocab
        c = drafter.config
        self.block_size = block_size or c.block_size
        self.tap_layer_ids = tuple(c.target_layer_ids)
        self.kernels = kernels if kernels is not None else reference_kernels()
        self.context = DraftContextCache(tables, num_layers=c.num_layers, num_kv_heads=c.num_kv_heads,
                                         head_dim=c.head_dim, dtype=drafter.dtype, device=vocab.device)
        self.block_graphs = self.append_graphs = None
        if graph_factory is not None:
            W, taps = self.block_size, len(self.tap_layer_ids) * c.hidden_size
            lane = ((), torch.long, -1), ((), torch.long, 0), ((), torch.long, 0)
            if tree is None or chains:  # tree rounds draft through the tree graph below
                self.block_graphs = graph_factory("drafter block", self._block_shares, lane)
            rows = ((W,), torch.long, -1), ((W,), torch.long, 0), ((W, taps), vocab.dtype, 0)
            self.append_graphs = graph_factory("drafter context append", self._append_rows, rows)
        self.tree, self.tree_graphs = tree, None
        if graph_factory is not None and tree is not None:
            self.tree_graphs = graph_factory(f"drafter tree of {tree[0]}", self._tree_nodes, lane)

    def use_kernels(self, kernels: Kernels) -> None:
        self.kernels = kernels

    def reset(self, slot: int) -> None:
        self.context.reset(slot)

    def copy_pages(self, pages: Tensor) -> None:
        self.context.copy_pages(pages)

    def append(self, slot_ids: Tensor, positions: Tensor, taps: Tensor | None, graphs: bool = True) -> None:
        if taps is None:
            return
        T, W = slot_ids.shape[1], self.block_size
        if graphs and self.append_graphs is not None and T <= W:  # rounds up to the block's width replay its graph (narrower
            if self.append_graphs.run(*pad_rows(slot_ids, positions, taps, W)) is not None:  # ones padded: adaptive
                return  # widths, a tree's path)
        self._append_rows(slot_ids, positions, taps)

    def _append_rows(self, slot_ids: Tensor, positions: Tensor, taps: Tensor):
        keys, values = self.drafter.project_context(taps.flatten(0, 1), positions.flatten())
        self.context.append(slot_ids.flatten(), positions.flatten(), keys, values)
        return ()

    def _block_logits(self, slot_ids, anchors, start, max_context_len: int | None = None, gather: bool = True):
        """The block's hidden [L, W-1, H] and logits [L, W-1, V] of the drafted slots (gather False: this
        rank's vocabulary share of the logits under tensor parallelism)."""
        hidden = draft_hidden(self.drafter, self.context, self.vocab, slot_ids, anchors, start,
                              self.block_size, max_context_len=max_context_len,
                              attend=self.kernels.paged_attention)[:, 1:]
        return hidden, self.drafter.logits(hidden, self.vocab, gather)

    def _block_shares(self, slot_ids, anchors, start):
        """What the block graph captures: the block with its logits ungathered (`draft` gathers them
        only when it needs whole rows)."""
        return self._block_logits(slot_ids, anchors, start, gather=False)

    def draft(self, seqs, slot_ids, anchors, start, sampling):
        hidden, logits = self._block(seqs, slot_ids, anchors, start)
        if self.vocab.sharded:  # a vocabulary-parallel target: greedy DFlash drafts are argmaxes of the shares
            if sampling.all_greedy and self.drafter.config.variant != "dflash2":
                return self.vocab.argmax(logits), None
            logits = self.vocab.gather(logits.contiguous())
        picked = choose_tokens(self.drafter, hidden, logits, torch.where(slot_ids < 0, 0, anchors), sampling)
        return picked.tokens, full_vocab_probs(picked, logits.shape[-1])

    def greedy_drafts(self, slot_ids: Tensor, anchors: Tensor, start: Tensor) -> Tensor:
        """Every lane's greedy drafts [L, W-1] from the block forward reading whole tables (a fixed shape):
        device work only, so a CUDA graph can hold it with the round around it (a vocabulary-parallel
        target drafts through `draft`)."""
        hidden, logits = self._block_logits(slot_ids, anchors, start)
        return choose_tokens(self.drafter, hidden, logits, torch.where(slot_ids < 0, 0, anchors), ALL_GREEDY).tokens

    def draft_tree(self, seqs, slot_ids, anchors, start, budget, top_k):
        if self.tree_graphs is not None and self.tree == (budget, top_k):
            nodes = self.tree_graphs.run(slot_ids, anchors, start)
            if nodes is not None:
                return self._as_tree(nodes)
        hidden, logits = self._block(seqs, slot_ids, anchors, start)
        if self.vocab.sharded:
            logits = self.vocab.gather(logits.contiguous())
        return self._build(hidden, logits, slot_ids, anchors, budget, top_k)

    def greedy_tree(self, slot_ids: Tensor, anchors: Tensor, start: Tensor) -> DraftTree:
        """The engine's trees (budget, top_k: `tree`) of every lane from the block forward reading whole
        tables: device work only, so a greedy tree round's CUDA graph can hold it (what the tree graph
        holds, as a DraftTree)."""
        return self._as_tree(self._tree_nodes(slot_ids, anchors, start))

    def _build(self, hidden, logits, slot_ids, anchors, budget: int, top_k: int) -> DraftTree:
        anchors = torch.where(slot_ids < 0, 0, anchors)
        if self.drafter.config.variant == "dflash2":
            children = dflash2_children(self.drafter.candidate_selector, hidden, logits, top_k)
            return build_tree(children, anchors, self.block_size - 1, budget, top_k)
        log_p, tokens = dflash_candidates(logits[:, :self.block_size - 1], top_k, self.kernels.vocab_top_k)
        return DraftTree.of(self.kernels.build_ranked_tree(log_p, tokens, anchors, budget), self.block_size - 1, top_k)

    def _tree_nodes(self, slot_ids, anchors, start) -> tuple[Tensor, ...]:
        """The configured tree of every lane as tensors (what the tree graph captures): the block forward
        reading whole tables (a fixed shape) and build_tree."""
        tree = self._build(*self._block_logits(slot_ids, anchors, start), slot_ids, anchors, *self.tree)
        return tree.tokens, tree.parents, tree.depth, tree.rank, tree.order, tree.valid

    def _as_tree(self, nodes: tuple[Tensor, ...]) -> DraftTree:
        budget, top_k = self.tree
        return DraftTree(*nodes, max_depth=min(self.block_size - 1, budget - 1), top_k=top_k)

    def _block(self, seqs, slot_ids, anchors, start) -> tuple[Tensor, Tensor]:
        """The block's hidden and logits, these ungathered (this rank's vocabulary share under tensor
        parallelism)."""
        out = self.block_graphs.run(slot_ids, anchors, start) if self.block_graphs is not None else None
        if out is None:  # host-known bound: read no more context rows than the longest lane has
            out = self._block_logits(slot_ids, anchors, start, max((seq.position for seq in seqs), default=0),
                                     gather=False)
        return out


class ScriptedSource:
    """Proposes, for a sequence whose prompt has a script, the script's tokens at the drafted
    positions, each replaced by a random token with probability `corrupt` (deterministic in `seed`).
    Sequences without a script get random drafts. Drafts are deterministic (q one-hot)."""

    tap_layer_ids: tuple[int, ...] = ()

    def __init__(self, scripts: dict[tuple[int, ...], list[int]], block_size: int, vocab_size: int,
                 corrupt: float = 0.0, seed: int = 0):
        self.scripts, self.block_size, self.vocab_size = scripts, block_size, vocab_size
        self.corrupt, self.rng = corrupt, random.Random(seed)
        self._script_of: dict[str, list[int]] = {}  # request id -> its script (a prompt's tuple costs its length)
        self.build_ranked = build_ranked_tree_ref

    def use_kernels(self, kernels: Kernels) -> None:
        """Build trees with the engine's kernel set: the torch builder's ~100 small launches would be the
        scripted rounds' own cost, not the engine's."""
        self.build_ranked = kernels.build_ranked_tree

    def reset(self, slot: int) -> None:
        pass

    def copy_pages(self, pages: Tensor) -> None:
        pass

    def append(self, slot_ids, positions, taps, graphs: bool = True) -> None:
        pass

    def draft_tree(self, seqs, slot_ids, anchors, start, budget, top_k):
        """Trees whose rank-0 candidate at each depth is the script's token, except that with probability
        `corrupt` a random token takes rank 0 and the script's token rank 1 (the accepted path then leaves
        the top-1 chain); the other candidates are the lowest other token ids. Scored as the log-softmax
        of logits 8 (rank 0), 6 (rank 1) and 0 (every other token) would score them, without building
        those [L, W-1, vocab] logits (at a real vocabulary they cost more than the round)."""
        L, depths, V = slot_ids.shape[0], self.block_size - 1, self.vocab_size
        k = min(top_k, V)
        tokens, log_p = [], []  # host lists, one tensor each at the end (a tensor per entry cost ms at 16 lanes)
        for row in self._script_rows(seqs, L, corrupt=0.0):
            for tok in row:
                decoy = self.rng.randrange(V)
                ranked = [decoy, tok] if self.rng.random() < self.corrupt and decoy != tok else list(dict.fromkeys([tok, decoy]))
                rest = (t for t in range(V) if t not in ranked)
                tokens.append((ranked + [next(rest) for _ in range(k - len(ranked))])[:k])
                logits = [8.0, 6.0][:len(ranked)] + [0.0] * (k - len(ranked))
                lse = math.log(sum(math.exp(x) for x in logits[:len(ranked)]) + (V - len(ranked)))
                log_p.append([x - lse for x in logits[:k]])
        tokens = torch.tensor(tokens, dtype=torch.long).view(L, depths, k)
        log_p = torch.tensor(log_p, dtype=torch.float32).view(L, depths, k)
        log_p, tokens = to_device(log_p, slot_ids.device), to_device(tokens, slot_ids.device)
        return DraftTree.of(self.build_ranked(log_p, tokens, torch.where(slot_ids < 0, 0, anchors), budget), depths, top_k)

    def _script_rows(self, seqs, lanes: int, corrupt: float) -> list[list[int]]:
        """Per lane the W-1 tokens after its pending one: the script's (random past its end or without
        one; zeros on padding lanes, which nothing reads), each replaced by a random token with
        probability `corrupt`. The corrupted tokens are drawn as the gaps between them (geometric: the
        same independent choice per token, a few draws per round instead of one per token - at 64 lanes
        of 16 the per-token draws were ~0.4 ms of host time a round on this CPU box, the scripted
        benchmark's own cost and not the engine's)."""
        n, V, rng = self.block_size - 1, self.vocab_size, self.rng
        rows = []
        for lane in range(lanes):
            seq = seqs[lane] if lane < len(seqs) else None
            if seq is None:
                rows.append([0] * n)
                continue
            script = self._script(seq)
            first = seq.position + 1 - len(seq.prompt_ids)  # output index of the first drafted token
            row = script[max(first, 0):first + n] if first + n > 0 else []
            if first < 0:
                row = [rng.randrange(V) for _ in range(min(-first, n))] + row
            row += [rng.randrange(V) for _ in range(n - len(row))]
            rows.append(row)
        if corrupt > 0:  # the gaps between corrupted tokens, geometric: floor(log(1 - U) / log(1 - p))
            keep = math.log(1.0 - corrupt) if corrupt < 1 else -math.inf
            at, end = int(math.log(1.0 - rng.random()) / keep), len(seqs) * n  # flat index of the next one
            while at < end:
                rows[at // n][at % n] = int(rng.random() * V)
                at += 1 + int(math.log(1.0 - rng.random()) / keep)
        return rows

    def _script(self, seq) -> list[int]:
        """The script of seq's prompt, looked up once per request: a tuple of the prompt every round cost a
        16-lane round of 128k-token prompts ~21 ms of host time (this CPU box; `bench round`'s rounds at 32k /
        128k contexts were 8 / 18 ms longer than their verify forwards on the H200)."""
        script = self._script_of.get(seq.request_id)
        if script is None:
            script = self._script_of[seq.request_id] = self.scripts.get(tuple(seq.prompt_ids), [])
        return script

    def draft(self, seqs, slot_ids, anchors, start, sampling):
        return to_device(self._script_rows(seqs, slot_ids.shape[0], self.corrupt), slot_ids.device), None

