"""Checks that hold tests to what CUDA needs, on any device."""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class _NoHostReads(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        assert func is not torch.ops.aten._local_scalar_dense.default, f"host read: {func}"
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def no_host_reads():
    """Fails on any op that reads a tensor's value on the host (aten._local_scalar_dense: item(), bool(),
    a 0-dim tensor as an index): a sync on CUDA, and a voided capture inside a CUDA graph. Outside
    torch.inference_mode only: inference tensors' reads do not reach a dispatch mode."""
    with _NoHostReads():
        yield
