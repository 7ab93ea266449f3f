"""Prometheus metrics of one server, in a registry it owns (no process-wide collectors).

Written by the engine worker thread (rounds, slots, finished requests) and the HTTP handlers (requests
rejected before admission); prometheus_client's collectors are thread-safe.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from deltaflash.core.request import StepReport

_PHASE_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
_IDLE_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1)
_TOKEN_BUCKETS = (1, 16, 64, 128, 256, 512, 768, 1024, 1536, 2048, 4096, 8192)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0)

# outcomes of `deltaflash_requests_total`
FINISHED = ("stop", "length")
RETIRED = ("cancelled", "timeout", "shutdown", "error")  # cancelled: the client went away
REJECTED = ("invalid", "unauthorized", "queue_full", "unavailable")  # never admitted


class Metrics:
    def __init__(self, block_size: int = 0):
        """block_size: speculative block W (accepted lengths run 1..W); 0 without a drafter."""
        r = self.registry = CollectorRegistry()
        self.requests = Counter("deltaflash_requests", "Requests by outcome", ["outcome"], registry=r)
        for outcome in FINISHED + RETIRED + REJECTED:
            self.requests.labels(outcome=outcome)
        self.queue_depth = Gauge("deltaflash_queue_depth", "Admitted requests waiting for a slot", registry=r)
        self.active_slots = Gauge("deltaflash_active_slots", "Slots holding a live sequence", registry=r)
        self.slot_usage = Gauge("deltaflash_slot_usage_ratio", "Live slots / slots (GDN state)", registry=r)
        self.kv_usage = Gauge("deltaflash_kv_cache_usage_ratio", "K/V pages held by sequences / pages in the pool",
                              registry=r)
        self.preemptions = Counter("deltaflash_preemptions", "Sequences preempted to free K/V pages (their slot "
                                   "and pages taken back; recomputed when readmitted)", registry=r)
        self.kernel_loads = Counter("deltaflash_kernel_loads", "Triton kernels compiled or read from the disk cache "
                                    "while serving (after start-up: each made a request wait; 0 expected)",
                                    ["source"], registry=r)
        self.prompt_tokens = Counter("deltaflash_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.shared_prompt_tokens = Counter("deltaflash_shared_prompt_tokens",
                                            "Prompt tokens not prefilled: requests forked from another's prefill of "
                                            "the same prompt (the n samples of one prompt; --share-prompts)",
                                            registry=r)
        self.cached_prompt_tokens = Counter("deltaflash_prefix_cache_hit_tokens",
                                            "Prompt tokens not prefilled: requests whose prompt began with a prompt "
                                            "the prefix cache kept started from its state (--prefix-cache)",
                                            registry=r)
        self.generated_tokens = Counter("deltaflash_generated_tokens", "Tokens generated", registry=r)
        buckets = tuple(range(1, max(block_size, 1) + 1))
        self.accepted_length = Histogram("deltaflash_accepted_length",
                                         "Tokens committed per lane per speculative round (1 + accepted drafts)",
                                         buckets=buckets, registry=r)
        self.lane_width = Histogram("deltaflash_lane_width", "Rows each lane of a round verified (1 + the drafts it "
                                    "could accept; 1: no drafting): the load-adaptive speculation's choice",
                                    buckets=buckets, registry=r)
        self.rounds = Counter("deltaflash_rounds", "Decode rounds by kind: 'tree' verified draft trees, 'chain' "
                              "top-1 chains, 'plain' no drafts (with --tree-budget: the trees-or-chains choice)",
                              ["kind"], registry=r)
        self.prefill_tokens_per_step = Histogram("deltaflash_prefill_tokens_per_step",
                                                 "Prompt tokens prefilled in a step that prefilled (at most "
                                                 "its budget: deltaflash_prefill_budget_tokens)",
                                                 buckets=_TOKEN_BUCKETS, registry=r)
        self.prefill_budget = Histogram("deltaflash_prefill_budget_tokens",
                                        "Prompt tokens a step that prefilled could take: --max-num-batched-tokens "
                                        "beside a round (held to --max-prefill-stall rounds' cost when set; "
                                        "scaled by a speculative round's cost over a plain one's, "
                                        "up to --idle-prefill-tokens, unless --no-scale-prefill-budget), "
                                        "--idle-prefill-tokens with nothing decoding", buckets=_TOKEN_BUCKETS,
                                        registry=r)
        self.prefill_steps = Counter("deltaflash_prefill_steps", "Steps that prefilled, by how: 'graph' replayed a "
                                     "prefill CUDA graph, 'eager' fit none (or padding would double it)", ["path"],
                                     registry=r)
        self.prefill_rows = Counter("deltaflash_prefill_rows", "Rows the prefill steps computed: their prompt "
                                    "tokens, and a replayed prefill graph's padding rows (lanes x chunk rows); over "
                                    "deltaflash_prefill_tokens_per_step_sum, 1 means no padding", ["path"],
                                    registry=r)
        self.phase_seconds = Histogram("deltaflash_round_phase_seconds", "Host seconds per round phase",
                                       ["phase"], buckets=_PHASE_BUCKETS, registry=r)
        self.device_idle = Histogram("deltaflash_device_idle_seconds",
                                     "Time the GPU waited for the host before a step, the engine busy since the "
                                     "previous step (host work between two steps' device work; CUDA only)",
                                     buckets=_IDLE_BUCKETS, registry=r)
        self.ttft = Histogram("deltaflash_time_to_first_token_seconds", "Submission to first generated token",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.queue_time = Histogram("deltaflash_queue_time_seconds",
                                    "Submission to admission into a slot (the start of the engine step that "
                                    "admitted it; the engine admits first come, first served)",
                                    buckets=_QUEUE_BUCKETS, registry=r)
        self.request_latency = Histogram("deltaflash_request_latency_seconds",
                                         "Submission to last token of requests that finished (stop or length)",
                                         buckets=_LATENCY_BUCKETS, registry=r)
        self.time_per_output_token = Histogram("deltaflash_time_per_output_token_seconds",
                                               "Per finished request of 2+ tokens: (last token - first token) / "
                                               "(tokens - 1)", buckets=_TPOT_BUCKETS, registry=r)

    def observe_step(self, report: StepReport) -> None:
        if report.prefill_tokens:
            self.phase_seconds.labels(phase="prefill").observe(report.prefill_s)
            self.prefill_tokens_per_step.observe(report.prefill_tokens)
            self.prefill_budget.observe(report.prefill_budget)
            path = "graph" if report.prefill_graphed else "eager"
            self.prefill_steps.labels(path=path).inc()
            self.prefill_rows.labels(path=path).inc(report.prefill_rows or report.prefill_tokens)
        if report.decode_lanes:
            self.phase_seconds.labels(phase="decode").observe(report.decode_s)
            kind = "tree" if report.tree_budget else "chain" if any(w > 1 for w in report.widths) else "plain"
            self.rounds.labels(kind=kind).inc()
        for n in report.accepted_lengths:
            self.accepted_length.observe(n)
        for w in report.widths:
            self.lane_width.observe(w)
        if report.device_idle_s is not None:
            self.device_idle.observe(report.device_idle_s)
        if report.preempted:
            self.preemptions.inc(report.preempted)
        if report.shared_prompt_tokens:
            self.shared_prompt_tokens.inc(report.shared_prompt_tokens)
        if report.cached_prompt_tokens:
            self.cached_prompt_tokens.inc(report.cached_prompt_tokens)
        if report.pages_total:
            self.kv_usage.set(report.pages_used / report.pages_total)

    def observe_finished(self, latency_s: float, tokens: int, first_token_at: float | None,
                         last_token_at: float | None) -> None:
        """A request finished (stop or length): `latency_s` since submission; token times in seconds."""
        self.request_latency.observe(latency_s)
        if tokens >= 2:
            self.time_per_output_token.observe((last_token_at - first_token_at) / (tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
