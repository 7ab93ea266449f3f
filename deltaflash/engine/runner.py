"""The runner executes a StepPlan on the device and returns what each lane produced.

It owns the device state: the slot pool, the draft source's context, the CUDA graphs (captured at
start by `warm_up`). One step: reset admitted slots -> prefill chunks (first tokens sampled on the
device) -> the round: draft (width > 1) -> verify (one target forward, replayed from the graph of its
lane bucket) -> accept (on the device) -> ONE read of every result to the host -> commit (validated on
the host, then the kernels) and the new draft context. Plain decoding is the same round at width 1,
whose commit (one row per lane, known before the round) is checked first and runs with the verify.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from deltaflash.cache.commit import (apply_tree_plan, check_chains, commit, commit_unread_chains, commit_unread_tree,
                                     record_lengths)
from deltaflash.cache.draft_context import DraftContextCache
from deltaflash.cache.pages import pages_for
from deltaflash.cache.slots import SlotPool, kv_bytes_per_token
from deltaflash.core.batch import CommitPlan, ExtendBatch, VerifyBatch, VerifyOutput, to_device
from deltaflash.core.request import MAX_LOGPROBS, RoundPhases, TokenLogprob
from deltaflash.engine.config import EngineConfig
from deltaflash.engine.graphs import (FRESH_PREFILL_MIN_ROWS, PREFILL_ROWS, CudaGraphs, buckets_for,
                                      prefill_graph_buckets, prefill_graph_sizes, prefill_shapes)
from deltaflash.engine.memory import CPU_KV_BYTES, PagePlan, cuda_budget, plan_pages
from deltaflash.engine.scheduler import Fork, PrefillChunk, Restore, StepPlan
from deltaflash.models.layers import is_routed, route_products
from deltaflash.ops.attention import dense as dense_attention
from deltaflash.ops.gdn import fla_launch
from deltaflash.ops.gemm.invariant import invariant_linear
from deltaflash.ops.gemm.skinny import SkinnyGemms
from deltaflash.ops.kernels import kernels_named
from deltaflash.speculative.acceptance import Accepted, accept, token_logprobs
from deltaflash.speculative.grammar import lane_masks
from deltaflash.speculative.logit_rules import LogitRules, PenaltyHistory
from deltaflash.speculative.sampling import ALL_GREEDY, LaneSampling
from deltaflash.speculative.policy import RoundCosts
from deltaflash.speculative.sources import DFlashSource, DraftSource
from deltaflash.speculative.tree import DraftTree, accept_tree


@dataclass(frozen=True)
class Emitted:
    """What lanes produced, read to the host: accepted[i] drafts accepted by lane i, tokens[i] the
    tokens it emits (accepted drafts, then the next token), logprobs[i] theirs (None: not asked for),
    paths[i] (tree rounds) the nodes it accepted, the root first."""

    accepted: tuple[int, ...] = ()
    tokens: tuple[tuple[int, ...], ...] = ()
    logprobs: tuple[tuple[TokenLogprob, ...] | None, ...] = ()
    paths: tuple[tuple[int, ...], ...] | None = None  # tree rounds: each lane's accepted node path, the root first


@dataclass(frozen=True)
class StepResult:
    """first: the first generated token of each prefill chunk that completed its prompt (plan order);
    round: decode lane i's output (plan.decode order). Seconds are host wall time."""

    first: Emitted = Emitted()
    round: Emitted = Emitted()
    prefill_s: float = 0.0
    decode_s: float = 0.0
    phases: RoundPhases = RoundPhases()
    prefill_graphed: bool = False  # the step's prefill replayed a prefill graph
    device_idle_s: float | None = None  # the device's wait for this step since the previous one (IdleClock)
    prefill_rows: int = 0  # rows the step's prefill computed: a replayed graph's lanes x T, padding included
    # prompt tokens' logprobs by prefill chunk index (plan order), for the chunks whose request asks for them
    prompt_logprobs: dict[int, tuple[TokenLogprob, ...]] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True)
class _Round:
    """A round's device work up to acceptance (before the host reads anything)."""

    slot_ids: Tensor | None  # None (and start): a greedy round's graph (committed inside it)
    start: Tensor | None
    out: VerifyOutput | None  # None: a greedy round's graph
    accepted: Accepted
    tree: DraftTree | None = None
    committed: bool = False  # its rows were committed before the read (chains); the lengths are recorded after it
    recorded: bool = False  # ... and its lengths too (a width-1 round: ModelRunner.decode)


class IdleClock:
    """How long the device waits for the host between two steps (CUDA; None elsewhere). A timing event
    is recorded before a step's first device work and one after its last. The device reaches the first
    once it has finished what came before and the host has launched it, so the time from the previous
    step's last event to this step's first is time the device sat idle, waiting for the host. Both have
    completed by the step's one read of its results, which is when `idle_s` is asked (a step with
    nothing to read is not measured). Two events serve every step: each is recorded again only after
    its last reading."""

    def __init__(self, device: torch.device):
        self._cuda = device.type == "cuda"
        if self._cuda:
            self._begin, self._end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self._ended = self._measuring = False  # the end event holds the previous step's end / this step counts

    def begin(self, follows: bool) -> None:
        """Before a step's first device work. `follows`: the engine had work from the end of the
        previous step on (else the device waited for requests, not for the host: nothing to count)."""
        if self._cuda:
            self._begin.record()
            self._measuring = follows and self._ended

    def idle_s(self) -> float | None:
        return self._end.elapsed_time(self._begin) / 1e3 if self._measuring else None

    def end(self) -> None:
        """After a step's last device work."""
        if self._cuda:
            self._end.record()
            self._ended = True


