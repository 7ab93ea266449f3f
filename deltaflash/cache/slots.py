"""The slot pool: persistent per-sequence state of the target model.

One slot owns one live sequence: GDN conv history and fp32 recurrent state for every GDN layer, and
the attention K/V of every full-attention layer. The scheduler hands slots out (`SlotTable`, host
only); the runner resets a slot's device state at admission (`SlotPool.reset`). No state is ever
shared between slots.
"""

from __future__ import annotations

import torch

from deltaflash.config import ModelConfig
from deltaflash.errors import SlotsExhaustedError


class SlotPool:
    """Tensors (S slots, G GDN layers, A attention layers, C conv channels, K conv taps):
        conv_history    [S, G, C, K-1]            activation dtype
        recurrent_state [S, G, nv, dk, dv]        fp32
        key_cache       [S+1, A, max_len, nkv, hd]  activation dtype (zeros until written; +1: the sink)
        value_cache     [S+1, A, max_len, nkv, hd]
    `lengths[slot]` is the number of committed positions (host ints: read without a device sync).
    """

    def __init__(self, cfg: ModelConfig, num_slots: int, max_len: int, dtype: torch.dtype, device):
        G, A = len(cfg.gdn_layer_ids), len(cfg.attn_layer_ids)
        self.num_slots, self.max_len = num_slots, max_len
        self.conv_history = torch.zeros(num_slots, G, cfg.conv_channels, cfg.conv_kernel - 1, dtype=dtype, device=device)
        self.recurrent_state = torch.zeros(
            num_slots, G, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim,
            dtype=torch.float32, device=device,
        )
        # one extra K/V slot, `kv_sink`, takes the writes of padding lanes and padding rows so that
        # every write is unconditional (CUDA-graph friendly); nothing ever reads it as a sequence
        self.kv_sink = num_slots
        kv_shape = (num_slots + 1, A, max_len, cfg.num_kv_heads, cfg.head_dim)
        self.key_cache = torch.zeros(kv_shape, dtype=dtype, device=device)
        self.value_cache = torch.zeros(kv_shape, dtype=dtype, device=device)
        self.lengths = [0] * num_slots

    def kv_write_slots(self, slot_ids, rows_valid):
        """slot_ids [L] (-1 padding), rows_valid [L, T] bool -> [L, T] slot to write each row's K/V to
        (the sink for padding lanes and padding rows)."""
        keep = rows_valid & (slot_ids >= 0)[:, None]
        return torch.where(keep, slot_ids[:, None], self.kv_sink)

    def reset(self, slot: int) -> None:
        """Every part of a slot back to the empty sequence (admission). K/V past the length are never read."""
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} outside 0..{self.num_slots - 1}")
        self.conv_history[slot].zero_()
        self.recurrent_state[slot].zero_()
        self.lengths[slot] = 0


class SlotTable:
    """Which slots hold a live sequence (host only; the scheduler owns it). Slot 0 is handed out first."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_live(self) -> int:
        return self.num_slots - len(self._free)

    def take(self) -> int:
        if not self._free:
            raise SlotsExhaustedError(f"all {self.num_slots} slots hold live sequences; retire one or raise --max-concurrency")
        return self._free.pop()

    def give_back(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots or slot in self._free:
            raise ValueError(f"slot {slot} is not live")
        self._free.append(slot)
