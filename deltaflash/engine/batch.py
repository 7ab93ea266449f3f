"""Data that flows between the stages of a step: small frozen dataclasses, shapes in docstrings."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExtendBatch:
    """Rows that extend sequences and write their state (prefill chunks and plain decode).

    input_ids [L, T] long, positions [L, T] long (start + t); slot_ids [L] long on the device
    (-1 = padding lane: reads zeros, writes nothing); n_rows [L] long on the device (valid rows,
    first in each lane). `*_host` mirror them as Python ints so no step syncs to read them.
    live_lanes [L'] long on the device: the lanes with a slot, in order; packed_rows [N] long
    (device): lane * T + t of each valid row of those lanes, in order (the rows packed one after
    another); cu_seqlens [L'+1] long (device) and cu_seqlens_host (CPU): the packed offsets. Built
    once per batch, so no layer copies host data to the device (each such copy waits for the stream).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_ids: torch.Tensor
    n_rows: torch.Tensor
    slot_ids_host: tuple[int, ...]
    n_rows_host: tuple[int, ...]
    start_host: tuple[int, ...]
    live_lanes: torch.Tensor
    packed_rows: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_host: torch.Tensor

    @property
    def live_lanes_host(self) -> list[int]:
        return [i for i, s in enumerate(self.slot_ids_host) if s >= 0]

    @property
    def num_lanes(self) -> int:
        return self.input_ids.shape[0]

    @classmethod
    def build(cls, lanes: list[tuple[int, int, list[int]]], device, pad_lanes_to: int | None = None) -> "ExtendBatch":
        """lanes: (slot, start position, token ids). Padded to the longest lane (and to
        `pad_lanes_to` lanes with padding lanes of slot -1)."""
        T = max(len(ids) for _, _, ids in lanes)
        L = max(len(lanes), pad_lanes_to or 0)
        ids = torch.zeros(L, T, dtype=torch.long)
        pos = torch.zeros(L, T, dtype=torch.long)
        slots, n_rows, starts = [-1] * L, [0] * L, [0] * L
        for i, (slot, start, toks) in enumerate(lanes):
            ids[i, : len(toks)] = torch.tensor(toks, dtype=torch.long)
            pos[i] = start + torch.arange(T)
            slots[i], n_rows[i], starts[i] = slot, len(toks), start
        live = [i for i, s in enumerate(slots) if s >= 0]
        cu = torch.tensor([0] + [n_rows[i] for i in live], dtype=torch.long).cumsum(0)
        return cls(
            input_ids=ids.to(device),
            positions=pos.to(device),
            slot_ids=torch.tensor(slots, dtype=torch.long).to(device),
            n_rows=torch.tensor(n_rows, dtype=torch.long).to(device),
            slot_ids_host=tuple(slots),
            n_rows_host=tuple(n_rows),
            start_host=tuple(starts),
            live_lanes=torch.tensor(live, dtype=torch.long).to(device),
            packed_rows=torch.tensor([i * T + t for i in live for t in range(n_rows[i])], dtype=torch.long).to(device),
            cu_seqlens=cu.to(device),
            cu_seqlens_host=cu,
        )


@dataclass(frozen=True)
class VerifyBatch:
    """One verify forward: every lane contributes W rows `[anchor, d1..d_{W-1}]` forming a tree.

    input_ids [L, W] long; parents [L, W] long (parents[:, 0] = -1, parents[n] < n; a chain is n-1);
    depth [L, W] long (root 0); positions [L, W] = start + depth; slot_ids [L] long (-1 padding).
    Row n of a lane is stored in the attention cache at start + n (a chain: at its own position).
    chain_host: the caller knows every lane is a chain (parents n - 1): the GDN verify kernel then
    compiles its tree path out.
    """

    input_ids: torch.Tensor
    parents: torch.Tensor
    positions: torch.Tensor
    slot_ids: torch.Tensor
    start: torch.Tensor
    slot_ids_host: tuple[int, ...]
    start_host: tuple[int, ...]
    chain_host: bool = False

    @property
    def num_lanes(self) -> int:
        return self.input_ids.shape[0]

    @property
    def width(self) -> int:
        return self.input_ids.shape[1]


@dataclass(frozen=True)
class VerifyOutput:
    """What verify produced, read-only state untouched.

    logits [L, W, V] fp32; taps [L, W, n_taps * H] (hidden states after the tap layers, or None);
    conv_windows [G, L, C, K-1+W] (history | rows, per GDN layer); replay_log [G, L, W, nv, 1+dk+dv]
    fp32 ([gamma, k, delta] per row and value head).
    """

    logits: torch.Tensor
    taps: torch.Tensor | None
    conv_windows: torch.Tensor
    replay_log: torch.Tensor


@dataclass(frozen=True)
class CommitPlan:
    """Which verify rows become part of each lane's sequence.

    slot_ids [L] long (-1 padding); accepted_nodes [L, W] long (node ids of the accepted path in token
    order; a chain is arange); accepted_len [L] long in 0..W (rows committed, bonus anchor included).
    chain_host: the caller knows every accepted path is 0, 1, 2, ... (no K/V rows to move, so the
    commit need not ask the device).
    """

    slot_ids: torch.Tensor
    accepted_nodes: torch.Tensor
    accepted_len: torch.Tensor
    slot_ids_host: tuple[int, ...]
    accepted_len_host: tuple[int, ...]
    start_host: tuple[int, ...]
    chain_host: bool = False
