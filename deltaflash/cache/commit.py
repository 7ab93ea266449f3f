"""The commit transaction: advance each lane's persistent state by its accepted verify rows.

Validation of every lane happens before any mutation; a bad plan raises CommitRejectedError and
leaves the pool unchanged.
"""

from __future__ import annotations

import torch

from deltaflash.cache.slots import SlotPool
from deltaflash.engine.batch import CommitPlan, VerifyOutput
from deltaflash.errors import CommitRejectedError


def validate_plan(pool: SlotPool, plan: CommitPlan, width: int) -> None:
    live = [s for s in plan.slot_ids_host if s >= 0]
    if len(set(live)) != len(live):
        raise CommitRejectedError(f"duplicate slot ids in commit: {list(plan.slot_ids_host)}")
    for lane, (slot, n) in enumerate(zip(plan.slot_ids_host, plan.accepted_len_host)):
        if slot >= pool.num_slots or slot < -1:
            raise CommitRejectedError(f"lane {lane}: slot {slot} out of range 0..{pool.num_slots - 1}")
        if not 0 <= n <= width:
            raise CommitRejectedError(f"lane {lane}: accepted_len {n} outside 0..{width}")
        if slot >= 0 and plan.start_host[lane] + n > pool.max_len:
            raise CommitRejectedError(f"lane {lane}: commit past max_len {pool.max_len}")


def commit(pool: SlotPool, plan: CommitPlan, out: VerifyOutput, verify_ops) -> None:
    """Replay the accepted prefix into the recurrent state, rebuild conv history from the windows,
    move accepted tree rows' K/V to their positions and set the committed lengths."""
    width = out.replay_log.shape[2]
    validate_plan(pool, plan, width)
    verify_ops.replay_commit(pool.recurrent_state, out.replay_log, plan.slot_ids, plan.accepted_nodes, plan.accepted_len)
    verify_ops.conv_commit(pool.conv_history, out.conv_windows, plan.slot_ids, plan.accepted_nodes, plan.accepted_len)
    _compact_tree_rows(pool, plan)
    for slot, start, n in zip(plan.slot_ids_host, plan.start_host, plan.accepted_len_host):
        if slot >= 0:
            pool.lengths[slot] = start + n


def _compact_tree_rows(pool: SlotPool, plan: CommitPlan) -> None:
    """Verify stored row n at start + n; the accepted path's t-th node belongs at start + t.
    A chain's path is 0, 1, 2, ... so nothing moves."""
    if plan.chain_host:
        return
    W = plan.accepted_nodes.shape[1]
    chain = torch.arange(W, device=plan.accepted_nodes.device)
    steps = torch.arange(W, device=plan.accepted_nodes.device)[None] < plan.accepted_len[:, None]
    moved = (plan.accepted_nodes != chain) & steps & (plan.slot_ids[:, None] >= 0)
    if not bool(moved.any()):
        return
    lane, t = moved.nonzero(as_tuple=True)
    start = torch.tensor(plan.start_host, device=lane.device)[lane]
    slot, src, dst = plan.slot_ids[lane], start + plan.accepted_nodes[lane, t], start + t
    for cache in (pool.key_cache, pool.value_cache):
        cache[slot, :, dst] = cache[slot, :, src].clone()
