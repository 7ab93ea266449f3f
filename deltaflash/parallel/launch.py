"""Ranks of a tensor-parallel engine: one process per device, joined in one torch.distributed group
(NCCL on CUDA, gloo on the CPU), each running the same program (SPMD).

Every rank builds the whole engine over its share of the target (parallel/tensor.py) and a whole copy of
the drafter, and takes the same requests in the same order: scheduling is a deterministic function of
the requests and of what the rounds accepted, and every rank reads the same accepted tokens (the
all-reduced logits are the same bits on every rank), so the ranks' schedulers stay in step with no
traffic beyond the layers' all-reduces. What could part them is made common at start: the page pool
(the smallest any rank can hold), the seeds of unseeded requests (one generator, seeded from rank 0),
and widths chosen from timings (load-adaptive speculation is refused; rounds take the block).
"""

from __future__ import annotations

import datetime
import random
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from deltaflash.errors import DeltaflashError

COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)  # a dead or stuck rank ends the others with an error


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


def _rank_main(rank: int, size: int, device_type: str, init: str, fn: Callable, args: tuple, out: str) -> None:
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", init_method=f"file://{init}", rank=rank,
                            world_size=size, timeout=COLLECTIVE_TIMEOUT)
    try:
        result = fn(TensorParallel(rank, size), *args)
        if rank == 0:
            torch.save(result, out)
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable, size: int, device_type: str, *args):
    """fn(TensorParallel, *args) on `size` new processes (rank r on cuda:r, or all on the CPU); returns
    rank 0's result (which must pickle). An exception on any rank stops them all and is raised here as a
    DeltaflashError naming the rank and the error."""
    if size < 1:
        raise DeltaflashError(f"tensor parallel size must be >= 1, got {size}")
    if device_type == "cuda" and torch.cuda.device_count() < size:
        raise DeltaflashError(f"tensor parallel size {size} needs {size} GPUs; this machine has "
                              f"{torch.cuda.device_count()}")
    with tempfile.TemporaryDirectory(prefix="deltaflash-tp-") as tmp:
        out = Path(tmp) / "rank0.pt"
        try:
            mp.spawn(_rank_main, args=(size, device_type, str(Path(tmp) / "init"), fn, args, str(out)), nprocs=size,
                     join=True)
        except mp.ProcessRaisedException as exc:
            last = str(exc).strip().splitlines()[-1]
            raise DeltaflashError(f"tensor parallel rank {exc.error_index} failed: {last}") from None
        except mp.ProcessExitedException as exc:
            raise DeltaflashError(f"tensor parallel rank {exc.error_index} exited with code {exc.exit_code}") from None
        return torch.load(out, weights_only=False)