class ModelRunner:
    def __init__(self, model, config: EngineConfig, drafter=None, draft_source: DraftSource | None = None,
                 max_model_len_given: bool = True, tensor_parallel=None):
        """Sizes the page pool by memory (engine/memory.py) and lowers config.max_model_len to what it
        holds when the length was not given (`max_model_len_given`; given, a pool too small for it is an
        error): `self.config` is the final config."""
        self.model, self.cfg = model, model.cfg
        self.scoring_rows = scoring_rows(self.cfg.vocab_size)  # rows a scored prompt's logits are computed for at once
        # the products' GEMM: cuBLAS, the batch-invariant kernel (target only) or a skinny table's tiles
        skinny = SkinnyGemms.load(config.skinny_gemm).linear if config.skinny_gemm != "off" else None
        for module, product in ((model, invariant_linear if config.batch_invariant else skinny), (drafter, skinny)):
            if module is not None and (product is not None or is_routed(module)):
                route_products(module, product or F.linear)  # (F.linear: what an earlier engine routed, restored)
        # fla-core's chunked prefill kernels: this engine's launch table (the process's: fla-core's are)
        fla_launch.use(fla_launch.LaunchTable.load(config.fla_tiles) if config.fla_tiles != "off" else None)
        param = model.embed_tokens.weight
        self.device, self.dtype = param.device, param.dtype
        self.kernels = kernels_named(config.kernels)
        if config.batch_invariant:  # a prefill chunk's attention on the paged kernel's fixed tiles too
            self.kernels = dataclasses.replace(self.kernels, prefill_attention=None)
        # prefill chunks may attend over dense K/V (ops/attention/dense.py; the model decides per chunk)
        self.dense_prefill = self.kernels.prefill_attention is not None and \
            dense_attention.supports(self.dtype, self.device, model.cfg.head_dim)
        self.page_plan = self._plan_pages(config, drafter)
        if config.tensor_parallel_size > 1:  # every rank's scheduler plans over the same pool
            fewest = tensor_parallel.smallest(self.page_plan.num_pages, self.device)
            self.page_plan = dataclasses.replace(self.page_plan, num_pages=fewest)
        self.config = config = config.fit_to_pages(self.page_plan.tokens, max_model_len_given)
        W = config.block_size
        # verify rows of a sequence at its last position reach up to W - 1 positions further
        capacity = config.max_model_len + config.reach
        self.pool = SlotPool(self.cfg, config.max_slots, capacity, self.dtype, self.device, config.page_size,
                             self.page_plan.num_pages, saved_rows=config.prefix_cache or 0)
        self.graphs = CudaGraphs(config.max_slots, self.device) if config.cuda_graphs else None
        factory = self.graphs.add if self.graphs is not None else None
        if drafter is not None:
            # (the module's state: a drafter serves the kernel set of the last engine built on it)
            fused = self.kernels.fused
            drafter.use_kernels(self.kernels.plain_rms_norm if fused else None, self.kernels.rope if fused else None)
            draft_source = DFlashSource(drafter, model.vocab, self.pool.tables, W, factory, self.kernels,
                                        (config.tree_budget, config.tree_top_k) if config.tree_budget else None,
                                        chains=len(config.widths) > 1)
        elif draft_source is not None:
            draft_source.use_kernels(self.kernels)
        self.source = draft_source
        self.penalty_history = PenaltyHistory(config.max_slots, self.cfg.vocab_size, self.device)
        self.tap_layer_ids = tuple(draft_source.tap_layer_ids) if draft_source is not None else ()
        # a vocabulary-parallel target's verify forward (and its graphs) returns this rank's share of the
        # logits: a round gathers them only when it needs whole rows (sampling, logit rules, logprobs, trees)
        self.shard_logits = model.vocab.sharded
        self.widths = config.widths  # chain widths (trees: their own graphs)
        self.verify_graphs = {}
        self.decode_graphs = None  # width-1 rounds: the verify forward and the commit of its row, one graph
        if self.graphs is not None:
            for w in self.widths:
                inputs = ((w,), torch.long, 0), ((), torch.long, -1), ((), torch.long, 0)
                if w == 1 and self.kernels.fused:  # (the reference commit walks host lanes: not capturable)
                    self.decode_graphs = self.graphs.add("decode W=1 (verify + commit)", self._decode_rows, inputs)
                else:
                    self.verify_graphs[w] = self.graphs.add(f"verify W={w}", self._verify_rows, inputs)
            if config.tree_budget:
                N = config.tree_budget
                inputs = ((N,), torch.long, 0), ((), torch.long, -1), ((), torch.long, 0), ((N,), torch.long, -1), \
                    ((N,), torch.long, 0)
                self.verify_graphs[("tree", N)] = self.graphs.add(f"verify tree of {N}", self._verify_rows, inputs)
        # greedy rounds - chains of each width > 1, or the engine's trees - as one graph each: drafting, verify,
        # acceptance, commit and context append (keys: the width, ("tree", N))
        self.round_graphs = {}
        if self.graphs is not None and config.round_graphs and self.kernels.fused and config.tensor_parallel_size == 1 \
                and hasattr(draft_source, "greedy_drafts"):
            lane = ((), torch.long, 0), ((), torch.long, -1), ((), torch.long, 0), ((), torch.long, 0)
            for w in self.widths[1:]:
                self.round_graphs[w] = self.graphs.add(f"greedy round W={w}", functools.partial(self._greedy_round,
                                                                                                  width=w), lane)
            if config.tree_budget:  # (+ each lane's budget: a request may ask for a smaller tree)
                N, budget = config.tree_budget, ((), torch.long, 0)
                self.round_graphs[("tree", N)] = self.graphs.add(f"greedy tree round of {N}", self._greedy_tree_round,
                                                                 lane + (budget,))
        self.prefill_graphs = {}  # chunk rows T -> the graphs of prefill steps of up to `lanes` chunks of <= T rows
        self.fresh_prefill_graphs = {}  # the same for first chunks, at the larger T (graphs.FRESH_PREFILL_MIN_ROWS)
        if self.graphs is not None and config.prefill_graphs:
            # T -> lane buckets of the prefill graph shapes (the scheduler plans steps by the same table)
            for T, buckets in prefill_graph_buckets(*prefill_graph_sizes(config)).items():
                inputs = ((T,), torch.long, 0), ((), torch.long, -1), ((), torch.long, 0), ((), torch.long, 0), \
                    ((), torch.long, self.pool.state_sink)
                self.prefill_graphs[T] = self.graphs.add(f"prefill of {T} rows", self._prefill_rows, inputs,
                                                         buckets=buckets)
                if self.dense_prefill and T >= FRESH_PREFILL_MIN_ROWS:
                    first_chunks = functools.partial(self._prefill_rows, starts_sequences=True)
                    self.fresh_prefill_graphs[T] = self.graphs.add(f"first prefill chunk of {T} rows", first_chunks,
                                                                   inputs, buckets=buckets)
        self.idle_clock = IdleClock(self.device)

    # ---- the page pool ------------------------------------------------------------------------
    def _plan_pages(self, config: EngineConfig, drafter) -> PagePlan:
        page_size = config.page_size
        per_token = kv_bytes_per_token(self.cfg, self.dtype)
        if drafter is not None:
            c = drafter.config
            per_token += DraftContextCache.bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, drafter.dtype)
        most = config.max_slots * pages_for(config.max_model_len + config.reach, page_size)
        if config.kv_cache_memory is not None:
            budget, source = config.kv_cache_memory, "--kv-cache-memory"
        elif self.device.type != "cuda":
            budget, source = CPU_KV_BYTES, "the CPU default"
        else:
            budget = cuda_budget(self.device, config.gpu_memory_utilization, self._slot_state_bytes(config),
                                 self._probe_peak_bytes(config, drafter))
            source = f"{config.gpu_memory_utilization:.0%} of the device less weights, slot state and activations"
        return plan_pages(budget, per_token * page_size, page_size, most, source)

    def _slot_state_bytes(self, config: EngineConfig) -> int:
        cfg, G = self.cfg, len(self.cfg.gdn_layer_ids)
        conv = cfg.conv_channels * (cfg.conv_kernel - 1) * torch.tensor([], dtype=self.dtype).element_size()
        state = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
        rows = config.max_slots + (config.prefix_cache or 0)  # (+ the prefix cache's saved rows)
        return rows * G * (conv + state) + G * state  # (+ the pool's state sink)

    @torch.inference_mode()
    def _probe_peak_bytes(self, config: EngineConfig, drafter) -> int:
        """Peak activation bytes of the largest prefill step (the budget's rows, every row's hidden state kept
        and then a block of them scored as a prompt's logprobs are; with prefill graphs, the rows a padded step
        may reach; plus the dense attention route's gathered context, which a probe chunk at position 0 does not
        reach) plus those of a round (draft, verify) at the largest lane bucket, measured on a probe pool of
        static pages for a few positions per slot."""
        W, lanes = config.block_size, buckets_for(config.max_slots)[-1]
        rows = config.idle_prefill_tokens
        if config.prefill_graphs:
            rows = max(rows, *(T * n for T, n in prefill_shapes(*prefill_graph_sizes(config))))
        chunk = min(rows, config.max_model_len)
        probe = SlotPool(self.cfg, min(config.max_slots, lanes), chunk + W, self.dtype, self.device, config.page_size)
        source = None
        if drafter is not None:
            source = DFlashSource(drafter, self.model.vocab, probe.tables, W, kernels=self.kernels)
        taps = tuple(source.tap_layer_ids) if source is not None else ()
        torch.cuda.synchronize(self.device)
        peaks = []
        for run in ("prefill", "round"):
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device)
            if run == "prefill":
                hidden, _ = self.model.extend(ExtendBatch.build([(0, 0, [0] * chunk)], self.device), probe,
                                              self.kernels, tap_layer_ids=taps, all_hidden=True)
                n = min(chunk, self.scoring_rows)  # (_score_prompt's block)
                token_logprobs(self.model.logits(hidden[0, :n], self.kernels),
                               torch.zeros(n, dtype=torch.long, device=self.device), MAX_LOGPROBS, ranks=True)
                del hidden
            else:
                slot_ids = torch.arange(lanes, device=self.device)
                slot_ids = torch.where(slot_ids < probe.num_slots, slot_ids, -1)
                zeros = torch.zeros(lanes, dtype=torch.long, device=self.device)
                if source is not None:
                    source._block_logits(slot_ids, zeros, zeros)
                batch = VerifyBatch.chain(torch.zeros(lanes, W, dtype=torch.long, device=self.device), slot_ids, zeros)
                self.model.verify(batch, probe, self.kernels, taps)
            torch.cuda.synchronize(self.device)
            peaks.append(torch.cuda.max_memory_allocated(self.device) - base)
        if self.dense_prefill:  # a long prompt's later chunk gathers its context
            peaks[0] += dense_attention.gather_bytes(config.max_model_len, self.cfg.num_kv_heads, self.cfg.head_dim,
                                                     self.dtype)
        del probe, source
        torch.cuda.empty_cache()
        return sum(peaks)

    # ---- start-up -----------------------------------------------------------------------------
    @torch.inference_mode()
    def warm_up(self, progress: bool = False) -> float:
        """Capture every CUDA graph and compile every kernel a request can meet, before any request:
        nothing compiles or captures inside one. Returns the seconds it took (0 on CPU)."""
        if self.device.type != "cuda":
            return 0.0
        t0 = time.perf_counter()
        if self.graphs is not None:
            self.graphs.capture_all(progress)
        else:
            zeros, padding = (torch.full((1,), v, dtype=torch.long, device=self.device) for v in (0, -1))
            for w in self.widths:  # the verify route's kernels (and at width 1 the commit's), on one padding lane
                if w == 1:
                    self.decode(zeros[:, None], padding, zeros, (-1,), (0,))
                else:
                    self._verify_rows(zeros.expand(1, w), padding, zeros)
        for n in sorted({1, min(64, self.config.max_model_len)}):  # prefill kernels on slot 0, then reset
            batch = ExtendBatch.build([(0, 0, [0] * n)], self.device)
            self.model.extend(batch, self.pool, self.kernels, tap_layer_ids=self.tap_layer_ids)
            self.pool.reset(0)
            if self.source is not None:
                self.source.reset(0)
        torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    @torch.inference_mode()
    def eager_prefill_rows(self) -> float:
        """The rows of prefill-graph work that cost what an eager prefill step's launching does: a 64-row
        eager prefill step's wall time (host-bound: its launches, fla-core's per-call work; the target's
        forward and the draft context's append, as a step runs them) over the per-row time of the largest
        prefill graph replayed whole (device-bound; the same work), both timed here on slot 0 and padding
        lanes (then reset). 0 without prefill graphs (CPU), and on tensor-parallel ranks (whose plans must
        not follow their own timings). The scheduler plans by it: it weighs cutting prompts to fit a graph
        against an eager step (Scheduler._graph_fit), lets a padded graph replay where the eager step costs
        more (graphs.padded_rows_allowed), and runs a long chunk after many keys eagerly only where its rows
        reach it or the keys are many (graphs.long_chunk_runs_eagerly)."""
        if not self.prefill_graphs or self.device.type != "cuda" or self.config.tensor_parallel_size > 1:
            return 0.0
        T = max(self.prefill_graphs)
        graphs = self.prefill_graphs[T]
        lanes = graphs.buckets[-1]
        padding = (torch.zeros(lanes, T, dtype=torch.long, device=self.device),
                   *(torch.full((lanes,), v, dtype=torch.long, device=self.device) for v in (-1, 0, 0, 0)))
        seconds = []
        for run in (lambda: self._extend_lanes([(0, 0, [0] * PREFILL_ROWS)]), lambda: graphs.run(*padding)):
            for _ in range(2):  # the second of two runs
                torch.cuda.synchronize(self.device)
                t0 = time.perf_counter()
                run()
                torch.cuda.synchronize(self.device)
                elapsed = time.perf_counter() - t0
                self.pool.reset(0)
                if self.source is not None:
                    self.source.reset(0)
            seconds.append(elapsed)
        eager, graph = seconds
        return eager / (graph / (lanes * T))

    @torch.inference_mode()
    def calibrate(self, reps: int = 2) -> RoundCosts:
        """Seconds of a round's device work (the draft when it drafts, and the verify forward; at width 1
        with its commit) at every lane bucket and width, timed on padding lanes (which commit nothing;
        the last of `reps` runs): the seed of the cost
        model that load-adaptive speculation uses (speculative/policy.py)."""
        costs = RoundCosts(buckets=buckets_for(self.config.max_slots))
        sync = (lambda: torch.cuda.synchronize(self.device)) if self.device.type == "cuda" else (lambda: None)
        for bucket in buckets_for(self.config.max_slots):
            slot_ids = torch.full((bucket,), -1, dtype=torch.long, device=self.device)
            zeros = torch.zeros(bucket, dtype=torch.long, device=self.device)
            sampling = LaneSampling.greedy_lanes(bucket, self.device)
            for w in self.widths:
                for _ in range(reps):
                    sync()
                    t0 = time.perf_counter()
                    if w > 1 and isinstance(self.source, DFlashSource):  # scripted drafts: host time, measured online
                        self.source.draft((), slot_ids, zeros, zeros, sampling)
                    if w == 1:
                        self.decode(zeros[:, None], slot_ids, zeros, (-1,) * bucket, (0,) * bucket)
                    else:
                        self.verify(torch.zeros(bucket, w, dtype=torch.long, device=self.device), slot_ids, zeros, w)
                    sync()
                    seconds = time.perf_counter() - t0
                costs.seeds[(bucket, w)] = seconds
        return costs

    # ---- one step -----------------------------------------------------------------------------
    @torch.inference_mode()
    def begin(self, plan: StepPlan) -> None:
        """What a plan does first, whether or not it runs anything: the finished sequences' states the prefix cache
        keeps saved (before their slots are reset for others), then its page changes (map_pages)."""
        for slot, row in plan.saves:
            self.pool.save(slot, row)
        self.map_pages(plan)

    @torch.inference_mode()
    def map_pages(self, plan: StepPlan) -> None:
        """The plan's page changes on the device: released slots' entries to the sink, then the grants."""
        self.pool.tables.update(plan.released, plan.pages)

    @torch.inference_mode()
    def execute(self, plan: StepPlan, overlap: Callable[[], None] | None = None, follows: bool = False) -> StepResult:
        """Run the plan. `overlap` (optional) runs once, after the step's device work up to acceptance is
        launched and before the host reads its results: host work that needs no result of this step
        runs while the device computes. `follows`: the engine had work since the previous step (the
        device's wait between the two is measured: StepResult.device_idle_s)."""
        self.idle_clock.begin(follows)
        self.begin(plan)
        for seq in plan.admitted:
            self.pool.reset(seq.slot)
            if self.source is not None:
                self.source.reset(seq.slot)
        if plan.restores:
            self._restore(plan.restores)
        t0 = time.perf_counter()
        first, graphed, scores = self._prefill(plan.prefill, plan.forks, plan.prefill_graph) if plan.prefill \
            else (None, 0, {})
        for snapshot in plan.snapshots:  # (after the restores: an evicted entry's row may be taken again)
            self.pool.save(snapshot.seq.slot, snapshot.row)
        t1 = clock = time.perf_counter()
        round_, marks = None, []
        if plan.decode:
            round_, marks = self._round(plan)  # marks: the draft's end, the verify's end
        overlap_s = 0.0
        if overlap is not None:
            ts = time.perf_counter()
            overlap()
            overlap_s = time.perf_counter() - ts
        # a tree round committed after the read validates its paths against the trees' parents, read with it
        late_tree = round_ is not None and round_.tree is not None and not round_.committed
        extras = (round_.tree.parents,) if late_tree else ()
        (first_out, round_out), parents = read_emitted([first, round_.accepted if round_ else None], extras)  # the one sync
        prompt_logprobs = {i: read_scores(plan.prefill[i], s) for i, s in scores.items()}  # (after it: no wait)
        # only a read waits for the device to pass the step's begin event (a prefill chunk that does not
        # finish its prompt has nothing to read: its wait is not measured)
        idle = self.idle_clock.idle_s() if first is not None or round_ is not None else None
        read = self._now()
        if round_ is not None and not round_.committed:
            self._commit(plan, round_, round_out.accepted, round_out.paths, parents[0] if parents else None)
        elif round_ is not None and not round_.recorded:
            record_lengths(self.pool, [s.slot for s in plan.decode], [s.position for s in plan.decode],
                           [n + 1 for n in round_out.accepted])
        self.idle_clock.end()
        phases = RoundPhases()
        if round_ is not None:  # the host's own time: the overlap work is the caller's (it fell in the accept)
            drafted, verified = marks  # (a width-1 round commits inside its verify)
            phases = RoundPhases(drafted - clock, verified - drafted, read - verified - overlap_s, self._now() - read)
        return StepResult(first_out, round_out, prefill_s=t1 - t0,
                          decode_s=time.perf_counter() - t1 - overlap_s if round_ else 0.0, phases=phases,
                          prefill_graphed=graphed > 0, device_idle_s=idle,
                          prefill_rows=graphed or sum(len(c.tokens) for c in plan.prefill),
                          prompt_logprobs=prompt_logprobs)

    def _prefill(self, chunks: tuple[PrefillChunk, ...], forks: tuple[Fork, ...] = (),
                 graph: tuple[int, int] | None = None) -> tuple[Accepted | None, int, dict]:
        """Run the chunks (`graph`: the prefill graph the plan replays them in, StepPlan.prefill_graph; None:
        eagerly), then fill the `forks`' slots from their leaders';
        returns (the first tokens [n, 1] of the chunks that complete their prompt and then of the forks, or
        None; the rows of the prefill graph that ran them, padding included, or 0 where they ran eagerly; the
        prompt logprobs of chunks whose request asks for them, by chunk index: `_score_prompt`'s tensors). The
        logits of the rows that sample a first token alone are computed (lm_head reads the whole vocabulary's
        weights, ~2 GB at the 9B shape: a long prompt's chunks that do not end it skip it)."""
        scored = [i for i, c in enumerate(chunks) if c.seq.params.prompt_logprobs is not None]
        if scored:
            hidden, graphed, scores = self._prefill_scored(chunks, scored, graph)
        else:
            (hidden, graphed), scores = self._prefill_hidden(chunks, graph), {}
        if forks:
            self._fork(forks)
        done = [i for i, c in enumerate(chunks) if c.emits]
        if not done:
            return None, graphed, scores
        seqs = [chunks[i].seq for i in done] + [f.seq for f in forks]
        done += [f.chunk for f in forks]  # (a fork samples from its leader's last row)
        sampling = LaneSampling.build([s.params for s in seqs], [s.seed for s in seqs], [s.draws for s in seqs],
                                      self.device)
        if done != list(range(len(chunks))):
            hidden = hidden[to_device(done, self.device)]
        rows = self.model.logits(hidden, self.kernels)[:, None]  # [n, 1, V]
        none = torch.zeros(len(done), dtype=torch.long, device=self.device)
        drafts = none[:, None][:, :0]
        return accept(rows, drafts, None, none, sampling, self._rules(seqs, drafts, 1), top_logprobs(seqs)), graphed, \
            scores

    def _restore(self, restores: tuple[Restore, ...]) -> None:
        """Admitted sequences start from a kept prompt's saved state (engine/prefix_cache.py): the GDN state and
        length, and a copy of the kept prompt's partial last page in the target's K/V and the drafter's context
        (its whole pages are mapped into the slot's table with the plan's pages)."""
        for r in restores:
            self.pool.restore(r.row, r.seq.slot, r.tokens)
        self._copy_pages([r.page for r in restores if r.page is not None])

    def _fork(self, forks: tuple[Fork, ...]) -> None:
        """Each fork's slot becomes a copy of its leader's, whose prefill this step completed: the GDN state and
        length (SlotPool.fork) and the partial last prompt page, in the target's K/V and the drafter's context
        (the whole prompt pages are the leader's own, mapped into the fork's table with the plan's pages)."""
        self.pool.fork([f.leader.slot for f in forks], [f.seq.slot for f in forks])
        self._copy_pages([f.page for f in forks if f.page is not None])

    def _copy_pages(self, copied: list[tuple[int, int]]) -> None:
        """Page b becomes a copy of page a for each (a, b) in `copied`, in the target's K/V and the drafter's
        context (a fork's or a restored sequence's partial last prompt page)."""
        if copied:
            pages = to_device(np.array(copied, dtype=np.int64).T.copy(), self.device)  # [2, N]
            self.pool.copy_pages(pages)
            if self.source is not None:
                self.source.copy_pages(pages)

    def _prefill_hidden(self, chunks: tuple[PrefillChunk, ...], graph: tuple[int, int] | None) -> tuple[Tensor, int]:
        """(the last hidden state [n, H] of each chunk's last row, before the final norm; the prefill graph's
        rows, or 0 where it ran eagerly): replayed in `graph` where the runner has prefill graphs, else eagerly."""
        if graph is not None and self.prefill_graphs:
            return self._prefill_replay(chunks, graph)
        return self._extend(chunks)[0], 0

    def _extend(self, chunks, all_hidden: bool = False) -> tuple[Tensor, ExtendBatch]:
        """The chunks' eager prefill forward, their rows appended to the draft context: (the last hidden state
        [n, H] of each chunk's last row, or with all_hidden of every row [n, T, H], before the final norm; the
        batch)."""
        return self._extend_lanes([(c.seq.slot, c.start, list(c.tokens)) for c in chunks], all_hidden)

    def _extend_lanes(self, lanes: list[tuple[int, int, list[int]]], all_hidden: bool = False
                      ) -> tuple[Tensor, ExtendBatch]:
        """_extend's work for lanes of (slot, start, tokens)."""
        batch = ExtendBatch.build(lanes, self.device)
        out, taps = self.model.extend(batch, self.pool, self.kernels, tap_layer_ids=self.tap_layer_ids,
                                      all_hidden=all_hidden, last_hidden=not all_hidden)
        self._append_prompt_rows(batch, taps)
        return out, batch

    def _prefill_scored(self, chunks: tuple[PrefillChunk, ...], scored: list[int], graph: tuple[int, int] | None):
        """_prefill's work where the chunks `scored` (indices) ask for prompt logprobs: those run eagerly in a
        forward of their own that keeps every row's hidden state, projected to logits and scored a block of
        `scoring_rows` rows at a time (`_score_prompt`), the others as ever. Returns (last rows' hidden states
        [n, H] in chunk order, graph rows, scores by chunk index)."""
        others = [i for i in range(len(chunks)) if i not in scored]
        parts, graphed = [], 0
        if others:
            hidden, graphed = self._prefill_hidden(tuple(chunks[i] for i in others), graph)
            parts.append(hidden)
        hidden, batch = self._extend([chunks[i] for i in scored], all_hidden=True)  # [L, T, H]
        scores = {i: self._score_prompt(chunks[i], hidden[j]) for j, i in enumerate(scored)}
        lanes = torch.arange(len(scored), device=self.device)
        parts.append(hidden[lanes, batch.n_rows - 1])
        order = np.argsort(np.array(others + scored))  # chunk i's row in the concatenation
        return torch.cat(parts)[to_device(order, self.device)], graphed, {i: s for i, s in scores.items() if s}

    def _score_prompt(self, chunk: PrefillChunk, hidden: Tensor) -> tuple:
        """The logprobs of the prompt tokens this chunk's rows predict (row r: the token at start + r + 1; hidden
        [T, H] its rows' last hidden states), those the request has not been given yet (a recomputed prefix
        after a preemption has): (index of the first such prompt token, logprobs [m], top ids [m, k] or None,
        top logprobs [m, k] or None, ranks [m]), or (). The rows' logits are computed `scoring_rows` at a time."""
        seq = chunk.seq
        first = max(chunk.start + 1, 1 + len(seq.prompt_logprobs))
        end = min(chunk.start + len(chunk.tokens), len(seq.prompt_ids) - 1) + 1  # prompt tokens first..end-1
        if first >= end:
            return ()
        targets = to_device(seq.prompt_array[first:end], self.device)
        rows = hidden[first - 1 - chunk.start:end - 1 - chunk.start]  # row r predicts target r
        blocks = [token_logprobs(self.model.logits(rows[i:i + self.scoring_rows], self.kernels),
                                 targets[i:i + self.scoring_rows], seq.params.prompt_logprobs, ranks=True)
                  for i in range(0, end - first, self.scoring_rows)]
        return (first, *(None if parts[0] is None else torch.cat(parts) for parts in zip(*blocks)))

    def _append_prompt_rows(self, batch: ExtendBatch, taps: Tensor | None, graphs: bool = True) -> None:
        """A prefill's valid rows become draft context."""
        if self.source is not None and taps is not None:
            rows = torch.arange(batch.input_ids.shape[1], device=self.device)
            kept = torch.where(rows[None] < batch.n_rows[:, None], batch.slot_ids[:, None], -1)
            self.source.append(kept, batch.positions, taps, graphs=graphs)

    def _prefill_rows(self, input_ids: Tensor, slot_ids: Tensor, start: Tensor, n_rows: Tensor,
                      state_slots: Tensor, starts_sequences: bool = False) -> Tensor:
        """What a prefill graph captures: the target's forward of a fixed-shape batch (ExtendBatch.padded;
        `starts_sequences`: a first chunk's graph) and the drafter's context append of its rows. Returns the
        last hidden state [L, H] of each lane's last row (before the final norm: the runner projects the rows
        that sample a token, _prefill)."""
        batch = ExtendBatch.padded(input_ids, slot_ids, start, n_rows, state_slots, starts_sequences)
        hidden, taps = self.model.extend(batch, self.pool, self.kernels, tap_layer_ids=self.tap_layer_ids,
                                         last_hidden=True)
        self._append_prompt_rows(batch, taps, graphs=False)
        return hidden

    def _prefill_replay(self, chunks: tuple[PrefillChunk, ...], graph: tuple[int, int]) -> tuple[Tensor, int]:
        """The chunks' last hidden states [n, H] and the graph's rows (lanes x T) from the prefill graph `graph`
        (T, lanes) the scheduler chose for them (Scheduler.prefill_graph). Padding lanes keep their GDN state in
        the pool's state sink."""
        L = len(chunks)
        shape, lanes = graph
        graphs = self.prefill_graphs[shape]
        if all(c.start == 0 for c in chunks):  # first chunks only: their attention reads no page
            graphs = self.fresh_prefill_graphs.get(shape, graphs)
        slots = [c.seq.slot for c in chunks]
        pad, sink = lanes - L, self.pool.state_sink
        ids = np.zeros((lanes, shape), dtype=np.int64)
        for row, c in zip(ids, chunks):
            row[:len(c.tokens)] = c.tokens
        per_lane = np.array([slots + [-1] * pad, [c.start for c in chunks] + [0] * pad,
                             [len(c.tokens) for c in chunks] + [0] * pad, slots + [sink] * pad], dtype=np.int64)
        (hidden,) = graphs.run_host(ids, *per_lane)  # one transfer into the graph's inputs
        for c in chunks:  # what extend records from a batch's host mirrors
            self.pool.lengths[c.seq.slot] = c.start + len(c.tokens)
        return hidden[:L], lanes * shape

    def _round(self, plan: StepPlan) -> tuple[_Round, list[float]]:
        seqs, W = plan.decode, plan.round_width
        slots, starts = [s.slot for s in seqs], [s.position for s in seqs]
        # drafts a lane may accept: its width less one, and no more than the round's rows (a tree of W nodes
        # is at most W - 1 drafts deep); a grammar lane speculates only in chains
        limits = [0 if plan.tree_budget and s.matcher is not None else min(w, W) - 1 for s, w in zip(seqs, plan.widths)]
        graphs = self._greedy_round_graphs(seqs, ("tree", W) if plan.tree_budget else W)
        if W > 1:  # (a width-1 round checks in decode) a stale lane is refused before the verify writes its rows;
            # a round graph commits before the read too: room for each lane's most rows (commit_unread_chains)
            most = [n + 1 for n in limits] if graphs is not None else (1,) * len(slots)
            check_chains(self.pool, slots, most, starts, W if graphs is not None else 1)
        budgets = [min(s.params.tree_budget or W, W) for s in seqs]
        pending = [s.pending for s in seqs]
        if graphs is not None:  # a greedy round's graph (committed inside it): its inputs in one transfer
            trees = plan.tree_budget and W > 1
            inputs = (pending, slots, starts, limits, budgets) if trees else (pending, slots, starts, limits)
            out = graphs.run_host(*(np.asarray(x, dtype=np.int64) for x in inputs))
            if out is not None:
                marks = [self._now()] * 2  # (one launch: the draft phase holds it, the verify phase is empty)
                accepted = Accepted(counts=out[0], tokens=out[1], path=out[2] if trees else None)
                return _Round(None, None, None, accepted, committed=True), marks
        lanes = to_device([slots, starts, pending, limits, budgets], self.device)
        slot_ids, start, anchors, n_draft, budget = lanes  # one transfer, five [L] rows
        sampling = LaneSampling.build([s.params for s in seqs], [s.seed for s in seqs], [s.draws for s in seqs],
                                      self.device)
        if plan.tree_budget and W > 1:
            tree = self.source.draft_tree(seqs, slot_ids, anchors, start, W, self.config.tree_top_k).cut(budget)
            marks = [self._now()]
            out = self.verify(tree.tokens, slot_ids, start, max(starts) + W, tree)
            marks.append(self._now())
            rules = self._rules(seqs, None, W)
            raw = self._whole_rows(out.logits)
            logits = raw if rules is None else rules.apply(raw, None, tree)
            accepted = accept_tree(logits, tree, n_draft, sampling, top_logprobs(seqs), raw=raw,
                                   walk=self.kernels.greedy_tree_walk)
            if not self.kernels.fused:  # the reference commit walks the lanes' paths on the host: after the read
                return _Round(slot_ids, start, out, accepted, tree), marks
            rows = accepted.counts + 1  # as a chain round's: committed on the device, before the read
            commit_unread_tree(self.pool, out, self.kernels, slot_ids, start, accepted.path, rows, slots, starts,
                               [n + 1 for n in limits], W)
            self._append_round_rows(slot_ids, start, path_rows(out.taps, accepted.path), rows)
            return _Round(slot_ids, start, out, accepted, tree, committed=True), marks
        drafts, draft_q = anchors[:, None][:, :0], None
        if W > 1:  # the block's W - 1 drafts, of which a narrower round verifies the first ones
            drafts, draft_q = self.source.draft(seqs, slot_ids, anchors, start, sampling)
            drafts, draft_q = drafts[:, :W - 1], None if draft_q is None else draft_q[:, :W - 1]
        marks = [self._now()]
        if W == 1:
            out = self.decode(anchors[:, None], slot_ids, start, slots, starts)
        else:
            out = self.verify(torch.cat([anchors[:, None], drafts], dim=1), slot_ids, start, max(starts) + W)
        marks.append(self._now())
        rules, logprobs = self._rules(seqs, drafts, W), top_logprobs(seqs)
        if self.shard_logits and sampling.all_greedy and rules is None and logprobs is None:
            # greedy lanes need only each row's argmax: no gather of the rows (models/vocab.py)
            accepted = accept(None, drafts, None, n_draft, sampling, argmax=self.model.vocab.argmax(out.logits))
        else:
            accepted = accept(self._whole_rows(out.logits), drafts, draft_q, n_draft, sampling, rules, logprobs)
        if W == 1:
            return _Round(slot_ids, start, out, accepted, committed=True, recorded=True), marks
        if not self.kernels.fused:  # the reference commit walks the lanes' counts on the host: after the read
            return _Round(slot_ids, start, out, accepted), marks
        # the fused commit reads the counts on the device, so it goes right behind the acceptance, before the
        # read: the device commits while the host waits for the results, instead of idling through the
        # commit's launches after them
        rows = accepted.counts + 1
        commit_unread_chains(self.pool, out, self.kernels, slot_ids, rows, slots, starts, [n + 1 for n in limits], W)
        self._append_round_rows(slot_ids, start, out.taps, rows)
        return _Round(slot_ids, start, out, accepted, committed=True), marks

    def _greedy_round_graphs(self, seqs, key):
        """The greedy round graphs of `key` (a chain width, or ("tree", N)) when every lane can take them
        (greedy, no logit rules, no grammar, no logprobs), else None."""
        graphs = self.round_graphs.get(key)
        if graphs is None or top_logprobs(seqs) is not None:
            return None
        return None if any(not s.params.greedy or s.params.has_rules or s.matcher is not None for s in seqs) else graphs

    def _whole_rows(self, logits: Tensor) -> Tensor:
        """A verify forward's logits over the whole vocabulary (a vocabulary-parallel rank's share gathered)."""
        return self.model.gather(logits) if self.shard_logits else logits

    def _rules(self, seqs, drafts: Tensor, width: int) -> LogitRules | None:
        """The lanes' logit rules. Grammar lanes need their drafts on the host to walk the grammar:
        a second host read, paid only by rounds with such a lane."""
        masks = None
        grammar = [s.matcher for s in seqs if s.matcher is not None]
        if grammar:  # a tree round (drafts None) masks only row 0: grammar lanes accept no draft there
            host = drafts.tolist() if width > 1 and drafts is not None else None
            masks = to_device(lane_masks(seqs, host, width, grammar[0].words), self.device)
        return LogitRules.build(seqs, self.cfg.vocab_size, self.device, masks, self.penalty_history)

    def _commit(self, plan: StepPlan, round_: _Round, accepted: Sequence[int],
                paths: tuple[tuple[int, ...], ...] | None = None, parents: list[int] | None = None) -> None:
        """Commit each lane's anchor and its `accepted` drafts (a tree round: the accepted path's nodes,
        `paths`, read with the results, as are the trees' `parents` for the plan's validation); they
        become draft context."""
        W, L = plan.round_width, len(plan.decode)
        n_rows = round_.accepted.counts + 1
        host = dict(slot_ids_host=tuple(s.slot for s in plan.decode), accepted_len_host=tuple(n + 1 for n in accepted),
                    start_host=tuple(s.position for s in plan.decode))
        path = round_.accepted.path
        if path is None:
            commit_plan = CommitPlan.chain(round_.slot_ids, n_rows, W, **host)
        else:
            commit_plan = CommitPlan.tree(round_.slot_ids, path, n_rows, W, accepted_nodes_host=paths,
                                          parents_host=tuple(tuple(parents[i * W:(i + 1) * W]) for i in range(L)),
                                          **host)
        commit(self.pool, commit_plan, round_.out, self.kernels)
        self._append_round_rows(round_.slot_ids, round_.start, path_rows(round_.out.taps, path), n_rows)

    def _append_round_rows(self, slot_ids: Tensor, start: Tensor, taps: Tensor | None, n_rows: Tensor,
                           graphs: bool = True) -> None:
        """The first n_rows[l] (device) of each lane's tapped rows, in token order, become draft context
        (graphs False: eagerly, the call itself being captured)."""
        if self.source is not None and taps is not None:
            rows = torch.arange(taps.shape[1], device=self.device)
            kept = torch.where(rows[None] < n_rows[:, None], slot_ids[:, None], -1)
            self.source.append(kept, start[:, None] + rows, taps, graphs=graphs)

    # ---- the verify forward -------------------------------------------------------------------
    def decode(self, anchors: Tensor, slot_ids: Tensor, start: Tensor, slots_host: Sequence[int],
               starts_host: Sequence[int]) -> VerifyOutput:
        """A width-1 round's verify forward of anchors [L, 1] AND its commit. Such a round accepts no
        draft, so every lane commits its one row whatever the logits say: the plan is known before the
        round, validated now, and committed right behind the verify - inside the decode graph when one
        holds the lanes (no launch after the step's read) - then appended to the draft context."""
        ones = (1,) * len(slots_host)
        check_chains(self.pool, slots_host, ones, starts_host, 1)  # before the first write (K/V rows included)
        if self.decode_graphs is not None and len(slots_host) <= self.decode_graphs.buckets[-1]:
            logits, taps, windows, log = self.decode_graphs.run(anchors, slot_ids, start)
            record_lengths(self.pool, slots_host, starts_host, ones)
            return VerifyOutput(logits=logits, taps=taps, conv_windows=windows.movedim(0, 1),
                                replay_log=log.movedim(0, 1))
        out = self.verify(anchors, slot_ids, start, max(starts_host) + 1)
        plan = CommitPlan.chain(slot_ids, torch.ones_like(slot_ids), 1, slot_ids_host=slots_host,
                                accepted_len_host=ones, start_host=starts_host)
        commit(self.pool, plan, out, self.kernels)
        if self.source is not None and out.taps is not None:
            self.source.append(slot_ids[:, None], start[:, None], out.taps)
        return out

    def _decode_rows(self, input_ids: Tensor, slot_ids: Tensor, start: Tensor):
        """What the decode graph captures: _verify_rows of one row per lane, the fused commit of that row
        (it reads device data only; the host checked the lanes before the replay, and padding lanes,
        slot -1, commit nothing) and the row's draft context."""
        out = logits, taps, windows, log = self._verify_rows(input_ids, slot_ids, start)
        ones = torch.ones_like(slot_ids)  # (the plan's host mirrors are the caller's: check_chains)
        plan = CommitPlan.chain(slot_ids, ones, 1, slot_ids_host=(), accepted_len_host=(), start_host=())
        self.kernels.commit_state(self.pool.recurrent_state, log.movedim(0, 1), self.pool.conv_history,
                                  windows.movedim(0, 1), plan)
        if self.source is not None and taps is not None:
            self.source.append(slot_ids[:, None], start[:, None], taps, graphs=False)
        return out

    def _greedy_round(self, anchors: Tensor, slot_ids: Tensor, start: Tensor, n_draft: Tensor, width: int):
        """What a greedy round's graph captures (every lane greedy, no logit rules, no logprobs): the
        drafter's block (whole tables), the verify forward of anchor + width - 1 drafts, greedy acceptance
        of at most n_draft[l] drafts, the fused commit of each lane's accepted rows and their draft
        context - no launch after the step's read. Returns (accepted counts [L], tokens [L, width]).
        The host checked the lanes for their most rows first (check_chains); padding lanes (slot -1)
        draft from zeros, write only to sinks and commit nothing."""
        drafts = self.source.greedy_drafts(slot_ids, anchors, start)[:, :width - 1]
        logits, taps, windows, log = self._verify_rows(torch.cat([anchors[:, None], drafts], dim=1), slot_ids, start)
        accepted = accept(logits, drafts, None, n_draft, ALL_GREEDY)
        rows = accepted.counts + 1
        plan = CommitPlan.chain(slot_ids, rows, width, slot_ids_host=(), accepted_len_host=(), start_host=())
        self.kernels.commit_state(self.pool.recurrent_state, log.movedim(0, 1), self.pool.conv_history,
                                  windows.movedim(0, 1), plan)
        self._append_round_rows(slot_ids, start, taps, rows, graphs=False)
        return accepted.counts, accepted.tokens

    def _greedy_tree_round(self, anchors: Tensor, slot_ids: Tensor, start: Tensor, n_draft: Tensor, budget: Tensor):
        """What a greedy tree round's graph captures (the _greedy_round of trees): the drafter's block and
        the engine's trees built from it (cut to each lane's budget[l] nodes), their verify forward, greedy
        acceptance of at most n_draft[l] nodes, the commit of each lane's accepted path (replay, conv
        history, K/V moved to their positions) and its draft context. Returns (accepted counts [L], tokens
        [L, D+1], accepted path [L, D+1]). The host checked the lanes for their most rows first."""
        tree = self.source.greedy_tree(slot_ids, anchors, start).cut(budget)
        logits, taps, windows, log = self._verify_rows(tree.tokens, slot_ids, start, tree.parents, tree.depth)
        accepted = accept_tree(logits, tree, n_draft, ALL_GREEDY, walk=self.kernels.greedy_tree_walk)
        rows = accepted.counts + 1
        out = VerifyOutput(logits=logits, taps=taps, conv_windows=windows.movedim(0, 1), replay_log=log.movedim(0, 1))
        apply_tree_plan(self.pool, CommitPlan.tree(slot_ids, accepted.path, rows, tree.budget), out, self.kernels,
                        start)
        self._append_round_rows(slot_ids, start, path_rows(taps, accepted.path), rows, graphs=False)
        return accepted.counts, accepted.tokens, accepted.path

    def verify(self, input_ids: Tensor, slot_ids: Tensor, start: Tensor, kmax: int,
               tree: DraftTree | None = None) -> VerifyOutput:
        """Rows input_ids [L, W] of lanes slot_ids [L] from positions start [L] - chains, or the nodes of
        `tree` - from the CUDA graph of the lane bucket when one fits, else eagerly reading `kmax` positions."""
        W = input_ids.shape[1]
        if tree is None:
            graphs, inputs = self.verify_graphs.get(W), (input_ids, slot_ids, start)
        else:
            graphs, inputs = self.verify_graphs.get(("tree", W)), (input_ids, slot_ids, start, tree.parents, tree.depth)
        out = graphs.run(*inputs) if graphs is not None else None
        if out is None:
            out = self._verify_rows(*inputs, kmax=kmax)
        logits, taps, windows, log = out
        return VerifyOutput(logits=logits, taps=taps, conv_windows=windows.movedim(0, 1),
                            replay_log=log.movedim(0, 1))

    def _verify_rows(self, input_ids: Tensor, slot_ids: Tensor, start: Tensor, parents: Tensor | None = None,
                     depth: Tensor | None = None, kmax: int | None = None):
        """W rows per lane - chains, or trees of parents / depth [L, W] - -> (logits [L, W, V], taps
        [L, W, n*H] or None, conv windows [L, G, C, K-1+W], replay log [L, G, W, nv, 1+dk+dv]): lanes
        first, as the graphs slice them. kmax None: attention reads whole tables (a fixed shape, for the graphs)."""
        if parents is None:
            batch = VerifyBatch.chain(input_ids, slot_ids, start)
        else:
            batch = VerifyBatch(input_ids=input_ids, parents=parents, positions=start[:, None] + depth,
                                slot_ids=slot_ids, start=start, slot_ids_host=(), start_host=())
        out = self.model.verify(batch, self.pool, self.kernels, self.tap_layer_ids, kmax=kmax,
                                gather_logits=not self.shard_logits)
        return out.logits, out.taps, out.conv_windows.movedim(1, 0), out.replay_log.movedim(1, 0)

    def _now(self) -> float:
        if self.config.sync_phase_timing and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()


