"""Requests and their per-sequence state: the types the scheduler, runner, engine and server share."""

from __future__ import annotations

import enum
import itertools
import random
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from deltaflash.errors import RequestError


GRAMMAR_KINDS = ("json_object", "json_schema", "regex", "lark")
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class GrammarSpec:
    """Structured output: `kind` one of GRAMMAR_KINDS; `source` the JSON schema (json_schema), the
    regular expression (regex) or the Lark grammar (lark) as text; empty for json_object. `after`: a token
    id - the grammar holds from the token after the first `after` generated (a thinking model's end of
    thinking: the answer is structured, the thinking is free); None: from the first token."""

    kind: str
    source: str = ""
    after: int | None = None


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 = greedy. top_k 0 = off. seed None = a fresh random seed per request.

    Rules applied to every target row before greedy choice or sampling, identically with and without
    speculation (speculative/logit_rules.py): repetition_penalty (1 = off; > 1 discourages tokens of
    the prompt and output), presence / frequency penalties (0 = off; over output tokens), logit_bias
    ((token id, bias), ...), min_tokens (stop tokens are masked until that many were generated),
    grammar (only tokens the grammar allows). min_p (0 = off) filters the sampling distribution like
    top_p. logprobs: None = none; k >= 0 = each generated token's log probability and the k most
    likely tokens of its row (the model's distribution, before any rule or temperature). prompt_logprobs: None
    = none; k >= 0 = the same for each prompt token after the first (from the row before it: what scoring a
    text needs, the `echo` of OpenAI's completions); max_new_tokens may then be 0 (the prompt alone)."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    grammar: GrammarSpec | None = None
    tree_budget: int | None = None  # nodes of this request's draft trees (at most the engine's); None: the engine's

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def has_rules(self) -> bool:
        """Anything changes the raw target logits (speculative/logit_rules.py)."""
        return self.penalized or bool(self.logit_bias) or self.min_tokens > 0 or self.grammar is not None

    def validate(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0 or \
                self.max_new_tokens == 0 and self.prompt_logprobs is None:
            raise RequestError(f"max_new_tokens must be a positive integer (0 only with prompt_logprobs: the "
                               f"prompt scored alone), got {self.max_new_tokens!r}")
        if self.temperature < 0:
            raise RequestError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise RequestError(f"top_k must be >= 0, got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise RequestError(f"seed must be in 0 .. 2^63-1, got {self.seed}")
        if not 0 <= self.min_p <= 1:
            raise RequestError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise RequestError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0 < self.repetition_penalty <= 10:
            raise RequestError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}")
        for token, bias in self.logit_bias:
            if not -100 <= bias <= 100:
                raise RequestError(f"logit_bias[{token}] must be in [-100, 100], got {bias}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_new_tokens:
            raise RequestError(f"min_tokens must be in [0, max_new_tokens = {self.max_new_tokens}], got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (not isinstance(k, int) or not 0 <= k <= MAX_LOGPROBS):
                raise RequestError(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {k!r}")
        if self.tree_budget is not None and not 1 <= self.tree_budget <= 64:
            raise RequestError(f"tree_budget must be in [1, 64], got {self.tree_budget}")
        if self.grammar is not None and self.grammar.kind not in GRAMMAR_KINDS:
            raise RequestError(f"grammar kind must be one of {', '.join(GRAMMAR_KINDS)}, got {self.grammar.kind!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def seeded_sampling(self) -> bool:
        """Sampled with a seed: its draws must not depend on the load, so every round it takes part in has
        the same shape whatever else runs (the block's widths; trees in a tree engine)."""
        return self.seed is not None and not self.greedy


class Status(enum.Enum):
    WAITING = "waiting"      # queued, no slot yet
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"


@dataclass
class Sequence:
    """One request's live state. `pending` is the last sampled token, not yet fed to the target.

    Randomness: every sampling step of the request draws its noise from (seed, draws) - a counter-based
    stream of its own (speculative/sampling.py), so a seeded request is reproducible whatever else
    shares its batch, and nothing random is shared between requests."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    seed: int
    status: Status = Status.WAITING
    slot: int = -1
    num_prefilled: int = 0
    output_ids: list[int] = field(default_factory=list)
    pending: int | None = None
    finish_reason: str | None = None
    cancel_requested: bool = False
    accepted_lengths: list[int] = field(default_factory=list)
    draws: int = 0           # sampling steps taken (the noise counter)
    matcher: object | None = None  # the grammar's state (speculative/grammar.py) when params.grammar is set
    logprobs: list = field(default_factory=list)  # per generated token (TokenLogprob), when params.logprobs is set
    prompt_logprobs: list = field(default_factory=list)  # per prompt token from the second on, when asked for
    preemptions: int = 0     # times its slot and pages were taken back to make room (it was recomputed)
    # prompt tokens its last admission did not prefill: it started from a kept prompt's state (the prefix cache)
    # or forked from a sequence prefilling its prompt
    cached_tokens: int = 0
    widths: list[int] = field(default_factory=list)  # rows it verified, per round it took part in
    # load-adaptive speculation (speculative/policy.py): decayed tries and hits of each draft position,
    # and the rounds since it last drafted
    draft_tries: list[float] = field(default_factory=list)
    draft_hits: list[float] = field(default_factory=list)
    rounds_since_draft: int = 0
    # the prompt as int64 (what prefill steps copy into their inputs: a slice, not a list walked per chunk)
    prompt_array: np.ndarray | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if self.prompt_array is None:
            self.prompt_array = np.asarray(self.prompt_ids, dtype=np.int64)

    @property
    def position(self) -> int:
        """Position of the pending token (= committed length of the sequence)."""
        return len(self.prompt_ids) + len(self.output_ids) - 1

    @property
    def remaining(self) -> int:
        return self.params.max_new_tokens - len(self.output_ids)

    @property
    def prefill_len(self) -> int:
        """How many tokens a prefill builds the state of: the prompt, and for a sequence resumed after a
        preemption also every generated token but the pending one (recomputed, not emitted again)."""
        return len(self.prompt_ids) + max(len(self.output_ids) - 1, 0)

    def prefill_tokens(self, start: int, stop: int) -> list[int]:
        """Tokens start..stop-1 of those (a chunk), without joining the prompt and output first."""
        stop = min(stop, self.prefill_len)
        n = len(self.prompt_ids)
        head = self.prompt_ids[start:stop]
        return head if stop <= n else head + self.output_ids[max(start - n, 0):stop - n]

    def prefill_array(self, start: int, stop: int) -> np.ndarray:
        """prefill_tokens as int64: a view of prompt_array where they lie in the prompt (don't write it)."""
        if min(stop, self.prefill_len) <= len(self.prompt_ids):
            return self.prompt_array[start:stop]
        return np.asarray(self.prefill_tokens(start, stop), dtype=np.int64)

    @property
    def prompt_left(self) -> int:
        return self.prefill_len - self.num_prefilled


def resolve_seed(params: SamplingParams) -> int:
    """The request's noise seed: its own, or a fresh one (63 bits)."""
    return params.seed if params.seed is not None else random.SystemRandom().getrandbits(63)


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log probability under the model and its row's `top` (token id, logprob)
    pairs, most likely first; a scored prompt token's `rank` in its row too (1: the likeliest)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None


class StepEvent(NamedTuple):
    """Tokens a step produced for one request (and their logprobs, when asked for); `finish_reason`
    set on its last event; `prompt_logprobs` (when asked for) and `cached_tokens` (Sequence.cached_tokens) on the
    event that ends its prompt's prefill, the former one per prompt token from the second on. A named tuple: a
    step builds one per lane, and a frozen dataclass costs five times as much to build."""

    request_id: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None
    cached_tokens: int = 0


@dataclass(frozen=True)
class RoundPhases:
    """Seconds of host wall time per phase of one round (see StepReport)."""

    draft_s: float = 0.0
    verify_s: float = 0.0
    accept_s: float = 0.0
    commit_s: float = 0.0  # cache commit and new draft context; the rest of decode_s is host bookkeeping


@dataclass(frozen=True)
class StepReport:
    """What one step did, for metrics. Seconds are host wall time (on GPU a phase's kernels may
    finish inside the next one: only the step's one read of the results syncs, unless the engine was
    built with `sync_phase_timing`). `accepted_lengths` has one entry per lane of the round that
    speculated (1 + accepted drafts); `widths` the rows each round lane verified. `phases` splits decode_s."""

    admitted: int
    prefill_tokens: int
    prefill_s: float
    decode_lanes: int
    decode_s: float
    accepted_lengths: tuple[int, ...] = ()
    phases: RoundPhases = RoundPhases()
    widths: tuple[int, ...] = ()
    preempted: int = 0
    pages_used: int = 0
    pages_total: int = 0
    admitted_ids: tuple[str, ...] = ()  # request ids admitted this step (readmissions after a preemption too)
    prefill_graphed: bool = False  # its prefill replayed a prefill CUDA graph (else it ran eagerly)
    device_idle_s: float | None = None  # CUDA: the device's wait for the host since the previous step (None: not measured)
    tree_budget: int = 0  # the round verified trees of this many nodes (0: chains, or no speculation)
    prefill_budget: int = 0  # the most prompt tokens the step could prefill (the scheduler's budget)
    prefill_rows: int = 0  # rows its prefill computed: prompt tokens, or a replayed graph's padded lanes x T
    shared_prompt_tokens: int = 0  # prompt tokens of the sequences forked this step (not prefilled again)
    cached_prompt_tokens: int = 0  # prompt tokens the sequences admitted this step took from the prefix cache
    prefill_chunks: int = 0  # prompt chunks its prefill ran (the lanes of its graph or eager batch, padding aside)


@dataclass(frozen=True)
class Completion:
    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    finish_reason: str
    accepted_lengths: list[int]
    logprobs: list[TokenLogprob] = field(default_factory=list)
    widths: list[int] = field(default_factory=list)  # rows the request verified per round (1: no drafts)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # prompt tokens from the second on


_ids = itertools.count()


def next_request_id() -> str:
    return f"req-{next(_ids)}"
