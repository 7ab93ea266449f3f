"""The engine worker thread: the engine's only caller. Admission, rounds and retirement happen here.

HTTP handlers talk to it through `submit` and `cancel` (a thread-safe inbox) and hear back through
each job's `sink`. Between two engine steps (a round boundary) it takes new jobs and aborts cancelled
and timed-out ones. It turns step events into text (`TextStream`, stop strings) while the device runs
the next step (`WorkerConfig.overlap_host`): a step's tokens reach their clients after the next step
is launched, and the device does not wait for detokenisation. It also times each request for the
metrics: queue time, time to first token, time per output token, end to end.
"""

from __future__ import annotations

import functools
import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from deltaflash.core.request import SamplingParams, StepEvent, StepReport
from deltaflash.errors import RequestError
from deltaflash.ops.compiles import on_kernel_load
from deltaflash.server.errors import ApiError, BadRequest, QueueFull, ServerFailure, ServerUnavailable
from deltaflash.server.metrics import Metrics
from deltaflash.server.textstream import TextLogprob, TextStream, TokenTexts
from deltaflash.tokenizer import DecodeOptions

log = logging.getLogger("deltaflash.server")


@dataclass(frozen=True)
class WorkerConfig:
    max_queue: int = 64            # admitted requests beyond the slots, waiting for one
    request_timeout_s: float = 0   # 0: none; a request older than this is retired ("cancelled")
    idle_wait_s: float = 0.5       # how long an idle worker sleeps between inbox checks
    overlap_host: bool = True      # route a step's events (and take new jobs) while the device runs the next step


@dataclass(frozen=True)
class Output:
    """What one request got since its previous Output. The last one has `finish_reason`
    (stop | length | cancelled: the client went away or --request-timeout) or `error`: the server failed
    (ServerFailure, 500) or shut down before the request finished (ServerUnavailable, 503). `logprobs`:
    one per token of `token_ids` when the request asked for them (None otherwise, and on outputs that
    carry no tokens). `prompt_logprobs`: on the first output of a request that asked for them, one per
    prompt token, the first's logprob None. `cached_tokens`: on the first output with tokens, the prompt
    tokens the engine did not prefill (the prefix cache's, or another request's with the same prompt)."""

    text: str
    token_ids: tuple[int, ...]
    prompt_tokens: int
    completion_tokens: int          # so far, including these
    finish_reason: str | None = None
    error: ApiError | None = None
    logprobs: tuple[TextLogprob, ...] | None = None
    prompt_logprobs: tuple[TextLogprob, ...] | None = None
    cached_tokens: int = 0


@dataclass(frozen=True)
class Job:
    """A validated request. `sink` runs on the engine worker thread and must not block. `submitted`:
    time.monotonic() when the handler made it."""

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    stop_strings: tuple[str, ...]
    sink: Callable[[Output], None]
    decode: DecodeOptions = DecodeOptions()
    submitted: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class Load:
    """Published by the worker after each step, read by /health."""

    active_slots: int
    queued: int
    max_slots: int
    draining: bool = False
    alive: bool = True


@dataclass
class _Live:
    """A job inside the engine (worker thread only)."""

    job: Job
    text: TextStream
    deadline: float                  # time.monotonic(); inf: none
    stop_ids: frozenset[int]         # tokens that end the request and are not text
    completion_tokens: int = 0
    answered: bool = False           # final Output sent (a stop string ended it); awaiting retirement
    abort_reason: str | None = None  # cancelled | timeout | shutdown, once aborted
    first_token_at: float | None = None  # time.monotonic() of the first and the latest generated tokens
    last_token_at: float | None = None


