"""Where drafts come from. A draft source proposes W-1 tokens per lane (and the q they were drawn
from, for sampling lanes) and keeps whatever per-slot context it needs.

- `DFlashSource`: a DFlash / DFlash2 drafter conditioned on target tap features (DESIGN.md §1.2).
- `ScriptedSource`: replays a recorded continuation with a set fraction of corrupted tokens, to run
  the engine at a chosen acceptance (tests, and benchmarks labelled "scripted").
"""

from __future__ import annotations

import random

import torch

from deltaflash.cache.draft_context import DraftContextCache
from deltaflash.engine.request import Sequence
from deltaflash.spec.draft import choose_tokens, draft_hidden, full_vocab_probs


class DFlashSource:
    def __init__(self, drafter, model, num_slots: int, max_len: int, dtype, device, block_size: int = 0,
                 cuda_graphs: bool = False):
        """block_size: the verify width W (default: the drafter's own). cuda_graphs: the block forward
        and the per-round context append replay CUDA graphs per lane bucket (the drafter then attends
        over the full context capacity, a fixed shape)."""
        self.drafter, self.model = drafter, model
        self.block_size = block_size or drafter.config.block_size
        self.tap_layer_ids = tuple(drafter.config.target_layer_ids)
        self.context = DraftContextCache(drafter.config, num_slots=num_slots, max_model_len=max_len,
                                         dtype=dtype, device=device)
        self.block_graphs = self.append_graphs = None
        if cuda_graphs:
            from deltaflash.engine.graphs import LaneGraphs

            self.block_graphs = LaneGraphs(self._block_logits, pad_values=(-1, 0, 0))
            self.append_graphs = LaneGraphs(self._append_rows, pad_values=(-1, 0, 0))

    def admit(self, seq: Sequence) -> None:
        self.context.reset(seq.slot)

    def append(self, slot_ids, positions, taps) -> None:
        """Committed rows (slot_ids [N], positions [N], taps [N, n_taps*H]) become draft context."""
        self.context.append(self.drafter, slot_ids, positions, taps)

    def append_block(self, slot_ids, positions, taps) -> None:
        """A round's rows: slot_ids [L, W] (-1 where a row was not accepted, or a padding lane),
        positions [L, W], taps [L, W, n_taps*H]. Fixed shapes: replayed from a graph when enabled."""
        if self.append_graphs is None or self.append_graphs.run(slot_ids, positions, taps) is None:
            self._append_rows(slot_ids, positions, taps)

    def _append_rows(self, slot_ids, positions, taps):
        self.context.append(self.drafter, slot_ids.flatten(), positions.flatten(), taps.flatten(0, 1))
        return ()

    def _block_logits(self, slot_ids, anchors, start, max_context_len: int | None = None):
        """The block's hidden [L, W-1, H] and logits [L, W-1, V] of the drafted slots."""
        hidden = draft_hidden(self.drafter, self.context, self.model.embed_tokens.weight, slot_ids, anchors, start,
                              self.block_size, max_context_len=max_context_len)[:, 1:]
        return hidden, self.drafter.logits(hidden, self.model.lm_head_weight)

    def draft(self, seqs: list[Sequence], slot_ids, anchors, start, width: int):
        """Returns drafts [L, W-1] and, per sampling lane, the q [W-1, V] they were drawn from.
        One drafter forward for all lanes; token choice per group of equal sampling settings."""
        if width != self.block_size:
            raise ValueError(f"this source drafts blocks of {self.block_size}, asked for {width}")
        drafter = self.drafter
        out = self.block_graphs.run(slot_ids, anchors, start) if self.block_graphs is not None else None
        if out is None:  # host-known bound: read no more context rows than the longest lane has
            out = self._block_logits(slot_ids, anchors, start, max(seq.position for seq in seqs))
        hidden, logits = out
        tokens = logits.argmax(dim=-1)  # padding lanes keep these
        probs: list[torch.Tensor | None] = [None] * slot_ids.shape[0]
        groups: dict[tuple, list[int]] = {}
        for lane, seq in enumerate(seqs):
            p = seq.params
            groups.setdefault((p.temperature, p.top_p, p.top_k), []).append(lane)
        for (temperature, top_p, top_k), lanes in groups.items():
            if temperature == 0 and drafter.config.variant != "dflash2" and len(lanes) == len(seqs):
                break  # every lane greedy DFlash: the argmax above is the choice
            idx = torch.tensor(lanes, device=tokens.device)
            picked = choose_tokens(drafter, hidden[idx], logits[idx], anchors[idx], temperature, top_p, top_k,
                                   [seqs[i].generator for i in lanes])
            tokens[idx] = picked.tokens
            q = full_vocab_probs(picked, logits.shape[-1])
            for j, lane in enumerate(lanes):
                probs[lane] = None if q is None else q[j]
        return tokens, probs


class ScriptedSource:
    """Proposes, for a sequence whose prompt has a script, the script's tokens at the drafted
    positions, each replaced by a random token with probability `corrupt` (deterministic in `seed`).
    Sequences without a script get random drafts. Drafts are deterministic (q one-hot)."""

    tap_layer_ids: tuple[int, ...] = ()

    def __init__(self, scripts: dict[tuple[int, ...], list[int]], block_size: int, vocab_size: int,
                 corrupt: float = 0.0, seed: int = 0):
        self.scripts, self.block_size, self.vocab_size = scripts, block_size, vocab_size
        self.corrupt, self.rng = corrupt, random.Random(seed)

    def admit(self, seq: Sequence) -> None:
        pass

    def append(self, slot_ids, positions, taps) -> None:
        pass

    def append_block(self, slot_ids, positions, taps) -> None:
        pass

    def draft(self, seqs: list[Sequence], slot_ids, anchors, start, width: int):
        rows = []
        for lane in range(slot_ids.shape[0]):
            seq = seqs[lane] if lane < len(seqs) else None
            script = self.scripts.get(tuple(seq.prompt_ids), []) if seq else []
            row = []
            for k in range(1, width):
                i = (seq.position + k - len(seq.prompt_ids)) if seq else -1  # output index of the drafted token
                tok = script[i] if 0 <= i < len(script) else self.rng.randrange(self.vocab_size)
                if self.rng.random() < self.corrupt:
                    tok = self.rng.randrange(self.vocab_size)
                row.append(tok)
            rows.append(row)
        return torch.tensor(rows, dtype=torch.long, device=slot_ids.device), [None] * slot_ids.shape[0]
