"""How many pages the K/V pool gets: sized by memory, never by max_slots x max_model_len.

- A budget given (`kv_cache_memory`, `--kv-cache-memory`) is used as it is.
- CPU: 2 GiB.
- CUDA: `gpu_memory_utilization` of the device's memory, less everything else the engine holds at its
  peak: what is in use once the weights are loaded (weights, the CUDA context, other processes), the
  slot state, and the activations of the two largest things it runs - an eager prefill chunk and a
  round at the largest lane bucket (whose activations the CUDA graph pool keeps) - measured by running
  them once on a probe pool of a few pages (and the K/V run a long prompt's later chunk gathers for its
  attention: ops/attention/dense.py), plus 2% of the device for allocator slack and workspaces.
No pool holds more pages than `max_slots` sequences of full length could use.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CPU_KV_BYTES = 2 << 30
SLACK_FRACTION = 0.02


@dataclass(frozen=True)
class PagePlan:
    """num_pages of page_bytes each (target K/V and drafter context of page_size positions); `source`
    says where the budget came from; `capped`: more would fit than max_slots full sequences can use."""

    num_pages: int
    page_size: int
    page_bytes: int
    budget_bytes: int
    source: str
    capped: bool

    @property
    def tokens(self) -> int:
        return self.num_pages * self.page_size

    def describe(self, max_model_len: int, block_size: int) -> str:
        per_sequence = -(-(max_model_len + block_size) // self.page_size)
        return (f"K/V pages: {self.num_pages} x {self.page_size} positions = {self.tokens} tokens "
                f"({self.num_pages * self.page_bytes / 2**30:.2f} GiB, {self.source}); "
                f"{self.num_pages // per_sequence} sequences fit at the full context of {max_model_len}")


def cuda_budget(device: torch.device, utilization: float, slot_state_bytes: int, probe_peak_bytes: int) -> int:
    """Bytes left for pages on CUDA (module docstring); 0 when nothing is left."""
    free, total = torch.cuda.mem_get_info(device)
    in_use = total - free
    return max(0, int(utilization * total) - in_use - slot_state_bytes - probe_peak_bytes
               - int(SLACK_FRACTION * total))


def plan_pages(budget_bytes: int, page_bytes: int, page_size: int, most_pages: int, source: str) -> PagePlan:
    """page_bytes 0: a model without attention layers (no K/V): its pages hold nothing, so all fit."""
    fits = budget_bytes // page_bytes if page_bytes else most_pages
    return PagePlan(num_pages=int(min(fits, most_pages)), page_size=page_size, page_bytes=page_bytes,
                    budget_bytes=budget_bytes, source=source, capped=fits > most_pages)
