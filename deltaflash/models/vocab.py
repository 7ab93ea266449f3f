"""The target's token embedding and output projection as one object, whole or one rank's share.

Under tensor parallelism (parallel/tensor.py) each rank holds rows [start, start + rows) of both
tables (vocab-parallel): a lookup of an id outside the share gives zeros and `reduce` (an all-reduce)
adds the ranks' lookups - one of them nonzero, so the sum is that row, exactly; a product gives the
share's logits and `gather` (an all-gather) concatenates them in rank order. Every rank then holds the
whole [..., V] logits: acceptance, sampling and log probabilities run unchanged, and the same on every
rank. A greedy round needs only each row's argmax: `argmax` finds it from the shares, gathering one
(max, index) pair per rank and row instead of V / N logits. The drafter, replicated, uses the target's
tables through the same object.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


def _whole(t: Tensor) -> Tensor:
    return t


@dataclass(frozen=True)
class Vocab:
    embed_weight: Tensor  # [rows, H]
    head_weight: Tensor  # [rows, H] (the embedding's own when the checkpoint ties them)
    size: int  # V, the whole vocabulary
    start: int = 0  # the share's first row
    reduce: Callable[[Tensor], Tensor] = _whole  # sums the ranks' lookups
    gather: Callable[[Tensor], Tensor] = _whole  # concatenates the ranks' logits along the last dim

    @classmethod
    def whole(cls, embed_weight: Tensor, head_weight: Tensor | None = None) -> "Vocab":
        """The whole tables (head_weight None: tied to the embedding)."""
        return cls(embed_weight, embed_weight if head_weight is None else head_weight, embed_weight.shape[0])

    @property
    def sharded(self) -> bool:
        return self.embed_weight.shape[0] != self.size

    @property
    def device(self) -> torch.device:
        return self.embed_weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_weight.dtype

    def embed(self, ids: Tensor) -> Tensor:
        """ids [...] -> [..., H] in the tables' dtype."""
        if not self.sharded:
            return F.embedding(ids, self.embed_weight)
        local = ids - self.start
        inside = (local >= 0) & (local < self.embed_weight.shape[0])
        rows = F.embedding(torch.where(inside, local, 0), self.embed_weight)
        return self.reduce(rows * inside[..., None].to(rows.dtype))

    def project(self, hidden: Tensor, linear: Callable = F.linear, gather: bool = True) -> Tensor:
        """hidden [..., H] -> logits [..., V] in the tables' dtype (`linear`: the product to use).
        gather False: this rank's share [..., rows] of them, for `argmax` (whole logits when not sharded)."""
        logits = linear(hidden, self.head_weight)
        return self.gather(logits.contiguous()) if self.sharded and gather else logits

    def argmax(self, logits: Tensor) -> Tensor:
        """The whole vocabulary's argmax [...] (long) of `logits`: this rank's share [..., rows]
        (`project(..., gather=False)`), or the whole rows when not sharded. Each rank's (max, index)
        pairs are gathered - 2 values a row, not V / N - and the first rank holding the largest value
        wins, as torch.argmax takes a tie's first index: the same ids as the argmax of gathered logits."""
        if not self.sharded:
            return logits.argmax(dim=-1)
        if self.size > 1 << 24:  # ids travel as fp32 beside the values: exact below 2^24
            return self.gather(logits.contiguous()).argmax(dim=-1)
        best, index = logits.float().max(dim=-1)
        pairs = torch.stack([best, (index + self.start).float()], dim=-1)
        ranks = self.gather(pairs.contiguous()).unflatten(-1, (-1, 2))  # [..., N, (max, id)]
        winner = ranks[..., 0].argmax(dim=-1, keepdim=True)
        return ranks[..., 1].gather(-1, winner)[..., 0].long()
