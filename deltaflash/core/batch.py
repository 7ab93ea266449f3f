"""Data that flows between the stages of a step: small frozen dataclasses, shapes in docstrings.

Host-built index tensors reach the device through `to_device` (pinned memory, asynchronous copy): a
plain `torch.tensor(..., device="cuda")` waits for the stream, which would be a host sync per call.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch.nn import functional as F


def to_device(values: Sequence | torch.Tensor, device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A host list (nested lists: rows of one length) / CPU tensor on `device` without waiting for the
    device: on CUDA a non-blocking copy from pinned memory (lists stage through PinnedStaging, a CPU
    tensor is pinned by the caching host allocator, which keeps the block alive until the copy is done).
    Lists are parsed by numpy: torch.tensor takes about 8x as long for a step's 5 x 64 ints."""
    device = torch.device(device)
    if isinstance(values, torch.Tensor):
        return values.to(device) if device.type != "cuda" else values.pin_memory().to(device, non_blocking=True)
    array = np.asarray(values, dtype=_NUMPY_TYPES.get(dtype) or torch.empty(0, dtype=dtype).numpy().dtype)
    if device.type != "cuda":
        return torch.from_numpy(array).to(device)
    return PinnedStaging.of(device).copy(array, dtype, device)


_NUMPY_TYPES = {torch.long: np.int64, torch.float32: np.float32, torch.int32: np.int32, torch.bool: np.bool_,
                torch.uint8: np.uint8}


