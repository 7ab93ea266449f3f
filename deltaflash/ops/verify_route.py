"""Which implementation serves the verify route: the fused Triton kernels or the unfused reference.

The fused route is used on CUDA unless DELTAFLASH_NO_FUSED_KERNELS=1; on CPU the unfused torch route
runs (the kernels run on CPU only under TRITON_INTERPRET=1, in their tests).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch


@dataclass(frozen=True)
class VerifyOps:
    """The four operations of the verify route (signatures in ops/conv and ops/gdn READMEs). Both
    routes' conv_tree_step and gdn_verify take the fused kernels' keyword outputs."""

    name: str
    conv_tree_step: Callable
    gdn_verify: Callable
    replay_commit: Callable
    conv_commit: Callable


def _writing_into(fn: Callable, *out_names: str) -> Callable:
    """A reference op returning a tuple, given the fused op's keyword outputs (`out_names`, one per
    result): results are copied into the outputs that are given. Other keywords (the `chains` hint)
    pass through to the reference."""

    def op(*args, **kwargs):
        outs = {name: kwargs.pop(name, None) for name in out_names}
        results = fn(*args, **kwargs)
        return tuple(r if outs.get(name) is None else outs[name].copy_(r) for r, name in zip(results, out_names))

    return op


def unfused_ops() -> VerifyOps:
    from deltaflash.ops.conv.naive import conv_commit_ref, conv_tree_step_ref
    from deltaflash.ops.gdn.naive import gdn_verify_ref, replay_commit_ref

    return VerifyOps("unfused", _writing_into(conv_tree_step_ref, "out", "window_out"),
                     _writing_into(gdn_verify_ref, "out", "replay_log_out"), replay_commit_ref, conv_commit_ref)


def fused_ops() -> VerifyOps:
    from deltaflash.ops.conv.tree_step import conv_tree_step
    from deltaflash.ops.gdn.commit import conv_commit, replay_commit
    from deltaflash.ops.gdn.verify import gdn_verify

    # the commit transaction (cache/commit.py) validates the plan on the host before either launch
    return VerifyOps("fused", conv_tree_step, gdn_verify, partial(replay_commit, validate=False),
                     partial(conv_commit, validate=False))


@functools.cache
def fused_disabled() -> bool:
    """DELTAFLASH_NO_FUSED_KERNELS, read once per process (norms ask on every call)."""
    return os.environ.get("DELTAFLASH_NO_FUSED_KERNELS", "0") not in ("", "0")


def select_verify_ops(device: torch.device) -> VerifyOps:
    if torch.device(device).type == "cuda" and not fused_disabled():
        return fused_ops()
    return unfused_ops()
