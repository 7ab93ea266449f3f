"""CUDA graphs of lane-batched functions, all captured at engine start.

A function registered here (the target's verify forward at each width in use, the drafter's block
forward and context append) takes tensors whose first dim is the lanes. Its static inputs are
allocated once at the largest bucket; the graph of bucket b reads their first b lanes. A call with L
lanes copies the inputs into the static buffers, fills lanes L..b-1 with each input's padding value
(slot id -1: padding lanes read zeros and write only to sinks), replays bucket b = the smallest
bucket >= L and returns the outputs' first L lanes. Every graph lives in one memory pool; buckets are
captured largest first, so the smaller graphs reuse its memory. A call with more lanes than the
largest bucket returns None: the caller runs the function eagerly. A function whose inputs share one
dtype has them as sections of one flat buffer, which `run_host` fills from host arrays in a single
transfer (no device tensors made first, no copies between them).
"""

from __future__ import annotations

import functools
import gc
import math
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from deltaflash.core.batch import PinnedStaging
from deltaflash.ops.attention import dense as dense_attention

LANE_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
PREFILL_ROWS = 64     # the chunked GDN kernels' chunk: prefill graph shapes are multiples of it
PREFILL_MAX_ROWS = 2048  # longer chunks run eagerly (their host overhead is small beside their work)
# Shapes of at least this many rows also get a graph for first chunks (every lane at position 0), whose
# attention runs over their own rows (ops/attention/dense.py, cuDNN's kernel in these graphs): at 2048 rows
# of the 9B shape that is 0.09 against 0.53 ms per layer in the paged kernel; at 512 rows the paged kernel
# costs ~0.03 ms per layer (the cost goes as rows squared), too little to pay for a second graph.
FRESH_PREFILL_MIN_ROWS = 1024
# A prompt's chunk of at least EAGER_DENSE_MIN_ROWS rows after at least EAGER_DENSE_MIN_CONTEXT committed keys,
# alone in a step that decodes nothing (a long prompt at an idle engine), runs eagerly: its attention then
# gathers the context into one dense run for the flash kernel (ops/attention/dense.py), which no fixed-shape
# graph can (the run's length varies), and at 2048+ keys that saves more device time than the graph saves
# host time. A shorter chunk (a long prompt's rest; a prompt after a kept prefix) replays its graph: the
# eager launching of the 9B shape costs ~75 ms of host time on the H100 VM (a 128-row chunk after 2,048
# keys: 77-80 ms to the first token, `bench/prefix_turns.py`), more than the paged kernel's attention over
# 32k keys adds to a 1024-row graph (~4 ms a layer). Where the eager step is host-bound beyond the chunk's own
# device time (ModelRunner.eager_prefill_rows, measured at start, above the chunk's rows), the chunk replays its
# graph below EAGER_DENSE_ALWAYS_CONTEXT keys: the lent H200 VM of 2026-12-07 ran an eager 2048-row forward of the
# 9B shape in 82.6 ms against 48.5 for its graph, and an 8192-token prompt's three eager chunks after its first
# took 315 ms to the first token against 249 in 512-row graph chunks (`bench model`); the paged kernel's extra
# attention time grows with the keys (~2 us a key for a 2048-row chunk, from the figure above) and passes such a
# host's ~35 ms of launching near 16k keys.
EAGER_DENSE_MIN_CONTEXT = 2048
EAGER_DENSE_MIN_ROWS = 1024
EAGER_DENSE_ALWAYS_CONTEXT = 16384
# Prefill graphs of chunks of at least this many rows also get lane buckets of 3 x a power of two (3, 6,
# 12, 24, ...): three chunks then replay 3 x T rows, not 4 x T. From 3 x 128 rows a step is compute-bound
# (the 9B shape on the H200: ~190 rows of bf16 GEMM read the weights in the time they compute), so a
# padding lane costs its rows' full work: the 2026-12-05 C = 64 wave's steps of ~745 prompt rows (two
# 256-row prompts and most of a third) replayed 4 x 256 rows in 38.3 ms against 27.3 ms for two prompts.
# Whether a step replays a graph at all is judged at its power-of-two bucket (prefill_graph_for): these
# buckets only pad less, they never turn an eager step into a padded replay.
PREFILL_FINE_MIN_ROWS = 128


