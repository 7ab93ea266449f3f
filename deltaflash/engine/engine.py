"""The engine wires the scheduler (decides) to the runner (executes on the device) and turns what the
runner produced into sequence outputs and step events: stop tokens and max tokens cut inside an
accepted run, finished sequences give their slot back.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from deltaflash.core.request import (
    Completion, SamplingParams, Sequence, Status, StepEvent, StepReport, TokenLogprob, next_request_id, resolve_seed,
)
from deltaflash.engine.config import EngineConfig
from deltaflash.engine.graphs import buckets_for
from deltaflash.engine.runner import ModelRunner, StepResult
from deltaflash.engine.scheduler import Scheduler, StepPlan
from deltaflash.errors import RequestError
from deltaflash.models.loader import default_device, default_dtype, load_model
from deltaflash.speculative.policy import TreeChoice, WidthPolicy
from deltaflash.tokenizer import load_tokenizer

log = logging.getLogger("deltaflash.engine")


def empty_stats() -> dict[str, int]:
    """The engine's counters (Engine.stats) at zero."""
    names = ("prefill_tokens", "shared_prompt_tokens", "cached_prompt_tokens", "decode_rounds", "generated_tokens",
             "preemptions")
    return dict.fromkeys(names, 0)


class Engine:
    def __init__(self, model, tokenizer=None, drafter=None, config: EngineConfig = EngineConfig(),
                 draft_source=None, progress: bool = False, tensor_parallel=None):
        """`drafter`: a loaded DFlash drafter; or `draft_source`: any draft source (speculative/sources.py).
        Builds the runner and captures its CUDA graphs (`progress`: show a bar), so that no request
        pays for compilation or capture; `startup_s` says how long that took."""
        self.model, self.tokenizer, self.cfg = model, tokenizer, model.cfg
        self._grammar_compiler = None
        self.device = model.embed_tokens.weight.device
        block = drafter.config.block_size if drafter is not None else getattr(draft_source, "block_size", None)
        if tensor_parallel is not None:
            config = dataclasses.replace(config, tensor_parallel_size=tensor_parallel.size)
        resolved = config.resolve(self.device, block, model_max_len=self.cfg.max_position_embeddings)
        self.runner = ModelRunner(model, resolved, drafter, draft_source,
                                  max_model_len_given=config.max_model_len is not None, tensor_parallel=tensor_parallel)
        # unseeded requests: the same seeds on every rank of a tensor-parallel engine (parallel/launch.py)
        self._seeds = tensor_parallel.common_seeds(self.device) if resolved.tensor_parallel_size > 1 else None
        self.config = self.runner.config  # max_model_len fitted to the page pool
        if self.config.max_model_len < resolved.max_model_len:
            log.warning("max_model_len lowered from %d (the model's) to %d: the K/V page pool holds no more",
                        resolved.max_model_len, self.config.max_model_len)
        log.info(self.runner.page_plan.describe(self.config.max_model_len, self.config.block_size))
        self.scheduler = Scheduler(self.config, self.runner.page_plan.num_pages,
                                   dense_prefill=self.runner.dense_prefill)
        self._busy = False  # the engine had work when its last step ended (the device's wait is then the host's doing)
        t0 = time.perf_counter()
        self.runner.warm_up(progress)
        self.scheduler.eager_prefill_rows = self.runner.eager_prefill_rows()
        if self.config.adaptive or self.config.scale_prefill_budget or self.config.max_prefill_stall:
            self.scheduler.costs = self.runner.calibrate()  # after capture: it times what rounds will replay
        if self.config.adaptive:
            self.scheduler.policy = WidthPolicy(self.config.widths, self.scheduler.costs)
        if self.config.costed_trees:
            self.scheduler.tree_choice = TreeChoice(buckets_for(self.config.max_slots))
        if self.device.type == "cuda":
            self._warm_requests()
            for choice in (self.scheduler.policy, self.scheduler.tree_choice, self.scheduler.costs):
                if choice is not None:  # what the warm requests taught them is not about clients
                    choice.forget()
            self.scheduler.clear_prefix_cache()
        self.stats = empty_stats()
        self.startup_s = time.perf_counter() - t0 if self.device.type == "cuda" else 0.0

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, draft_dir: str | Path | None = None, *, device=None,
                        dtype: torch.dtype | None = None, progress: bool = True, tensor_parallel=None,
                        **config) -> "Engine":
        """`tensor_parallel`: this process's TensorParallel (parallel/launch.py): the engine runs over its
        rank's share of the target (each rank loads the checkpoint, then keeps its share)."""
        device = torch.device(device) if device is not None else default_device()
        dtype = dtype or default_dtype(device)
        shard = None
        if tensor_parallel is not None and tensor_parallel.size > 1:  # each rank reads only its share
            from deltaflash.parallel.tensor import Shard, connect

            def shard(cfg):
                return Shard(cfg, tensor_parallel.rank, tensor_parallel.size)
        model = load_model(model_dir, dtype=dtype, device=device, progress=progress, shard=shard)
        if shard is not None:
            connect(model, tensor_parallel.rank, tensor_parallel.size, tensor_parallel.group)
        drafter = None
        if draft_dir is not None:
            from deltaflash.models.dflash import load_drafter

            drafter = load_drafter(draft_dir, target_hidden_size=model.cfg.hidden_size,
                                   target_vocab_size=model.cfg.vocab_size, target_num_layers=model.cfg.num_layers,
                                   dtype=dtype, device=device)
        return cls(model, load_tokenizer(model_dir), drafter, EngineConfig(**config), progress=progress,
                   tensor_parallel=tensor_parallel)

    def _warm_requests(self) -> None:
        """Greedy and sampled requests (top-k, top-p) through the whole step path - prefill, rounds at
        each width, acceptance, commit, draft context - so that every kernel a client's first request
        launches is already loaded. Prompt lengths cover what Triton specialises an integer argument on
        (1, divisible by 16, neither) for one prompt and for several prefilled together: a one-token
        prompt alone never reaches the chunked GDN prefill kernels. Their slots are reset at the next
        admission, like any retired slot. With load-adaptive widths they run once at every width in use
        (each width's commit kernels, acceptance and draft context are compiled for their own shapes); a
        tree engine whose rounds may also verify chains runs them once with every round a tree and once
        with every round a chain. Then prompts scored for their logprobs (`prompt_logprobs`: an eager forward
        keeping every row's hidden state, then the scoring), one of a length divisible by 16 and one not. Last,
        one prompt twice: the second request forks from the first's prefill (engine/shares.py).
        """
        self.stats = empty_stats()
        new = min(2 * self.config.block_size + 1, self.config.max_model_len - 2)
        longest = self.config.max_model_len - new - 1
        greedy = SamplingParams(max_new_tokens=new, ignore_eos=True)
        sampled = SamplingParams(max_new_tokens=new, temperature=1.0, top_p=0.9, top_k=50, seed=0, ignore_eos=True)
        policy, scheduler = self.scheduler.policy, self.scheduler
        # what each pass pins: an adaptive engine's widths one by one; a tree engine whose rounds may also
        # verify chains, every round a tree and then every round a chain (adaptive engines draft no trees)
        if policy is not None:
            pins = [(width, None) for width in self.config.widths]
        elif self.config.tree_budget and self.config.tree_max_lanes != 0:
            pins = [(None, True), (None, False)]
        else:
            pins = [(None, None)]
        for width, trees in pins:
            with scheduler.pinned(width, trees):
                for lengths in ((16,), (1, 3, 29)):
                    prompts = [[k] * max(1, min(n, longest)) for k, n in enumerate(lengths)]
                    self.generate(prompts, [greedy if k % 2 == 0 else sampled for k in range(len(prompts))])
        self.generate([[k] * max(1, min(n, longest)) for k, n in enumerate((16, 29))],
                      SamplingParams(max_new_tokens=1, ignore_eos=True, prompt_logprobs=1))
        self.generate([[5] * max(1, min(17, longest))] * 2, [greedy, sampled])  # one forks from the other's prefill

    @property
    def pool(self):
        return self.runner.pool

    @property
    def num_live(self) -> int:
        """Sequences holding a slot."""
        return self.scheduler.slots.num_live

    @property
    def page_usage(self) -> tuple[int, int]:
        """(pages held by sequences - not those only the prefix cache keeps: it gives them back before anybody waits
        for pages -, pages in the pool)."""
        return self.scheduler.pages.num_in_use, self.scheduler.pages.num_pages

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams = SamplingParams(),
                    request_id: str | None = None) -> str:
        params.validate()
        # one conversion in C to our own array (prefill steps copy from it), the range check on it, one back to ints
        if isinstance(prompt_ids, torch.Tensor):  # (its __array__ predates numpy 2's copy keyword)
            prompt_ids = prompt_ids.tolist()
        try:
            prompt = np.array(prompt_ids)
        except ValueError:  # (ragged nesting)
            raise RequestError("prompt must be a flat list of token ids") from None
        if not prompt.size:
            raise RequestError("prompt must contain at least one token")
        if prompt.ndim != 1 or prompt.dtype.kind not in "iu":
            raise RequestError(f"prompt must be a flat list of integer token ids, got {prompt.dtype} values "
                               f"of shape {tuple(prompt.shape)}")
        if prompt.min() < 0 or prompt.max() >= self.cfg.vocab_size:
            bad = prompt[(prompt < 0) | (prompt >= self.cfg.vocab_size)][0]
            raise RequestError(f"prompt token id {bad} outside the vocabulary 0..{self.cfg.vocab_size - 1}")
        prompt = prompt.astype(np.int64, copy=False)
        prompt_ids = prompt.tolist()
        pool_tokens = self.runner.page_plan.tokens
        if len(prompt_ids) + self.config.block_size > pool_tokens:
            raise RequestError(f"prompt ({len(prompt_ids)} tokens) is longer than the whole K/V page pool "
                               f"({pool_tokens} token positions; raise --kv-cache-memory / --gpu-memory-utilization)")
        total = len(prompt_ids) + params.max_new_tokens
        if total > self.config.max_model_len:
            raise RequestError(
                f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({params.max_new_tokens}) = {total} "
                f"exceeds the context length {self.config.max_model_len}")
        seed = params.seed if params.seed is not None or self._seeds is None else self._seeds.getrandbits(63)
        seq = Sequence(request_id or next_request_id(), prompt_ids, params, self.stop_ids(params),
                       resolve_seed(params) if seed is None else seed, prompt_array=prompt)
        if params.grammar is not None:
            seq.matcher = self._grammars().matcher(params.grammar)
        self.scheduler.add(seq)
        return seq.request_id

    def stop_ids(self, params: SamplingParams) -> frozenset[int]:
        """The tokens that end a request (finish_reason "stop"; they are not text): its stop_token_ids and,
        unless ignore_eos, the model's end-of-sequence tokens."""
        return frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else
                                                   frozenset(self.cfg.eos_token_ids))

    def _grammars(self):
        """The grammar compiler of this engine's tokenizer, built at the first structured request."""
        if self.tokenizer is None:
            raise RequestError("structured output needs the model's tokenizer and this model folder has none")
        if self._grammar_compiler is None:
            from deltaflash.speculative.grammar import GrammarCompiler

            self._grammar_compiler = GrammarCompiler(self.tokenizer, self.cfg.vocab_size)
        return self._grammar_compiler

    def abort(self, request_id: str) -> None:
        """Cancel a request; it is retired at the next step boundary."""
        self.scheduler.abort(request_id)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def idle(self) -> None:
        """A serving loop has nothing to step and waits for requests (the tensor-parallel server's rank 0
        uses the moment: parallel/launch.py, MirroredEngine)."""

    # ---- the step -------------------------------------------------------------------------
    def step(self, on_report: Callable[[StepReport], None] | None = None,
             overlap: Callable[[], None] | None = None) -> list[StepEvent]:
        """One step: what the scheduler planned, run by the runner; `on_report` (optional) receives
        what it did, for metrics. `overlap` (optional) runs once while the device computes the step
        (after its launch, before its results are read; at once when the step runs nothing on the
        device): host work that needs nothing from this step, such as finishing the previous step's
        events. It may add and abort requests: they count from the next step on."""
        plan = self.scheduler.schedule()
        events = [StepEvent(seq.request_id, (), "cancelled") for seq in plan.cancelled]
        self.stats["preemptions"] += len(plan.preempted)
        if not plan.runs_anything:
            self.runner.begin(plan)
            if overlap is not None:
                overlap()
            self._busy = self.has_work()
            return events
        result = self.runner.execute(plan, overlap, follows=self._busy)
        self._apply(plan, result, events)
        self._busy = self.has_work()
        if on_report is not None:
            speculated = tuple(n + 1 for n, w in zip(result.round.accepted, plan.widths) if w > 1)
            used, total = self.page_usage
            admitted = plan.admitted + tuple(f.seq for f in plan.forks)
            on_report(StepReport(len(admitted), sum(len(c.tokens) for c in plan.prefill), result.prefill_s,
                                 len(plan.decode), result.decode_s, speculated, result.phases, plan.widths,
                                 len(plan.preempted), used, total, tuple(s.request_id for s in admitted),
                                 result.prefill_graphed, result.device_idle_s, plan.tree_budget,
                                 plan.prefill_budget, result.prefill_rows,
                                 sum(len(f.seq.prompt_ids) for f in plan.forks), sum(r.tokens for r in plan.restores),
                                 len(plan.prefill)))
        return events

    def _apply(self, plan: StepPlan, result: StepResult, events: list[StepEvent]) -> None:
        completed = iter(zip(result.first.tokens, result.first.logprobs))
        for i, chunk in enumerate(plan.prefill):
            seq = chunk.seq
            seq.num_prefilled += len(chunk.tokens)
            self.stats["prefill_tokens"] += len(chunk.tokens)
            seq.prompt_logprobs.extend(result.prompt_logprobs.get(i, ()))
            if chunk.last:
                seq.status = Status.DECODING
                if chunk.emits:  # a resumed sequence's pending token was emitted before its preemption
                    self._first(seq, next(completed), events)
        self.stats["cached_prompt_tokens"] += sum(r.tokens for r in plan.restores)
        for fork in plan.forks:  # (after their leaders: the prompt logprobs are complete)
            seq = fork.seq
            seq.status = Status.DECODING
            self.stats["shared_prompt_tokens"] += len(seq.prompt_ids)
            if seq.params.prompt_logprobs is not None:
                seq.prompt_logprobs = list(fork.leader.prompt_logprobs)
            self._first(seq, next(completed), events)
        if plan.decode:
            self.stats["decode_rounds"] += 1
        out, scheduler = result.round, self.scheduler
        policy, choice, costs = scheduler.policy, scheduler.tree_choice, scheduler.costs
        if costs is not None and plan.decode:  # a step's prefill runs on the device before its round (decode_s)
            bucket = costs.bucket(len(plan.decode))
            if not plan.prefill:
                costs.observe(bucket, plan.round_width, result.decode_s)
            elif self.config.max_prefill_stall:  # what the prefill's rows (a graph's padding included) added
                costs.prefill.observe(result.prefill_rows, result.prefill_s + result.decode_s  # to the step
                                      - costs.cost(bucket, plan.round_width))  # (Scheduler.stall_budget)
        if choice is not None and plan.round_width > 1:
            choice.observe(len(plan.decode), bool(plan.tree_budget), result.decode_s,
                           [n + 1 for n, w in zip(out.accepted, plan.widths) if w > 1], clean=not plan.prefill)
        for seq, width, accepted, tokens, logprobs in zip(plan.decode, plan.widths, out.accepted, out.tokens,
                                                          out.logprobs):
            seq.draws += 1
            seq.widths.append(width)
            if width > 1:
                seq.accepted_lengths.append(accepted + 1)
            if policy is not None:
                policy.observe(seq, width - 1, accepted)
            self._emit(seq, tokens, logprobs, events)

    # ---- output and retirement ----------------------------------------------------------
    def _first(self, seq: Sequence, first: tuple, events: list[StepEvent]) -> None:
        """A sequence's first token (and its logprobs), sampled from its prompt's last row; the prompt
        logprobs and the prompt tokens it did not prefill go with its first event."""
        seq.draws += 1
        if seq.params.max_new_tokens:
            self._emit(seq, *first, events)
        else:  # the prompt scored alone
            self.scheduler.finish(seq, "length")
            events.append(StepEvent(seq.request_id, (), "length"))
        if seq.params.prompt_logprobs is not None:  # with the first event, once
            events[-1] = events[-1]._replace(prompt_logprobs=tuple(seq.prompt_logprobs))
        if seq.cached_tokens:
            events[-1] = events[-1]._replace(cached_tokens=seq.cached_tokens)

    def _emit(self, seq: Sequence, tokens: tuple[int, ...], logprobs, events: list[StepEvent]) -> None:
        """Append new tokens (and their logprobs when the request asked), cutting at a stop token or
        max_new_tokens or where the grammar completes (it consumes them). The last kept token becomes `pending` (the next row
        to feed) unless the sequence finished."""
        kept, reason = tokens, None
        if seq.matcher is not None or len(seq.output_ids) + len(tokens) >= seq.params.max_new_tokens \
                or not seq.stop_ids.isdisjoint(tokens):  # else (most lanes, most steps) nothing cuts the run
            kept = []
            for tok in tokens:
                kept.append(tok)
                if tok in seq.stop_ids or (seq.matcher is not None and seq.matcher.advance(tok)):
                    reason = "stop"
                    break
                if len(seq.output_ids) + len(kept) >= seq.params.max_new_tokens:
                    reason = "length"
                    break
        seq.output_ids.extend(kept)
        seq.pending = kept[-1]
        kept_logprobs = None
        if seq.params.logprobs is not None:
            k = seq.params.logprobs
            kept_logprobs = tuple(TokenLogprob(lp.token_id, lp.logprob, lp.top[:k]) for lp in logprobs[:len(kept)])
            seq.logprobs.extend(kept_logprobs)
        self.stats["generated_tokens"] += len(kept)
        if reason:
            self.scheduler.finish(seq, reason, dropped=len(tokens) - len(kept))
        events.append(StepEvent(seq.request_id, tuple(kept), reason, kept_logprobs))

    # ---- offline generation -------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] = SamplingParams(),
                 progress: bool = False):
        """Run prompts to completion (all admitted as slots allow). Returns (completions, seconds).
        `progress` shows a bar over finished sequences."""
        from tqdm import tqdm

        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params_list)]
        seqs = {s.request_id: s for s in self.scheduler.waiting}
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
        completions = [Completion(i, seqs[i].prompt_ids, out[i], reasons[i], seqs[i].accepted_lengths,
                                  seqs[i].logprobs, seqs[i].widths, seqs[i].prompt_logprobs) for i in ids]
        return completions, elapsed
