"""Requests and their per-sequence state: the types the scheduler, runner, engine and server share."""

from __future__ import annotations

import enum
import itertools
import random
from dataclasses import dataclass, field

from deltaflash.errors import RequestError


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 = greedy. top_k 0 = off. seed None = a fresh random seed per request."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def validate(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise RequestError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if self.temperature < 0:
            raise RequestError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise RequestError(f"top_k must be >= 0, got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise RequestError(f"seed must be in 0 .. 2^63-1, got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


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

    @property
    def position(self) -> int:
        """Position of the pending token (= committed length of the sequence)."""
        return len(self.prompt_ids) + len(self.output_ids) - 1

    @property
    def remaining(self) -> int:
        return self.params.max_new_tokens - len(self.output_ids)

    @property
    def prompt_left(self) -> int:
        return len(self.prompt_ids) - self.num_prefilled


def resolve_seed(params: SamplingParams) -> int:
    """The request's noise seed: its own, or a fresh one (63 bits)."""
    return params.seed if params.seed is not None else random.SystemRandom().getrandbits(63)


@dataclass(frozen=True)
class StepEvent:
    """Tokens a step produced for one request; `finish_reason` set on its last event."""

    request_id: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None


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


@dataclass(frozen=True)
class Completion:
    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    finish_reason: str
    accepted_lengths: list[int]


_ids = itertools.count()


def next_request_id() -> str:
    return f"req-{next(_ids)}"