def capture(fn, pool=None, warmups: int = 2, stream: torch.cuda.Stream | None = None
            ) -> tuple[torch.cuda.CUDAGraph, object]:
    """(graph, fn's output): fn run `warmups` times on a side stream (Triton compiles, cuBLAS picks
    its kernels, outside the capture), then captured once into `pool`, on `stream` (default: torch's one capture
    stream, whose cuBLAS workspace every graph captured on it shares: graphs that may run at once need their
    own capture streams, and their own pools). The garbage collector is held off
    during the capture (torch.cuda.graph collects once before it): an object collected mid-capture may
    free a CUDA resource (an event, pinned host memory, an earlier graph), a call a capturing process may
    not make, which voids the capture ("operation failed due to a previous error during capture": one
    adaptive engine's start-up among eight pytest workers on the H200, not alone)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            out = fn()
    finally:
        if collecting:
            gc.enable()
    return graph, out


def buckets_for(max_lanes: int, buckets: Sequence[int] = LANE_BUCKETS) -> tuple[int, ...]:
    """The buckets an engine of `max_lanes` lanes can meet: up to the first one >= max_lanes."""
    top = next((b for b in buckets if b >= max_lanes), buckets[-1])
    return tuple(b for b in buckets if b <= top)


def prefill_tile(rows: int) -> int:
    """The rows T of the prefill graph shape a chunk of `rows` rows pads to (64, 128, 256, ...)."""
    tile = PREFILL_ROWS
    while tile < rows:
        tile *= 2
    return tile


def prefill_lane_buckets(rows: int, most: int) -> tuple[int, ...]:
    """The lane buckets of the prefill graphs of chunks of `rows` rows that hold up to `most` lanes: the
    powers of two up to the first >= most (buckets_for), and from PREFILL_FINE_MIN_ROWS rows on 3 x the
    powers of two below that one as well (see there)."""
    buckets = buckets_for(most)
    if rows < PREFILL_FINE_MIN_ROWS:
        return buckets
    return tuple(sorted(set(buckets) | {3 * b for b in LANE_BUCKETS if 3 * b < buckets[-1]}))


def padded_rows_allowed(rows: int, eager_rows: float = 0.0) -> float:
    """Rows a prefill graph may run for a step of `rows` prompt rows: its padding at most doubles it
    (plus one chunk), so a replay never costs much more device time than the eager prefill - or up to
    `eager_rows`, the graph rows an eager step's launching costs where it is host-bound
    (ModelRunner.eager_prefill_rows: a few prompts' short rests would otherwise launch a small model one
    kernel at a time, ~40 ms on the H200 VM of 2026-12-07, for ~1 ms of graph)."""
    return max(2 * rows + PREFILL_ROWS, eager_rows)


def pads_within_reason(lanes: int, shape: int, rows: int, eager_rows: float = 0.0) -> bool:
    """Whether a prefill step of `lanes` chunks, `rows` rows in all, the longest padding to `shape` rows,
    may replay a graph: its lanes' power-of-two bucket x shape within padded_rows_allowed(rows, eager_rows)
    (judged at that bucket, so the 3 x 2^k ones, which only pad less, change nothing)."""
    return buckets_for(lanes)[-1] * shape <= padded_rows_allowed(rows, eager_rows)


def prefill_graph_for(lens: Sequence[int], buckets: dict[int, tuple[int, ...]],
                      eager_rows: float = 0.0) -> tuple[int, int] | None:
    """(rows T, lanes) of the prefill graph that replays chunks of `lens` rows, given each graph shape's
    lane buckets (T -> buckets, smallest T first): the smallest shape and bucket that hold them. None where
    none does or where it would pad past reason (pads_within_reason, with `eager_rows`): that step runs
    eagerly. The scheduler plans by this rule and its plan tells the runner (StepPlan.prefill_graph)."""
    shape = next((T for T in buckets if T >= max(lens)), None)
    if shape is None:
        return None
    lanes = next((b for b in buckets[shape] if b >= len(lens)), None)
    if lanes is None or not pads_within_reason(len(lens), shape, sum(lens), eager_rows):
        return None
    return shape, lanes


def long_chunk_runs_eagerly(start: int, rows: int, eager_rows: float = 0.0) -> bool:
    """Whether a prompt's chunk of `rows` rows after `start` committed keys, alone in a step that decodes
    nothing, runs eagerly over its gathered context rather than replaying its graph (EAGER_DENSE_MIN_CONTEXT
    and after): a long chunk after many keys, unless the eager step's launching (`eager_rows`: the graph rows
    it costs) outweighs its rows below EAGER_DENSE_ALWAYS_CONTEXT keys."""
    return start >= EAGER_DENSE_MIN_CONTEXT and rows >= EAGER_DENSE_MIN_ROWS and dense_attention.gathers(start, rows) \
        and (rows >= eager_rows or start >= EAGER_DENSE_ALWAYS_CONTEXT)


def prefill_graph_sizes(config) -> tuple[int, int, int, int]:
    """What an engine's prefill graph shapes follow from (prefill_shapes, prefill_graph_buckets), from its
    EngineConfig: the most prompt tokens beside a round, the slots, max_model_len, the idle budget. The runner
    captures the graphs and the scheduler plans steps by the same sizes."""
    return config.round_prefill_tokens, config.max_slots, config.max_model_len, config.idle_prefill_tokens


@functools.cache  # (the scheduler plans by it at each step that prefills several prompts)
def prefill_graph_buckets(budget: int, max_slots: int, max_model_len: int, idle_budget: int = 0
                          ) -> dict[int, tuple[int, ...]]:
    """T -> lane buckets of each prefill graph shape (prefill_shapes, prefill_lane_buckets): the graphs the
    runner captures. (Cached: callers read it, never change it.)"""
    return {T: prefill_lane_buckets(T, most) for T, most in prefill_shapes(budget, max_slots, max_model_len,
                                                                          idle_budget)}


@functools.cache  # (asked by the scheduler at each step that prefills several prompts)
def prefill_shapes(budget: int, max_slots: int, max_model_len: int, idle_budget: int = 0
                   ) -> tuple[tuple[int, int], ...]:
    """(rows T, most lanes) of each prefill graph: T = 64, 128, ... up to the step budget (and the
    longest prompt, at most PREFILL_MAX_ROWS), and the budget itself (rounded up to a multiple of 64) where
    it falls between two of them: a long prompt's chunks beside a round are the budget's size, and a budget
    of 384 rows padded to 512 would stall the running streams as long as a budget of 512. A step holds at
    most `budget` rows and may replay a shape padding it to about twice that (pads_within_reason), so shape
    T has the largest lane bucket of at most padded_rows_allowed(budget) / T lanes (at least one, at most
    max_slots): three chunks of 170 rows fit 4 x 256. Above the budget, up to `idle_budget` (the rows of a
    step with nothing decoding: one prompt arriving at an idle engine, mostly), one lane each."""
    sizes, T = [], PREFILL_ROWS
    top = min(max(budget, idle_budget), max_model_len, PREFILL_MAX_ROWS)
    while True:
        sizes.append(T)
        if T >= top:
            break
        T *= 2
    chunk = -(-budget // PREFILL_ROWS) * PREFILL_ROWS  # the budget's own chunk
    if chunk < sizes[-1] and chunk not in sizes:
        above = [T for T in sizes if T > chunk] if chunk < top else []  # (a budget at the top: none holds a chunk)
        sizes = [T for T in sizes if T < chunk] + [chunk] + above
    shapes = []
    for T in sizes:
        fit = max((b for b in LANE_BUCKETS if b * T <= padded_rows_allowed(budget)), default=1)
        shapes.append((T, min(fit, max_slots) if T < 2 * budget else 1))
    return tuple(shapes)


class LaneGraphs:
    """One function's graphs, one per bucket. inputs: per input (per-lane shape, dtype, padding value)."""

    def __init__(self, name: str, fn: Callable, inputs: Sequence[tuple], buckets: tuple[int, ...], device, pool):
        self.name, self.fn, self.buckets, self.pool = name, fn, buckets, pool
        self.pads = tuple(pad for _, _, pad in inputs)
        self.flat = None  # inputs of one dtype: their static buffers are sections of this one
        if len({dtype for _, dtype, _ in inputs}) == 1:
            sizes = [buckets[-1] * math.prod(shape) for shape, _, _ in inputs]
            self.flat = torch.empty(sum(sizes), dtype=inputs[0][1], device=device)
            self.static = tuple(part.view(buckets[-1], *shape).fill_(pad)
                                for part, (shape, _, pad) in zip(self.flat.split(sizes), inputs))
        else:
            self.static = tuple(torch.full((buckets[-1], *shape), pad, dtype=dtype, device=device)
                                for shape, dtype, pad in inputs)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple]] = {}

    def capture(self, bucket: int) -> None:
        graph, out = capture(lambda: self.fn(*(s[:bucket] for s in self.static)), self.pool)
        self.graphs[bucket] = (graph, out if isinstance(out, tuple) else (out,))

    def bucket(self, L: int) -> int | None:
        """The smallest bucket of at least L lanes (None: more lanes than the largest)."""
        return next((b for b in self.buckets if b >= L), None)

    def _replay(self, bucket: int, L: int) -> tuple:
        graph, out = self.graphs[bucket]
        graph.replay()
        return tuple(None if o is None else o[:L] for o in out)

    def run(self, *inputs: torch.Tensor) -> tuple | None:
        L = inputs[0].shape[0]
        bucket = self.bucket(L)
        if bucket is None:
            return None
        for buffer, x, pad in zip(self.static, inputs, self.pads):
            buffer[:L].copy_(x)
            if L < bucket:
                buffer[L:bucket].fill_(pad)
        return self._replay(bucket, L)

    def run_host(self, *inputs: np.ndarray) -> tuple | None:
        """`run` from host arrays, each [L, *per-lane shape]: one host -> device transfer of the flat
        static buffer (lanes L..b-1 padded on the host; lanes past bucket b carry whatever the host array
        held: b's graph reads none of them). Inputs of one dtype only. Returns the outputs' first L lanes
        (views of the graph's own: read them before the next call), or None when L exceeds every bucket."""
        if self.flat is None:
            raise ValueError(f"{self.name}: run_host takes inputs of one dtype")
        L = len(inputs[0])
        bucket = self.bucket(L)
        if bucket is None:
            return None
        host = np.empty(self.flat.numel(), dtype=inputs[0].dtype)
        offset = 0
        for x, static, pad in zip(inputs, self.static, self.pads):
            section = host[offset:offset + static.numel()].reshape(static.shape)
            section[:L] = x
            section[L:bucket] = pad
            offset += static.numel()
        staged = PinnedStaging.of(self.flat.device).stage(host) if self.flat.is_cuda else torch.from_numpy(host)
        self.flat.copy_(staged, non_blocking=True)
        return self._replay(bucket, L)


