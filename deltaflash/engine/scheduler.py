"""The scheduler decides; it never touches the device.

Each step it retires cancelled requests, admits waiting ones into free slots (first come, first
served), spends the prefill budget on prompt chunks (oldest prompt first), and gives every decoding
sequence one lane of the round with a width: the rows it verifies, 1 + its drafts (1 = plain
decoding). The runner executes the resulting `StepPlan`; the engine applies the results.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from deltaflash.cache.slots import SlotTable
from deltaflash.core.request import Sequence, Status
from deltaflash.engine.config import EngineConfig


@dataclass(frozen=True)
class PrefillChunk:
    """Prompt tokens [start, start + len(tokens)) of `seq`; `last`: the chunk completes the prompt."""

    seq: Sequence
    start: int
    tokens: tuple[int, ...]
    last: bool


@dataclass(frozen=True)
class StepPlan:
    """What one step runs.

    admitted: sequences given a slot this step (the runner resets those slots first).
    cancelled: sequences retired before the step (their slots are free again).
    prefill: prompt chunks, in order. decode: the round's lanes; widths[i]: rows lane i verifies
    (1 + drafts it may accept); round_width: rows per lane of the verify forward (max of widths,
    rounded up to a width that has a CUDA graph: 1 or the block size W).
    """

    admitted: tuple[Sequence, ...] = ()
    cancelled: tuple[Sequence, ...] = ()
    prefill: tuple[PrefillChunk, ...] = ()
    decode: tuple[Sequence, ...] = ()
    widths: tuple[int, ...] = ()
    round_width: int = 1

    @property
    def runs_anything(self) -> bool:
        return bool(self.admitted or self.prefill or self.decode)


class Scheduler:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.slots = SlotTable(config.max_slots)
        self.waiting: deque[Sequence] = deque()
        self.running: dict[str, Sequence] = {}  # admission order

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def abort(self, request_id: str) -> None:
        """Cancel a request; it is retired at the next step boundary."""
        for seq in self.waiting:
            if seq.request_id == request_id:
                seq.cancel_requested = True
        if request_id in self.running:
            self.running[request_id].cancel_requested = True

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Retire a sequence: its slot is free for the next admission."""
        seq.finish_reason, seq.status = reason, Status.FINISHED
        if seq.slot >= 0:
            self.slots.give_back(seq.slot)
            seq.slot = -1
        self.running.pop(seq.request_id, None)

    def schedule(self) -> StepPlan:
        cancelled = self._retire_cancelled()
        admitted = []
        while self.waiting and self.slots.num_free:
            seq = self.waiting.popleft()
            seq.slot, seq.status = self.slots.take(), Status.PREFILLING
            self.running[seq.request_id] = seq
            admitted.append(seq)
        decode = [s for s in self.running.values() if s.status is Status.DECODING]
        widths = [self.width(s) for s in decode]
        return StepPlan(admitted=tuple(admitted), cancelled=tuple(cancelled), prefill=tuple(self._prefill_chunks()),
                        decode=tuple(decode), widths=tuple(widths),
                        round_width=self.config.block_size if any(w > 1 for w in widths) else 1)

    def width(self, seq: Sequence) -> int:
        """Rows the sequence verifies this round: the block, or fewer when fewer tokens are left."""
        return max(1, min(self.config.block_size, seq.remaining))

    def _prefill_chunks(self) -> list[PrefillChunk]:
        budget, chunks = self.config.prefill_chunk, []
        for seq in self.running.values():
            if seq.status is not Status.PREFILLING or seq.prompt_left <= 0 or budget <= 0:
                continue
            n = min(seq.prompt_left, budget)
            start = seq.num_prefilled
            chunks.append(PrefillChunk(seq, start, tuple(seq.prompt_ids[start:start + n]), n == seq.prompt_left))
            budget -= n
        return chunks

    def _retire_cancelled(self) -> list[Sequence]:
        gone = [s for s in self.waiting if s.cancel_requested]
        for seq in gone:
            self.waiting.remove(seq)
            seq.finish_reason, seq.status = "cancelled", Status.FINISHED
        for seq in [s for s in self.running.values() if s.cancel_requested]:
            self.finish(seq, "cancelled")
            gone.append(seq)
        return gone
