"""Ranks of a tensor-parallel engine: one process per device, joined in one torch.distributed group
(NCCL on CUDA, gloo on the CPU), each running the same program (SPMD).

Every rank builds the whole engine over its share of the target (parallel/tensor.py) and a whole copy of
the drafter, and takes the same requests in the same order: scheduling is a deterministic function of
the requests and of what the rounds accepted, and every rank reads the same accepted tokens (the logits,
all-gathered from the vocabulary's shares, are the same bits on every rank), so the ranks' schedulers
stay in step with no traffic beyond the model's collectives. What could part them is made common at
start: the page pool (the smallest any rank can hold), the seeds of unseeded requests (one generator,
seeded from rank 0), and widths chosen from timings (load-adaptive speculation is refused; rounds take
the block).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import random
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from deltaflash.errors import DeltaflashError

COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=2)  # a dead or stuck rank ends the others with an error


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in the group: rank of size (group None: the default group)."""

    rank: int
    size: int
    group: object = None

    def device_tensor(self, values, device) -> torch.Tensor:
        # NCCL reduces CUDA tensors only; gloo CPU ones
        on = device if dist.get_backend(self.group) == "nccl" else "cpu"
        return torch.tensor(values, dtype=torch.long, device=on)

    def smallest(self, value: int, device) -> int:
        """The smallest of every rank's value."""
        t = self.device_tensor([value], device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def common_seeds(self, device) -> random.Random:
        """A generator every rank draws the same numbers from (seeded by rank 0)."""
        t = self.device_tensor([random.SystemRandom().getrandbits(62)], device)
        dist.broadcast(t, src=0, group=self.group)
        return random.Random(int(t.item()))


def _join(rank: int, size: int, device_type: str, init: str) -> None:
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", init_method=init, rank=rank, world_size=size,
                            timeout=COLLECTIVE_TIMEOUT)


def _follower_main(rank: int, size: int, device_type: str, init: str, fn: Callable, args: tuple, errors) -> None:
    try:
        _join(rank, size, device_type, init)
        try:
            fn(TensorParallel(rank, size), *args)
            dist.barrier()  # see ranks()
        finally:
            dist.destroy_process_group()
    except BaseException as exc:  # reported to rank 0, which names it
        errors.put((rank, f"{type(exc).__name__}: {exc}"))
        raise
    # A finished follower leaves without finalizing the interpreter: gloo's worker thread may still be
    # releasing the last collectives' work (a barrier keeps the tensors of the work before it), and
    # freeing a tensor Python once owned takes the GIL - from a finalizing interpreter that ends the
    # thread inside a destructor, and the process aborts (std::terminate, exit code -6).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@contextlib.contextmanager
def ranks(size: int, device_type: str, follower: Callable, *args) -> Iterator[TensorParallel]:
    """Rank 0 in this process, ranks 1..size-1 in new processes running follower(TensorParallel, *args)
    (rank r on cuda:r, or all on the CPU); yields rank 0's TensorParallel once the group is formed. A
    rank that fails ends the others (at their next collective, within COLLECTIVE_TIMEOUT at most) and
    its error is raised here as a DeltaflashError naming the rank."""
    if size < 2:
        raise DeltaflashError(f"tensor parallelism needs at least 2 ranks, got {size}")
    if device_type == "cuda" and torch.cuda.device_count() < size:
        raise DeltaflashError(f"tensor parallel size {size} needs {size} GPUs; this machine has "
                              f"{torch.cuda.device_count()}")
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory(prefix="deltaflash-tp-") as tmp:
        init = f"file://{Path(tmp) / 'init'}"
        followers = [ctx.Process(target=_follower_main, args=(r, size, device_type, init, follower, args, errors),
                                 daemon=True) for r in range(1, size)]
        for p in followers:
            p.start()
        failure = None
        try:
            _join(0, size, device_type, init)
            try:
                yield TensorParallel(0, size)
                # no rank tears the group down while another may still be inside its last collective (a
                # peer's connection closing under it aborts that process)
                dist.barrier()
            finally:
                dist.destroy_process_group()
        except Exception as exc:
            failure = exc
        for p in followers:
            p.join(timeout=60 if failure is None else 5)
            if p.is_alive():
                p.terminate()
        if not errors.empty():
            rank, message = errors.get()
            raise DeltaflashError(f"tensor parallel rank {rank} failed: {message}") from failure
        if failure is not None:
            raise failure
        bad = [(r, p.exitcode) for r, p in enumerate(followers, 1) if p.exitcode]
        if bad:
            raise DeltaflashError(f"tensor parallel rank {bad[0][0]} exited with code {bad[0][1]}")


class MirroredEngine:
    """Rank 0's engine of a tensor-parallel server: each call that changes what the engines will do
    (add_request, abort, step) goes to the follower ranks too, in the order it happened, so their engines
    (`follow`) take the same requests and run the same steps. Everything else is the engine's own."""

    def __init__(self, engine, tensor_parallel: TensorParallel):
        self._engine, self._tp, self._pending = engine, tensor_parallel, []

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def add_request(self, prompt_ids, params, request_id=None) -> str:
        request_id = self._engine.add_request(prompt_ids, params, request_id)  # a bad request: nothing to send
        self._pending.append(("add", list(prompt_ids), params, request_id))
        return request_id

    def abort(self, request_id: str) -> None:
        self._engine.abort(request_id)
        self._pending.append(("abort", request_id))

    def step(self, on_report=None, overlap=None):
        """`overlap`'s add_request / abort calls reach the followers with the next step, as they count
        from the next step on rank 0 too."""
        self._send(step=True)
        return self._engine.step(on_report, overlap)

    def idle(self) -> None:
        """Between waits for requests: what is pending goes out (the followers' collectives stay alive)."""
        self._send(step=False)

    def close(self) -> None:
        """The followers' `follow` returns."""
        self._send(step=False, close=True)

    def _send(self, step: bool, close: bool = False) -> None:
        message, self._pending = [(self._pending, step, close)], []
        dist.broadcast_object_list(message, src=0, group=self._tp.group)


def follow(engine, tensor_parallel: TensorParallel) -> None:
    """A follower rank's serving loop: apply what rank 0's MirroredEngine sends, until it closes."""
    while True:
        message = [None]
        dist.broadcast_object_list(message, src=0, group=tensor_parallel.group)
        commands, step, close = message[0]
        for command in commands:
            if command[0] == "add":
                engine.add_request(*command[1:])
            else:
                engine.abort(command[1])
        if close:
            return
        if step:
            engine.step()