class CudaGraphs:
    """Every CUDA graph of one engine: one memory pool, one set of lane buckets. Functions register
    with `add`; `capture_all` captures them all at start (largest bucket first)."""

    def __init__(self, max_lanes: int, device):
        self.buckets = buckets_for(max_lanes)
        self.device = torch.device(device)
        self.pool = torch.cuda.graph_pool_handle()
        self.functions: list[LaneGraphs] = []
        self.capture_s = 0.0

    def add(self, name: str, fn: Callable, inputs: Sequence[tuple], max_lanes: int | None = None,
            buckets: tuple[int, ...] | None = None) -> LaneGraphs:
        """Register fn (captured at every bucket, or at those up to max_lanes' bucket, or at `buckets`)."""
        if buckets is None:
            buckets = self.buckets if max_lanes is None else buckets_for(max_lanes, self.buckets)
        graphs = LaneGraphs(name, fn, inputs, buckets, self.device, self.pool)
        self.functions.append(graphs)
        return graphs

    @torch.inference_mode()
    def capture_all(self, progress: bool = False) -> float:
        """Capture every registered function at every bucket; returns the seconds it took."""
        from tqdm import tqdm

        t0 = time.perf_counter()
        every = sorted({b for graphs in self.functions for b in graphs.buckets}, reverse=True)
        jobs = [(bucket, graphs) for bucket in every for graphs in self.functions if bucket in graphs.buckets]
        with tqdm(jobs, desc="capturing CUDA graphs", unit="graph", disable=not progress) as bar:
            for bucket, graphs in bar:
                bar.set_postfix_str(f"{graphs.name}, {bucket} lanes")
                graphs.capture(bucket)
        torch.cuda.synchronize(self.device)
        self.capture_s = time.perf_counter() - t0
        return self.capture_s
