"""Sequences with one prompt: one prefills it, the others fork from it.

A request whose prompt equals that of a sequence still before the end of its prefill (the n samples of one
prompt; clients sending the same prompt) *follows* that sequence, its *leader*, instead of prefilling the
prompt again (requests behind it in the queue are not held up meanwhile). In the step whose prefill completes
the leader's prompt, the scheduler forks the followers at the head of the queue, past requests waiting for
another prefill too (Scheduler._forks): each takes a slot of its own, which the runner fills with the
leader's fixed-size state (conv history, recurrent state), the leader's whole prompt pages held with it
(PageAllocator.share: a sequence writes only at or past its committed length) and a copy of the partial
last page; its first token is sampled, with its own parameters and noise, from the logits of the leader's
last prompt row - the logits its own prefill would have ended with. A follower that cannot fork then (no
free slot or pages, or a request ahead of it waiting for pages) goes on alone and prefills its prompt itself;
the first of the leader's followers left leads the others.

Only a prompt's own samples share it: a follower asking for prompt logprobs follows a leader asking for
the same number (its own are a copy of the leader's). Different prompts with a common beginning share it
through the prefix cache (engine/prefix_cache.py: branch points), once one of them has finished its prefill.
"""

from __future__ import annotations

from deltaflash.core.request import Sequence, Status


def can_lead(seq: Sequence) -> bool:
    """Whether `seq` is still before the end of its prompt's prefill, and will get there."""
    return seq.status in (Status.WAITING, Status.PREFILLING) and not seq.output_ids and not seq.cancel_requested


class PromptShares:
    """Who follows whom (host only; the scheduler owns it)."""

    def __init__(self):
        self._leaders: dict[bytes, Sequence] = {}       # a prompt's bytes -> the sequence others follow
        self._leader_of: dict[str, Sequence] = {}       # follower's request id -> its leader
        self._followers: dict[str, list[Sequence]] = {}  # leader's request id -> its followers, oldest first

    def __len__(self) -> int:
        """Sequences following another."""
        return len(self._leader_of)

    def add(self, seq: Sequence) -> None:
        """A new request (`seq` waits in the queue): it follows the sequence leading its prompt if it can,
        else leads the prompt itself."""
        key = seq.prompt_array.tobytes()
        leader = self._leaders.get(key)
        if leader is not None and can_lead(leader):
            if seq.params.prompt_logprobs in (None, leader.params.prompt_logprobs):
                self._leader_of[seq.request_id] = leader
                self._followers[leader.request_id].append(seq)
            return
        self._lead(key, seq, [])

    def leader(self, seq: Sequence) -> Sequence | None:
        return self._leader_of.get(seq.request_id)

    def forget(self, seq: Sequence) -> None:
        """`seq` takes no further part: forked, retired, or - a leader - past the end of its prompt. A
        leader's followers left go on alone, the first of them leading the others (unless a newer sequence
        leads the prompt now: it waits behind them, and a follower never waits ahead of its leader)."""
        leader = self._leader_of.pop(seq.request_id, None)
        if leader is not None:
            self._followers[leader.request_id].remove(seq)
            return
        followers = self._followers.pop(seq.request_id, None)
        if followers is None:
            return
        key = seq.prompt_array.tobytes()
        for follower in followers:
            del self._leader_of[follower.request_id]
        if self._leaders.get(key) is seq:
            del self._leaders[key]
            if followers:
                self._lead(key, followers[0], followers[1:])

    def _lead(self, key: bytes, seq: Sequence, followers: list[Sequence]) -> None:
        self._leaders[key] = seq
        self._followers[seq.request_id] = followers
        for follower in followers:
            self._leader_of[follower.request_id] = seq