class PinnedStaging:
    """One pinned host buffer per device that small host -> device copies stage through: numpy writes the
    values into it and one asynchronous copy moves them (H200, a step's 5 x 64 ints: 25 us against 68 for
    building a tensor, pinning it and copying). The buffer is a ring of two halves: a copy that would
    write into the other half first waits for the copies last queued from it (an event recorded when the
    ring left it; long done in practice: a serving step reads its results every few kilobytes). Copies
    that do not fit in a half, or made while a CUDA graph is being captured (a replay would read the
    buffer again later), take the caching allocator's own pinned blocks. One engine thread uses it."""

    _by_device: dict[int, "PinnedStaging"] = {}
    HALF_BYTES = 1 << 19

    @classmethod
    def of(cls, device: torch.device) -> "PinnedStaging":
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in cls._by_device:
            cls._by_device[index] = cls()
        return cls._by_device[index]

    def __init__(self):
        self.buffer = torch.empty(2 * self.HALF_BYTES, dtype=torch.uint8).pin_memory()
        self.bytes = self.buffer.numpy()
        self.half, self.offset = 0, 0  # the half being filled, the next free byte
        self.left: list[torch.cuda.Event | None] = [None, None]  # per half: recorded when the ring left it

    def copy(self, array: np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.stage(array, dtype).to(device, non_blocking=True)

    def stage(self, array: np.ndarray, dtype: torch.dtype | None = None) -> torch.Tensor:
        """`array` in pinned host memory, as a tensor of `dtype` (default: the array's), for one
        asynchronous copy to the device queued before anything else writes the ring."""
        dtype = dtype or torch.from_numpy(array[:0]).dtype
        n = array.nbytes
        if n > self.HALF_BYTES or n == 0 or torch.cuda.is_current_stream_capturing():
            return torch.from_numpy(array).pin_memory().view(dtype)
        start = -(-self.offset // 16) * 16  # aligned for any element type
        if start + n > (self.half + 1) * self.HALF_BYTES:  # on into the other half
            event = torch.cuda.Event()
            event.record()
            self.left[self.half] = event
            self.half = 1 - self.half
            if self.left[self.half] is not None:
                self.left[self.half].synchronize()
            start = self.half * self.HALF_BYTES
        self.bytes[start:start + n] = array.reshape(-1).view(np.uint8)
        self.offset = start + n
        return self.buffer[start:start + n].view(dtype).view(array.shape)


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

    A fixed-shape batch (`padded`, what a prefill CUDA graph captures) has no host mirrors and no
    packing: every lane runs all T rows, and state_slots [L] names the slot whose GDN state each lane
    reads and writes - its own, or for a padding lane the pool's state sink (SlotPool.state_sink);
    starts_sequences says that every lane starts at position 0 (what the host mirrors would tell: the
    attention then runs over the chunk's own rows, the GDN layers from the zero state).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_ids: torch.Tensor
    n_rows: torch.Tensor
    slot_ids_host: tuple[int, ...] = ()
    n_rows_host: tuple[int, ...] = ()
    start_host: tuple[int, ...] = ()
    live_lanes: torch.Tensor | None = None
    packed_rows: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    cu_seqlens_host: torch.Tensor | None = None
    state_slots: torch.Tensor | None = None
    starts_sequences: bool = False

    @classmethod
    def padded(cls, input_ids: torch.Tensor, slot_ids: torch.Tensor, start: torch.Tensor, n_rows: torch.Tensor,
               state_slots: torch.Tensor, starts_sequences: bool = False) -> "ExtendBatch":
        """A fixed-shape batch from device tensors: input_ids [L, T], slot_ids / start / n_rows /
        state_slots [L] (`starts_sequences`: the caller knows every start is 0). No host data, no host sync."""
        positions = start[:, None] + torch.arange(input_ids.shape[1], device=input_ids.device)
        return cls(input_ids, positions, slot_ids, n_rows, state_slots=state_slots, starts_sequences=starts_sequences)

    @property
    def fixed_shape(self) -> bool:
        """Built by `padded`: a shape a CUDA graph captures once and replays (no host mirrors)."""
        return not self.start_host

    @property
    def live_lanes_host(self) -> list[int]:
        return [i for i, s in enumerate(self.slot_ids_host) if s >= 0]

    @property
    def full_host(self) -> bool:
        """By the host mirrors: every lane has a slot and all T rows (packing the rows is then a view)."""
        T = self.input_ids.shape[1]
        return bool(self.slot_ids_host) and all(s >= 0 for s in self.slot_ids_host) \
            and all(n == T for n in self.n_rows_host)

    @property
    def num_lanes(self) -> int:
        return self.input_ids.shape[0]

    @functools.cached_property
    def rows_valid(self) -> torch.Tensor:
        """[L, T] bool: each lane's first n_rows rows. Made once per batch: the K/V row map and every GDN
        layer of a fixed-shape batch read it (a launch or two per layer otherwise)."""
        T = self.input_ids.shape[1]
        return torch.arange(T, device=self.input_ids.device)[None] < self.n_rows[:, None]

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
        packed = [i * T + t for i in live for t in range(n_rows[i])]
        parts = (ids.flatten(), pos.flatten(), torch.tensor(slots), torch.tensor(n_rows), torch.tensor(live, dtype=torch.long),
                 torch.tensor(packed, dtype=torch.long), cu)
        # one host -> device transfer for every table of the batch
        ids_d, pos_d, slots_d, n_rows_d, live_d, packed_d, cu_d = to_device(torch.cat(parts), device).split(
            [p.numel() for p in parts])
        return cls(
            input_ids=ids_d.view(L, T),
            positions=pos_d.view(L, T),
            slot_ids=slots_d,
            n_rows=n_rows_d,
            slot_ids_host=tuple(slots),
            n_rows_host=tuple(n_rows),
            start_host=tuple(starts),
            live_lanes=live_d,
            packed_rows=packed_d,
            cu_seqlens=cu_d,
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

    @classmethod
    def chain(cls, input_ids: torch.Tensor, slot_ids: torch.Tensor | Sequence[int], start: torch.Tensor | Sequence[int],
              slot_ids_host: Sequence[int] = (), start_host: Sequence[int] = ()) -> "VerifyBatch":
        """Every lane a chain (parents n - 1): input_ids [L, W] on the device (row 0 the anchor), lane l's
        rows at positions start[l] + 0..W-1 of slot slot_ids[l] (-1: a padding lane). slot_ids / start:
        [L] on the device (with their host mirrors, if the caller has them; none inside a CUDA graph), or
        host sequences, copied over and kept as the mirrors."""
        L, W = input_ids.shape
        device = input_ids.device
        if not isinstance(slot_ids, torch.Tensor):
            slot_ids_host, slot_ids = tuple(slot_ids), to_device(slot_ids, device)
        if not isinstance(start, torch.Tensor):
            start_host, start = tuple(start), to_device(start, device)
        nodes = torch.arange(W, device=device)
        return cls(input_ids=input_ids, parents=(nodes - 1).expand(L, W).contiguous(),
                   positions=start[:, None] + nodes, slot_ids=slot_ids, start=start,
                   slot_ids_host=tuple(slot_ids_host), start_host=tuple(start_host), chain_host=True)


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
    order; a chain is arange); accepted_len [L] long in 0..W (rows committed, the anchor included).
    `*_host` mirror them on the host (read at the round's one sync), so the commit validates every
    lane without asking the device. chain_host: every accepted path is 0, 1, 2, ... (no K/V rows move);
    otherwise accepted_nodes_host gives each lane's path and parents_host the verified trees.
    """

    slot_ids: torch.Tensor
    accepted_nodes: torch.Tensor
    accepted_len: torch.Tensor
    slot_ids_host: tuple[int, ...]
    accepted_len_host: tuple[int, ...]
    start_host: tuple[int, ...]
    chain_host: bool = False
    accepted_nodes_host: tuple[tuple[int, ...], ...] | None = None
    parents_host: tuple[tuple[int, ...], ...] | None = None

    @classmethod
    def chain(cls, slot_ids: torch.Tensor, accepted_len: torch.Tensor, width: int, *, slot_ids_host: Sequence[int],
              accepted_len_host: Sequence[int], start_host: Sequence[int]) -> "CommitPlan":
        """Chains: lane l commits its first accepted_len[l] rows (device [L]; its host mirror beside it)."""
        L, device = slot_ids.shape[0], slot_ids.device
        # node n of every lane is row n: one row of node ids seen by all lanes (stride 0, no copy)
        return cls(slot_ids=slot_ids, accepted_nodes=torch.arange(width, device=device).expand(L, width),
                   accepted_len=accepted_len, slot_ids_host=tuple(slot_ids_host),
                   accepted_len_host=tuple(accepted_len_host), start_host=tuple(start_host), chain_host=True)

    @classmethod
    def tree(cls, slot_ids: torch.Tensor, path: torch.Tensor, accepted_len: torch.Tensor, width: int, *,
             slot_ids_host: Sequence[int] = (), accepted_len_host: Sequence[int] = (), start_host: Sequence[int] = (),
             accepted_nodes_host: tuple[tuple[int, ...], ...] | None = None,
             parents_host: tuple[tuple[int, ...], ...] | None = None) -> "CommitPlan":
        """Trees: lane l commits the first accepted_len[l] nodes of path[l] (device [L, <= width], node ids in
        token order, the root first; padded to width columns). Host mirrors as far as the caller has them."""
        return cls(slot_ids=slot_ids, accepted_nodes=F.pad(path, (0, width - path.shape[1])),
                   accepted_len=accepted_len, slot_ids_host=tuple(slot_ids_host),
                   accepted_len_host=tuple(accepted_len_host), start_host=tuple(start_host),
                   accepted_nodes_host=accepted_nodes_host, parents_host=parents_host)


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """parents [L, W] -> [L, W, W] bool, [l, n, m] = m is n or an ancestor of n. Reachability by
    squaring: after i squarings, paths of up to 2^i parent steps are in (log2 W small launches)."""
    L, W = parents.shape
    nodes = torch.arange(W, device=parents.device)
    reach = (parents[..., None] == nodes) | (nodes[:, None] == nodes)  # [l, n, m]: m is n or n's parent
    reach = reach.float()
    for _ in range(max(W - 1, 1).bit_length()):
        reach = torch.bmm(reach, reach).clamp_(max=1.0)  # counts of 0/1 paths: exact in fp32
    return reach > 0
