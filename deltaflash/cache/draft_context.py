"""Per-slot draft context K/V: every committed token's context row, projected once, for every drafter layer.

Layout: key / value [num_slots + 1, num_layers, capacity, nk, hd] in the drafter's dtype, and
lengths [num_slots + 1] int64 (= next position = rows committed). The token at position p lives at
row p, or at row p % capacity when every drafter layer is windowed (a ring of capacity = window:
a block query at anchor_pos only needs context rows > anchor_pos - window). The extra last slot is
the sink that padding rows (slot id -1) write to; its length stays 0, so padding lanes read nothing.
Rows that are not valid read as zeros, so stale or uninitialised storage never reaches attention.
"""

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class ContextView:
    """The context rows a batch of L lanes attends to, C rows per lane.

    keys, values: [L, num_layers, C, nk, hd] (zero where not valid)
    positions: [L, C] int64, the token position of each row (meaningless where not valid)
    valid: [L, C] bool, the row holds a committed token of the lane's slot
    """

    keys: Tensor
    values: Tensor
    positions: Tensor
    valid: Tensor


class DraftContextCache:
    """Owner of the drafter's persistent context K/V; one slot per live sequence."""

    def __init__(
        self, *, num_slots: int, max_model_len: int, num_layers: int, num_kv_heads: int, head_dim: int,
        ring_window: int | None, dtype: torch.dtype, device: str | torch.device,
    ) -> None:
        """ring_window: the drafter's window when every layer is windowed (DraftConfig.ring_window), else None."""
        self.num_slots = num_slots
        self.ring = ring_window is not None
        self.capacity = min(ring_window, max_model_len) if self.ring else max_model_len
        shape = (num_slots + 1, num_layers, self.capacity, num_kv_heads, head_dim)
        self.key = torch.zeros(shape, dtype=dtype, device=device)
        self.value = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = torch.zeros(num_slots + 1, dtype=torch.int64, device=device)

    def reset(self, slot: int) -> None:
        """Forget slot's context (admission of a new sequence)."""
        self.lengths[slot] = 0

    def _slot_index(self, slot_ids: Tensor) -> Tensor:
        return torch.where(slot_ids < 0, self.num_slots, slot_ids)  # padding -> sink slot

    @torch.no_grad()
    def append(self, slot_ids: Tensor, positions: Tensor, keys: Tensor, values: Tensor) -> None:
        """Store committed rows: slot_ids [N] (-1 = padding: written to the sink), positions [N] int64
        (< max_model_len), keys / values [N, layers, nk, hd] (the drafter's projection of the rows'
        target features). A slot's rows must continue its context: positions length, length + 1, ...
        No host sync (CUDA-graph safe)."""
        if slot_ids.numel() == 0:
            return
        slots = self._slot_index(slot_ids)
        positions = torch.where(slot_ids < 0, 0, positions)
        self.lengths.scatter_reduce_(0, slots, positions + 1, reduce="amax")
        self.lengths[self.num_slots:].zero_()  # a kernel, not a host-to-device copy (CUDA-graph safe)
        rows = positions
        if self.ring:  # only the newest `capacity` rows of a slot survive this append
            rows = positions % self.capacity
            slots = torch.where(positions >= self.lengths[slots] - self.capacity, slots, self.num_slots)
        self.key[slots, :, rows] = keys.to(self.key.dtype)
        self.value[slots, :, rows] = values.to(self.value.dtype)

    def view(self, slot_ids: Tensor, max_context_len: int | None = None) -> ContextView:
        """Context of lanes slot_ids [L] (-1 = padding: nothing visible).

        max_context_len: a host-known bound on every lane's context length, to read fewer rows
        than the full capacity (no device sync needed to learn it).
        """
        slots = self._slot_index(slot_ids)
        rows = self.capacity if max_context_len is None or self.ring else min(max_context_len, self.capacity)
        lengths = self.lengths[slots][:, None]  # [L, 1]
        index = torch.arange(rows, device=slots.device)[None, :]  # [1, C]
        if self.ring:  # newest position p < length with p % capacity == index
            positions = lengths - 1 - torch.remainder(lengths - 1 - index, self.capacity)
            valid = positions >= 0
        else:
            positions = index.expand(slots.shape[0], -1)
            valid = positions < lengths
        shown = valid[:, None, :, None, None]
        keys = torch.where(shown, self.key[slots, :, :rows], 0)
        values = torch.where(shown, self.value[slots, :, :rows], 0)
        return ContextView(keys=keys, values=values, positions=positions, valid=valid)
