"""The engine: owns the model, the slot pool and the sequences; `step()` runs one round.

A step admits waiting requests into free slots, runs one prefill chunk for sequences still reading
their prompt, then serves every decoding sequence once: a plain decode row each, or, with a
drafter, one speculative round (draft -> verify -> accept -> commit).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from deltaflash.cache.commit import commit
from deltaflash.cache.slots import SlotPool
from deltaflash.engine.batch import CommitPlan, ExtendBatch, VerifyBatch
from deltaflash.engine.graphs import VerifyGraphRunner
from deltaflash.engine.request import (
    Completion, RoundPhases, SamplingParams, Sequence, Status, StepEvent, StepReport, next_request_id,
)
from deltaflash.errors import RequestError
from deltaflash.models.loader import default_device, default_dtype, load_model
from deltaflash.ops.verify_route import select_verify_ops
from deltaflash.spec.speculator import Speculator, use_cuda_graphs
from deltaflash.spec.sampling import make_generator, sample_rows
from deltaflash.tokenizer import load_tokenizer


@dataclass(frozen=True)
class EngineConfig:
    """Resolved once. max_model_len bounds prompt + generated tokens of one sequence."""

    max_slots: int = 8
    max_model_len: int = 4096
    prefill_chunk: int = 512  # prompt tokens per step, over all prefilling sequences
    block_size: int = 0       # speculative block W (0: the drafter's own, or no speculation)
    sync_phase_timing: bool = False  # sync the device between round phases (profiling: exact phase times, slower)


class Engine:
    def __init__(self, model, tokenizer=None, drafter=None, config: EngineConfig = EngineConfig(),
                 draft_source=None):
        """`drafter`: a loaded DFlash drafter; or `draft_source`: any draft source (spec/sources.py)."""
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.cfg = model.cfg
        param = model.embed_tokens.weight
        self.device, self.dtype = param.device, param.dtype
        if drafter is not None:
            from deltaflash.spec.sources import DFlashSource

            width = config.block_size or drafter.config.block_size
            draft_source = DFlashSource(drafter, model, config.max_slots, config.max_model_len + width,
                                        self.dtype, self.device, width, cuda_graphs=use_cuda_graphs(self))
        width = (config.block_size or draft_source.block_size) if draft_source is not None else 0
        # verify rows of a sequence at its last position reach up to W - 1 positions further
        self.pool = SlotPool(self.cfg, config.max_slots, config.max_model_len + width, self.dtype, self.device)
        self.speculator, self.decode_graphs = None, None
        self.verify_ops = select_verify_ops(self.device)
        if draft_source is not None:
            self.speculator = Speculator(self, draft_source, config.block_size)
        elif use_cuda_graphs(self):
            self.decode_graphs = VerifyGraphRunner(model, self.pool, self.verify_ops, width=1)
        self.waiting: deque[Sequence] = deque()
        self.running: dict[str, Sequence] = {}
        self.stats = {"prefill_tokens": 0, "decode_rounds": 0, "generated_tokens": 0}

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, draft_dir: str | Path | None = None, *, device=None,
                        dtype: torch.dtype | None = None, progress: bool = True, **config) -> "Engine":
        device = torch.device(device) if device is not None else default_device()
        dtype = dtype or default_dtype(device)
        model = load_model(model_dir, dtype=dtype, device=device, progress=progress)
        drafter = None
        if draft_dir is not None:
            from deltaflash.models.dflash import load_drafter

            drafter = load_drafter(draft_dir, target_hidden_size=model.cfg.hidden_size,
                                   target_vocab_size=model.cfg.vocab_size, target_num_layers=model.cfg.num_layers,
                                   dtype=dtype, device=device)
        return cls(model, load_tokenizer(model_dir), drafter, EngineConfig(**config))

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams = SamplingParams(),
                    request_id: str | None = None) -> str:
        params.validate()
        if not prompt_ids:
            raise RequestError("prompt must contain at least one token")
        bad = [t for t in prompt_ids if not 0 <= int(t) < self.cfg.vocab_size]
        if bad:
            raise RequestError(f"prompt token id {bad[0]} outside the vocabulary 0..{self.cfg.vocab_size - 1}")
        total = len(prompt_ids) + params.max_new_tokens
        if total > self.config.max_model_len:
            raise RequestError(
                f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({params.max_new_tokens}) = {total} "
                f"exceeds the context length {self.config.max_model_len}")
        stop = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop.update(self.cfg.eos_token_ids)
        seq = Sequence(request_id or next_request_id(), [int(t) for t in prompt_ids], params, frozenset(stop),
                       make_generator(params, self.device))
        self.waiting.append(seq)
        return seq.request_id

    def abort(self, request_id: str) -> None:
        """Cancel a request; it is retired at the next step boundary."""
        for seq in list(self.waiting):
            if seq.request_id == request_id:
                seq.cancel_requested = True
        if request_id in self.running:
            self.running[request_id].cancel_requested = True

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- the step -------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self, on_report: Callable[[StepReport], None] | None = None) -> list[StepEvent]:
        """One round; `on_report` (optional) receives what it did, for metrics."""
        events: list[StepEvent] = []
        self._retire_cancelled(events)
        admitted = 0
        while self.waiting and self.pool.num_free:
            seq = self.waiting.popleft()
            seq.slot, seq.status = self.pool.admit(), Status.PREFILLING
            self.running[seq.request_id] = seq
            if self.speculator:
                self.speculator.admit(seq)
            admitted += 1
        prefilling = [s for s in self.running.values() if s.status is Status.PREFILLING]
        decoding = [s for s in self.running.values() if s.status is Status.DECODING]
        t0, prefilled = time.perf_counter(), self.stats["prefill_tokens"]
        if prefilling:
            self._prefill(prefilling, events)
        t1, phases = time.perf_counter(), RoundPhases()
        if decoding:
            if self.speculator:
                phases = self.speculator.round(decoding, events)
            else:
                self._decode(decoding, events)
            self.stats["decode_rounds"] += 1
        if on_report is not None:
            accepted = tuple(s.accepted_lengths[-1] for s in decoding) if self.speculator else ()
            on_report(StepReport(admitted, self.stats["prefill_tokens"] - prefilled, t1 - t0, len(decoding),
                                 time.perf_counter() - t1, accepted, phases))
        return events

    def _prefill(self, seqs: list[Sequence], events: list[StepEvent]) -> None:
        budget, lanes, chunks = self.config.prefill_chunk, [], []
        for seq in seqs:
            n = min(len(seq.prompt_ids) - seq.num_prefilled, max(budget, 1))
            if n <= 0 or (budget <= 0 and lanes):
                break
            chunk = seq.prompt_ids[seq.num_prefilled:seq.num_prefilled + n]
            lanes.append((seq.slot, seq.num_prefilled, chunk))
            chunks.append((seq, n))
            budget -= n
        batch = ExtendBatch.build(lanes, self.device)
        taps_ids = self.speculator.tap_layer_ids if self.speculator else ()
        logits, taps = self.model.extend(batch, self.pool, tap_layer_ids=taps_ids)
        if self.speculator:
            self.speculator.append_context(batch, taps)
        done = []
        for lane, (seq, n) in enumerate(chunks):
            seq.num_prefilled += n
            self.stats["prefill_tokens"] += n
            if seq.num_prefilled == len(seq.prompt_ids):
                done.append(lane)
        if done:
            tokens = sample_rows(logits[done], [chunks[i][0].params for i in done], [chunks[i][0].generator for i in done])
            for lane, tok in zip(done, tokens):
                seq = chunks[lane][0]
                seq.status = Status.DECODING
                self.emit(seq, [tok], events)

    def _decode(self, seqs: list[Sequence], events: list[StepEvent]) -> None:
        """One row per sequence through the verify route as width-1 chains (on GPU: the fused kernels,
        replayed from a CUDA graph per lane bucket), then a commit of that row."""
        dev = self.device
        slots, starts = tuple(s.slot for s in seqs), tuple(s.position for s in seqs)
        start = torch.tensor(starts, dtype=torch.long, device=dev)
        slot_ids = torch.tensor(slots, dtype=torch.long, device=dev)
        batch = VerifyBatch(input_ids=torch.tensor([[s.pending] for s in seqs], dtype=torch.long, device=dev),
                            parents=torch.full((len(seqs), 1), -1, dtype=torch.long, device=dev),
                            positions=start[:, None], slot_ids=slot_ids, start=start,
                            slot_ids_host=slots, start_host=starts, chain_host=True)
        out = self.decode_graphs.run(batch) if self.decode_graphs else None
        if out is None:
            out = self.model.verify(batch, self.pool, self.verify_ops)
        tokens = sample_rows(out.logits[:, 0], [s.params for s in seqs], [s.generator for s in seqs])
        one = (1,) * len(seqs)
        plan = CommitPlan(slot_ids=slot_ids, accepted_nodes=torch.zeros_like(batch.parents),
                          accepted_len=torch.ones_like(slot_ids), slot_ids_host=slots, accepted_len_host=one,
                          start_host=starts, chain_host=True)
        commit(self.pool, plan, out, self.verify_ops)
        for seq, tok in zip(seqs, tokens):
            self.emit(seq, [tok], events)

    # ---- output and retirement ----------------------------------------------------------
    def emit(self, seq: Sequence, tokens: list[int], events: list[StepEvent]) -> int:
        """Append new tokens, cutting at a stop token or max_new_tokens; returns how many were kept.
        The last kept token becomes `pending` (the next row to feed) unless the sequence finished."""
        kept, reason = [], None
        for tok in tokens:
            kept.append(tok)
            if tok in seq.stop_ids:
                reason = "stop"
                break
            if len(seq.output_ids) + len(kept) >= seq.params.max_new_tokens:
                reason = "length"
                break
        seq.output_ids.extend(kept)
        seq.pending = kept[-1]
        self.stats["generated_tokens"] += len(kept)
        if reason:
            self._finish(seq, reason)
        events.append(StepEvent(seq.request_id, tuple(kept), reason))
        return len(kept)

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason, seq.status = reason, Status.FINISHED
        if seq.slot >= 0:
            self.pool.retire(seq.slot)
            seq.slot = -1
        self.running.pop(seq.request_id, None)

    def _retire_cancelled(self, events: list[StepEvent]) -> None:
        for seq in [s for s in self.waiting if s.cancel_requested]:
            self.waiting.remove(seq)
            seq.finish_reason, seq.status = "cancelled", Status.FINISHED
            events.append(StepEvent(seq.request_id, (), "cancelled"))
        for seq in [s for s in self.running.values() if s.cancel_requested]:
            self._finish(seq, "cancelled")
            events.append(StepEvent(seq.request_id, (), "cancelled"))

    # ---- offline generation -------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] = SamplingParams(),
                 progress: bool = False):
        """Run prompts to completion (all admitted as slots allow). Returns (completions, seconds).
        `progress` shows a bar over finished sequences."""
        from tqdm import tqdm

        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params_list)]
        seqs = {s.request_id: s for s in self.waiting}
        out: dict[str, list[int]] = {i: [] for i in ids}
        reasons: dict[str, str] = {}
        t0 = time.perf_counter()
        with tqdm(total=len(ids), unit="seq", desc="generate", disable=not progress) as bar:
            while self.has_work():
                for ev in self.step():
                    out[ev.request_id].extend(ev.token_ids)
                    if ev.finish_reason:
                        reasons[ev.request_id] = ev.finish_reason
                        bar.update()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        completions = [Completion(i, seqs[i].prompt_ids, out[i], reasons[i], seqs[i].accepted_lengths) for i in ids]
        return completions, elapsed
