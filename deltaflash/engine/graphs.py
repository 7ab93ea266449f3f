"""CUDA graphs captured per lane bucket: the verify forward, and any lane-batched function (the
drafter's block forward, its context append).

A round with L lanes replays the graph of the smallest bucket >= L. Inputs are copied into the
bucket's static buffers; the lanes past L are padding lanes (slot id -1: they read zeros, their
K/V rows go to the pool's sink and no state is touched), so padding costs nothing to correctness.
Attention reads a fixed number of cache rows (the pool's max_len) so every replay has one shape.
"""

from __future__ import annotations

import torch

from deltaflash.engine.batch import VerifyBatch, VerifyOutput

LANE_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def capture(fn, pool=None, warmups: int = 2) -> tuple[torch.cuda.CUDAGraph, object]:
    """(graph, fn's output): fn run `warmups` times on a side stream (Triton compiles, cuBLAS picks
    its kernels, outside the capture), then captured once into `pool`."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out


class VerifyGraphRunner:
    def __init__(self, model, pool, verify_ops, width: int, tap_layer_ids=(), buckets=LANE_BUCKETS):
        self.model, self.pool, self.verify_ops = model, pool, verify_ops
        self.width, self.tap_layer_ids, self.buckets = width, tuple(tap_layer_ids), tuple(sorted(buckets))
        self.device = model.embed_tokens.weight.device
        self.memory_pool = torch.cuda.graph_pool_handle()
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, VerifyBatch, VerifyOutput]] = {}

    def bucket(self, lanes: int) -> int | None:
        return next((b for b in self.buckets if b >= lanes), None)

    def _static_batch(self, lanes: int) -> VerifyBatch:
        W, dev = self.width, self.device
        chain = torch.arange(W, device=dev)
        return VerifyBatch(
            input_ids=torch.zeros(lanes, W, dtype=torch.long, device=dev),
            parents=(chain - 1).expand(lanes, W).contiguous(),
            positions=chain.expand(lanes, W).contiguous(),
            slot_ids=torch.full((lanes,), -1, dtype=torch.long, device=dev),
            start=torch.zeros(lanes, dtype=torch.long, device=dev),
            slot_ids_host=(-1,) * lanes, start_host=(0,) * lanes, chain_host=True)

    def _forward(self, batch: VerifyBatch) -> VerifyOutput:
        return self.model.verify(batch, self.pool, self.verify_ops, self.tap_layer_ids, kmax=self.pool.max_len)

    def _capture(self, lanes: int):
        static = self._static_batch(lanes)
        graph, out = capture(lambda: self._forward(static), self.memory_pool)
        self._graphs[lanes] = (graph, static, out)
        return self._graphs[lanes]

    def run(self, batch: VerifyBatch) -> VerifyOutput | None:
        """Replay the bucket's graph for `batch` (chains of width W: the graphs run the chain-only
        kernel); None when no bucket fits or the batch is not known to be chains."""
        L = batch.num_lanes
        bucket = self.bucket(L)
        if bucket is None or batch.width != self.width or not batch.chain_host:
            return None
        graph, static, out = self._graphs.get(bucket) or self._capture(bucket)
        static.input_ids[:L].copy_(batch.input_ids)
        static.parents[:L].copy_(batch.parents)
        static.positions[:L].copy_(batch.positions)
        static.slot_ids[:L].copy_(batch.slot_ids)
        static.start[:L].copy_(batch.start)
        if L < bucket:
            static.slot_ids[L:].fill_(-1)
            static.input_ids[L:].zero_()
            static.start[L:].zero_()
            static.positions[L:].copy_(torch.arange(self.width, device=self.device).expand(bucket - L, -1))
        graph.replay()
        return VerifyOutput(logits=out.logits[:L], taps=None if out.taps is None else out.taps[:L],
                            conv_windows=out.conv_windows[:, :L], replay_log=out.replay_log[:, :L])


class LaneGraphs:
    """CUDA graphs of `fn(*inputs)`, one per lane bucket. Every input and output has the lanes as its
    first dim. A call with L lanes replays the smallest bucket >= L; lanes past L get `pad_values`
    (one per input: slot ids -1, so padding reads nothing and writes only to sinks). `run` returns
    None when no bucket fits (the caller runs fn eagerly)."""

    def __init__(self, fn, pad_values: tuple, buckets=LANE_BUCKETS):
        self.fn, self.pad_values, self.buckets = fn, pad_values, tuple(sorted(buckets))
        self.memory_pool = torch.cuda.graph_pool_handle()
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple, tuple]] = {}

    def _capture(self, bucket: int, inputs: tuple):
        static = tuple(torch.full((bucket, *x.shape[1:]), pad, dtype=x.dtype, device=x.device)
                       for x, pad in zip(inputs, self.pad_values))
        graph, out = capture(lambda: self.fn(*static), self.memory_pool)  # warmed up on padding lanes
        self._graphs[bucket] = (graph, static, out if isinstance(out, tuple) else (out,))
        return self._graphs[bucket]

    def run(self, *inputs: torch.Tensor) -> tuple | None:
        L = inputs[0].shape[0]
        bucket = next((b for b in self.buckets if b >= L), None)
        if bucket is None:
            return None
        graph, static, out = self._graphs.get(bucket) or self._capture(bucket, inputs)
        for buffer, x, pad in zip(static, inputs, self.pad_values):
            buffer[:L].copy_(x)
            if L < bucket:
                buffer[L:].fill_(pad)
        graph.replay()
        return tuple(o[:L] for o in out)
