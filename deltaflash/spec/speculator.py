"""One speculative round over every decoding sequence: draft -> verify -> accept -> commit.

Lane l verifies rows [anchor, d_1 .. d_{W-1}] at positions pos .. pos+W-1 (a chain). The commit
takes 1 + (accepted drafts) rows: the anchor and the accepted drafts; the bonus token becomes the
next anchor. Lanes with one token left ride along as AR lanes: their draft rows are ignored and only
the anchor row is committed. Padding lanes (slot -1) read zeros and write nothing.
"""

from __future__ import annotations

import os
import time

import torch

from deltaflash.cache.commit import commit
from deltaflash.engine.batch import CommitPlan, ExtendBatch, VerifyBatch
from deltaflash.engine.request import RoundPhases, Sequence, StepEvent
from deltaflash.ops.verify_route import select_verify_ops
from deltaflash.spec.acceptance import accept_greedy, accept_sampled


def use_cuda_graphs(engine) -> bool:
    """Verify rounds replay CUDA graphs on GPU for dense models (MoE routing syncs with the host),
    unless DELTAFLASH_NO_CUDA_GRAPHS=1."""
    return (engine.device.type == "cuda" and not engine.cfg.is_moe
            and os.environ.get("DELTAFLASH_NO_CUDA_GRAPHS", "0") in ("", "0"))


class Speculator:
    def __init__(self, engine, source, block_size: int = 0):
        self.engine, self.source = engine, source
        self.block_size = block_size or source.block_size
        if self.block_size < 2:
            raise ValueError(f"block size must be >= 2 to speculate, got {self.block_size}")
        self.tap_layer_ids = tuple(source.tap_layer_ids)
        self.verify_ops = select_verify_ops(engine.device)
        self.graphs = None
        if use_cuda_graphs(engine):
            from deltaflash.engine.graphs import VerifyGraphRunner

            self.graphs = VerifyGraphRunner(engine.model, engine.pool, self.verify_ops, self.block_size,
                                            self.tap_layer_ids)

    def admit(self, seq: Sequence) -> None:
        self.source.admit(seq)

    def append_context(self, batch: ExtendBatch, taps: torch.Tensor | None) -> None:
        """Prefill rows of live lanes become draft context (taps [L, T, n_taps*H])."""
        if taps is None:
            return
        valid = torch.arange(batch.input_ids.shape[1], device=taps.device)[None] < batch.n_rows[:, None]
        valid &= (batch.slot_ids >= 0)[:, None]
        lane, row = valid.nonzero(as_tuple=True)
        self.source.append(batch.slot_ids[lane], batch.positions[lane, row], taps[lane, row])

    def round(self, seqs: list[Sequence], events: list[StepEvent], pad_lanes_to: int = 0,
              speculate: list[bool] | None = None) -> RoundPhases:
        """Serve `seqs` once. `speculate[i]` False makes lane i an AR lane (default: a lane
        speculates when it has more than one token left). Returns the host seconds per phase."""
        engine, device, W = self.engine, self.engine.device, self.block_size
        clock = [self._now()]
        n, L = len(seqs), max(len(seqs), pad_lanes_to)
        slots = [s.slot for s in seqs] + [-1] * (L - n)
        starts = [s.position for s in seqs] + [0] * (L - n)
        slot_ids = torch.tensor(slots, dtype=torch.long, device=device)
        start = torch.tensor(starts, dtype=torch.long, device=device)
        anchors = torch.tensor([s.pending for s in seqs] + [0] * (L - n), dtype=torch.long, device=device)
        speculate = speculate or [s.remaining > 1 for s in seqs]
        n_draft = [W - 1 if spec else 0 for spec in speculate]

        drafts, draft_probs = self.source.draft(seqs, slot_ids, anchors, start, W)  # [L, W-1]
        clock.append(self._now())
        chain = torch.arange(W, device=device)
        batch = VerifyBatch(
            input_ids=torch.cat([anchors[:, None], drafts], dim=1), parents=(chain - 1).expand(L, W).contiguous(),
            positions=start[:, None] + chain, slot_ids=slot_ids, start=start,
            slot_ids_host=tuple(slots), start_host=tuple(starts), chain_host=True)
        out = self.graphs.run(batch) if self.graphs else None
        if out is None:
            out = engine.model.verify(batch, engine.pool, self.verify_ops, self.tap_layer_ids)
        clock.append(self._now())

        accepted = accept_greedy(out.logits, drafts, [i for i, s in enumerate(seqs) if s.params.greedy], n_draft)
        for i, seq in enumerate(seqs):
            if not seq.params.greedy:
                accepted[i] = accept_sampled(out.logits[i], drafts[i], draft_probs[i], seq.params, seq.generator,
                                             n_draft[i])
        draft_host = drafts.tolist()  # acceptance synced with the device already: a cheap copy now
        clock.append(self._now())

        accepted_len = [accepted[i][0] + 1 for i in range(n)] + [0] * (L - n)
        plan = CommitPlan(slot_ids=slot_ids, accepted_nodes=chain.expand(L, W).contiguous(),
                          accepted_len=torch.tensor(accepted_len, device=device), slot_ids_host=tuple(slots),
                          accepted_len_host=tuple(accepted_len), start_host=tuple(starts), chain_host=True)
        commit(engine.pool, plan, out, self.verify_ops)
        if out.taps is not None:  # accepted rows become draft context; the rest go to the sink (-1)
            kept = torch.where(chain[None] < plan.accepted_len[:, None], slot_ids[:, None], -1)
            self.source.append_block(kept, start[:, None] + chain, out.taps)
        clock.append(self._now())

        for i, seq in enumerate(seqs):
            n_acc, bonus = accepted[i]
            seq.accepted_lengths.append(n_acc + 1)
            engine.emit(seq, draft_host[i][:n_acc] + [bonus], events)
        return RoundPhases(*(b - a for a, b in zip(clock, clock[1:])))

    def _now(self) -> float:
        if self.engine.config.sync_phase_timing and self.engine.device.type == "cuda":
            torch.cuda.synchronize(self.engine.device)
        return time.perf_counter()