class EngineWorker:
    def __init__(self, engine, config: WorkerConfig, metrics: Metrics):
        self._engine, self.config, self._metrics = engine, config, metrics
        self.max_slots = engine.config.max_slots
        # the jobs of one API request (a tuple: admitted in one go, so its choices fork from one prefill of their
        # prompt: engine/shares.py), or a request id (str) to cancel
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._lock = threading.Lock()   # guards _outstanding, _draining, _drain_deadline, _closing
        self._outstanding = 0           # submitted and not yet retired by the engine
        self._draining, self._drain_deadline, self._closing = False, math.inf, False
        self._live: dict[str, _Live] = {}
        self._token_texts = TokenTexts(engine.tokenizer)
        self._unadmitted: set[str] = set()  # in the engine, never admitted to a slot yet
        self._thread = threading.Thread(target=self._run, name="deltaflash-engine", daemon=True)
        self.load = Load(0, 0, self.max_slots)

    # ---- called from HTTP handlers (any thread) --------------------------------------------
    def start(self) -> None:
        self._thread.start()

    @property
    def capacity(self) -> int:
        """Engine requests the worker holds at most: running in a slot or queued for one."""
        return self.max_slots + self.config.max_queue

    def submit(self, *jobs: Job) -> None:
        """Admit the jobs of one API request together: all of them, or none (QueueFull)."""
        with self._lock:
            if self._draining or not self.load.alive:
                raise ServerUnavailable("the server is shutting down" if self._draining else "the engine worker failed")
            free = self.capacity - self._outstanding
            if free < 1:
                raise QueueFull(f"all {self.max_slots} slots are busy and the queue holds its maximum "
                                f"{self.config.max_queue} requests (--max-queue); retry later")
            if len(jobs) > free:
                raise QueueFull(f"{len(jobs)} choices need {len(jobs)} places; {free} of the {self.capacity} "
                                "(slots + --max-queue) are free; retry later")
            self._outstanding += len(jobs)
            self._inbox.put(jobs)  # under the lock: a failing worker answers every job it let in
        self._wake.set()

    def cancel(self, *request_ids: str) -> None:
        """Retire requests at the next round boundary (no-op for those that have finished)."""
        for request_id in request_ids:
            self._inbox.put(request_id)
        self._wake.set()

    def drain(self, deadline_s: float) -> None:
        """Stop admitting; requests still running `deadline_s` from now are aborted and answered with a
        503 (code "server_shutdown")."""
        with self._lock:
            self._draining = True
            self._drain_deadline = min(self._drain_deadline, time.monotonic() + deadline_s)
        self._wake.set()

    def close(self, timeout_s: float = 30.0) -> None:
        """Cancel what is left, retire it and stop the thread."""
        self.drain(0)
        with self._lock:
            self._closing = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    # ---- the engine worker thread ----------------------------------------------------------------
    def _run(self) -> None:
        try:
            with torch.inference_mode(), on_kernel_load(self._kernel_loaded):
                self._loop()
        except Exception as exc:  # a bug or a device failure: fail every request, refuse new ones
            log.exception("engine worker failed")
            self._fail_all(f"the engine worker failed: {type(exc).__name__}: {exc}")

    def _loop(self) -> None:
        finished: list[StepEvent] = []  # the last step's events, not routed yet (overlap_host)
        while True:
            self._take_inbox()
            self._expire()
            if not self._engine.has_work():
                self._route_all(finished)
                finished = []
                self._engine.idle()
                self._publish()
                with self._lock:
                    if self._closing:
                        return
                self._wake.wait(self.config.idle_wait_s)
                self._wake.clear()
                continue
            report = functools.partial(self._observe, time.monotonic())
            if self.config.overlap_host:
                previous = finished
                finished = self._engine.step(on_report=report, overlap=lambda: self._while_device_runs(previous))
            else:
                self._route_all(self._engine.step(on_report=report))
            self._publish()

    def _while_device_runs(self, events: list[StepEvent]) -> None:
        """Host work during a step's device time: the previous step's events go to their clients, and jobs
        posted meanwhile are admitted (they join the next step, as they would have from the loop)."""
        self._route_all(events)
        self._take_inbox()

    def _route_all(self, events: list[StepEvent]) -> None:
        for event in events:
            self._route(event)

    def _inbox_items(self):
        """What handlers have posted so far (jobs and cancellations), without waiting."""
        while True:
            try:
                yield self._inbox.get_nowait()
            except queue.Empty:
                return

    def _take_inbox(self) -> None:
        for item in self._inbox_items():
            if isinstance(item, str):
                self._abort(item, "cancelled")
            else:
                for job in item:
                    self._admit(job)

    def _kernel_loaded(self, name: str, from_disk: bool) -> None:
        """A Triton kernel met for the first time while serving: some request waited for it."""
        self._metrics.kernel_loads.labels(source="disk cache" if from_disk else "compiled").inc()
        log.warning("Triton kernel %s was %s while serving (the start-up warm-up missed it)", name,
                    "loaded from the disk cache" if from_disk else "compiled")

    def _admit(self, job: Job) -> None:
        try:
            self._engine.add_request(list(job.prompt_ids), job.params, job.request_id)
        except RequestError as exc:  # the frontend checks first; this is a safety net
            self._release("error")
            self._deliver(job, Output("", (), len(job.prompt_ids), 0, error=BadRequest(str(exc))))
            return
        timeout = self.config.request_timeout_s
        self._live[job.request_id] = _Live(job, TextStream(self._engine.tokenizer, job.stop_strings, job.decode),
                                           time.monotonic() + timeout if timeout > 0 else math.inf,
                                           self._engine.stop_ids(job.params))
        self._unadmitted.add(job.request_id)
        self._metrics.prompt_tokens.inc(len(job.prompt_ids))

    def _observe(self, step_started: float, report: StepReport) -> None:
        """Step metrics, and the queue time of the requests this step admitted for the first time (a
        sequence readmitted after a preemption was timed at its first admission)."""
        self._metrics.observe_step(report)
        for rid in report.admitted_ids:
            if rid in self._unadmitted:
                self._unadmitted.discard(rid)
                self._metrics.queue_time.observe(step_started - self._live[rid].job.submitted)

    def _abort(self, request_id: str, reason: str) -> None:
        live = self._live.get(request_id)
        if live is not None and live.abort_reason is None:
            live.abort_reason = reason
            self._engine.abort(request_id)

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            shutdown = now >= self._drain_deadline
        for rid, live in list(self._live.items()):
            if shutdown:
                self._abort(rid, "shutdown")
            elif now >= live.deadline:
                self._abort(rid, "timeout")

    def _route(self, event: StepEvent) -> None:
        live = self._live[event.request_id]
        if live.answered:  # ended by a stop string; the engine has now retired it
            if event.finish_reason:
                self._retire(live, "stop")
            return
        if event.finish_reason == "cancelled" and live.abort_reason == "shutdown":
            error = ServerUnavailable("the server shut down before this request finished", code="server_shutdown")
            self._deliver(live.job, Output("", (), len(live.job.prompt_ids), live.completion_tokens, error=error))
            self._retire(live, "shutdown")
            return
        tokens, reason = event.token_ids, event.finish_reason
        # a stop token is not text; a grammar's last token, also "stop", is
        n_text = len(tokens) - 1 if reason == "stop" and tokens[-1] in live.stop_ids else len(tokens)
        kept = tokens
        for i, tok in enumerate(tokens[:n_text]):
            live.text.push(tok)
            if live.text.stopped:
                kept, reason = tokens[:i + 1], "stop"
                break
        now = time.monotonic()
        if kept:
            if live.first_token_at is None:
                live.first_token_at = now
                self._metrics.ttft.observe(now - live.job.submitted)
            live.last_token_at = now
        live.completion_tokens += len(kept)
        self._metrics.generated_tokens.inc(len(kept))
        if reason is not None:
            live.text.finish()
        texts = self._token_texts
        logprobs = None if event.logprobs is None else texts.logprobs(event.logprobs[:len(kept)])
        scored = None if event.prompt_logprobs is None else \
            (TextLogprob(texts.text(live.job.prompt_ids[0]), None, token_id=live.job.prompt_ids[0]),
             *texts.logprobs(event.prompt_logprobs))
        self._deliver(live.job, Output(live.text.take(final=reason is not None), kept, len(live.job.prompt_ids),
                                       live.completion_tokens, reason, logprobs=logprobs, prompt_logprobs=scored,
                                       cached_tokens=event.cached_tokens))
        if reason in ("stop", "length"):
            self._metrics.observe_finished(now - live.job.submitted, live.completion_tokens, live.first_token_at,
                                           live.last_token_at)
        if event.finish_reason:
            self._retire(live, live.abort_reason or reason)
        elif reason is not None:  # a stop string: answered now, slot freed at the next step
            live.answered = True
            self._engine.abort(event.request_id)

    def _retire(self, live: _Live, outcome: str) -> None:
        del self._live[live.job.request_id]
        self._unadmitted.discard(live.job.request_id)
        self._release(outcome)

    def _release(self, outcome: str) -> None:
        with self._lock:
            self._outstanding -= 1
        self._metrics.requests.labels(outcome=outcome).inc()

    def _deliver(self, job: Job, out: Output) -> None:
        try:
            job.sink(out)
        except Exception:  # a handler's event loop already closed: nobody is listening
            log.debug("dropped output for %s", job.request_id, exc_info=True)

    def _publish(self) -> None:
        live = self._engine.num_live
        with self._lock:
            queued = max(self._outstanding - live, 0)
            draining = self._draining
        self.load = Load(live, queued, self.max_slots, draining)
        self._metrics.active_slots.set(live)
        self._metrics.slot_usage.set(live / self.max_slots)
        used, total = self._engine.page_usage
        self._metrics.kv_usage.set(used / total if total else 0.0)
        self._metrics.queue_depth.set(queued)

    def _fail_all(self, message: str) -> None:
        with self._lock:
            self.load = Load(0, 0, self.max_slots, self._draining, alive=False)
        for live in list(self._live.values()):
            self._deliver(live.job, Output("", (), len(live.job.prompt_ids), live.completion_tokens,
                                           error=ServerFailure(message)))
            self._retire(live, "error")
        for item in self._inbox_items():
            for job in item if not isinstance(item, str) else ():
                self._deliver(job, Output("", (), len(job.prompt_ids), 0, error=ServerFailure(message)))
                self._release("error")