def scoring_rows(vocab_size: int) -> int:
    """Rows of a scored prompt whose logits are computed at once: their fp32 logits within SCORED_LOGITS values
    (256 MiB; 270 rows of a 248k vocabulary), at least 16 rows."""
    return max(16, SCORED_LOGITS // vocab_size)


SCORED_LOGITS = 1 << 26


def path_rows(taps: Tensor | None, path: Tensor | None) -> Tensor | None:
    """A tree round's tapped rows [L, N, ...] along each lane's accepted path [L, D+1] (token order);
    a chain's (path None) as they are."""
    if taps is None or path is None:
        return taps
    return taps[torch.arange(taps.shape[0], device=taps.device)[:, None], path]


def top_logprobs(seqs) -> int | None:
    """The most top logprobs a lane asks for (None: no lane asks for logprobs)."""
    asked = [s.params.logprobs for s in seqs if s.params.logprobs is not None]
    return max(asked) if asked else None


def read_scores(chunk: PrefillChunk, scores: tuple) -> tuple[TokenLogprob, ...]:
    """A chunk's prompt logprobs (`ModelRunner._score_prompt`'s tensors, already computed) on the host."""
    first, logprobs, top_ids, top_values, ranks = scores
    tokens = chunk.seq.prompt_ids[first:first + len(logprobs)]
    none = [[]] * len(tokens)
    ids, values = (none, none) if top_ids is None else (top_ids.tolist(), top_values.tolist())
    return tuple(TokenLogprob(t, lp, tuple(zip(i, v)), rank) for t, lp, i, v, rank in
                 zip(tokens, logprobs.tolist(), ids, values, ranks.tolist()))


def read_emitted(results: list[Accepted | None], extras: tuple[Tensor, ...] = ()) -> tuple[list[Emitted], list]:
    """Every result of the step, and `extras` (tensors the host needs too: a tree round's parents), in
    one device -> host read (the step's one sync): ints alone when no logprobs are asked for, else
    everything as float64 (exact for token ids). Returns (the results' Emitted, the extras as lists)."""
    names = ("counts", "tokens", "path", "top_ids", "logprobs", "top_logprobs")
    fields = [{n: getattr(acc, n) for n in names if getattr(acc, n) is not None} if acc is not None else {}
              for acc in results]
    parts = [t for f in fields for t in f.values()] + list(extras)
    if not parts:
        return [Emitted() for _ in results], []
    floats = any(p.is_floating_point() for p in parts)
    flat = torch.cat([p.flatten().double() if floats else p.flatten() for p in parts]).tolist()
    host, at = [], 0
    for t in parts:
        host.append(flat[at:at + t.numel()])
        at += t.numel()
    values = iter(host)
    out = []
    for acc, named in zip(results, fields):
        if acc is None:
            out.append(Emitted())
            continue
        got = {n: next(values) for n in named}
        if floats:  # token ids and counts back to ints (exact in float64)
            got |= {n: [int(v) for v in got[n]] for n in ("counts", "tokens", "path") if n in got}
        counts = got["counts"]
        L, W = acc.tokens.shape
        flat_tokens = got["tokens"]
        tokens = tuple(tuple(flat_tokens[i * W:i * W + c + 1]) for i, c in enumerate(counts))
        paths = None
        if acc.path is not None:
            paths = tuple(tuple(got["path"][i * W:i * W + c + 1]) for i, c in enumerate(counts))
        logprobs = (None,) * L
        if acc.logprobs is not None:
            k = 0 if acc.top_ids is None else acc.top_ids.shape[-1]
            lps, top_ids, top_lps = got["logprobs"], got.get("top_ids", []), got.get("top_logprobs", [])
            logprobs = tuple(tuple(TokenLogprob(t, lps[i * W + n], tuple(
                (int(top_ids[(i * W + n) * k + j]), top_lps[(i * W + n) * k + j]) for j in range(k)))
                for n, t in enumerate(tokens[i])) for i in range(L))
        out.append(Emitted(tuple(counts), tokens, logprobs, paths))
    extra_lists = [[int(v) for v in next(values)] for _ in extras]
    return out, extra_lists
