"""Every engine option, resolved once - flags, defaults and environment variables - into a frozen
`EngineConfig` the engine holds. Nothing else in the package reads the environment.

Environment variables (README, "Environment"):
- DELTAFLASH_NO_FUSED_KERNELS=1: run the pure-torch reference kernels (ops/*/naive.py) on CUDA too.
- DELTAFLASH_NO_CUDA_GRAPHS=1: run every forward eagerly on CUDA (no graph capture at start).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from deltaflash.errors import DeltaflashError

ENV_NO_FUSED_KERNELS = "DELTAFLASH_NO_FUSED_KERNELS"
ENV_NO_CUDA_GRAPHS = "DELTAFLASH_NO_CUDA_GRAPHS"


def _env_flag(env: Mapping[str, str], name: str) -> bool:
    return env.get(name, "0").strip().lower() not in ("", "0", "false", "no")


@dataclass(frozen=True)
class EngineConfig:
    """Options of one engine. `resolve` turns the automatic ones into decisions:

    max_slots: sequences served together (one slot of GDN state each).
    max_model_len: prompt + generated tokens of one sequence.
    prefill_chunk: prompt tokens per step, over all prefilling sequences.
    block_size: W, rows a speculating lane verifies; 0 = the drafter's own; resolved to 1 without a drafter.
    kernels: "triton" (fused kernels) or "reference" (pure torch); "auto" = triton on CUDA unless
        DELTAFLASH_NO_FUSED_KERNELS=1, reference on CPU.
    cuda_graphs: replay rounds from CUDA graphs captured at start; None = on CUDA unless
        DELTAFLASH_NO_CUDA_GRAPHS=1.
    sync_phase_timing: sync the device between round phases (profiling: exact phase times, slower).
    """

    max_slots: int = 8
    max_model_len: int = 4096
    prefill_chunk: int = 512
    block_size: int = 0
    kernels: str = "auto"
    cuda_graphs: bool | None = None
    sync_phase_timing: bool = False

    def resolve(self, device: torch.device, drafter_block: int | None,
                env: Mapping[str, str] | None = None) -> "EngineConfig":
        """The decided config for an engine on `device` whose draft source drafts blocks of
        `drafter_block` (None: no draft source). Raises DeltaflashError for impossible options."""
        env = os.environ if env is None else env
        for name, low in (("max_slots", 1), ("max_model_len", 2), ("prefill_chunk", 1), ("block_size", 0)):
            if getattr(self, name) < low:
                raise DeltaflashError(f"{name} must be >= {low}, got {getattr(self, name)}")
        cuda = torch.device(device).type == "cuda"
        kernels = self.kernels
        if kernels == "auto":
            kernels = "triton" if cuda and not _env_flag(env, ENV_NO_FUSED_KERNELS) else "reference"
        if kernels not in ("triton", "reference"):
            raise DeltaflashError(f"kernels must be 'triton', 'reference' or 'auto', got {kernels!r}")
        graphs = cuda and not _env_flag(env, ENV_NO_CUDA_GRAPHS) if self.cuda_graphs is None else self.cuda_graphs
        if graphs and not cuda:
            raise DeltaflashError("cuda_graphs needs a CUDA device")
        if drafter_block is None:
            if self.block_size > 1:
                raise DeltaflashError(f"block size {self.block_size} needs a drafter (--draft)")
            block = 1
        else:
            block = self.block_size or drafter_block
            if block < 2:
                raise DeltaflashError(f"block size must be >= 2 to speculate, got {block}")
        return dataclasses.replace(self, kernels=kernels, cuda_graphs=graphs, block_size=block)

    @property
    def speculative(self) -> bool:
        return self.block_size > 1
