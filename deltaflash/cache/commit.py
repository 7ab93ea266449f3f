"""The commit transaction: advance each lane's persistent state by its accepted verify rows.

Everything is validated on the host before the first write (lanes, slots, committed lengths, accepted
counts, accepted node paths, the shapes of the verify outputs); a bad plan raises CommitRejectedError
and leaves the pool unchanged. The plan's host mirrors were read at the round's one sync, so
validation asks nothing of the device.
"""

from __future__ import annotations

from deltaflash.cache.slots import SlotPool
from deltaflash.core.batch import CommitPlan, VerifyOutput, to_device
from deltaflash.errors import CommitRejectedError
from deltaflash.ops.kernels import Kernels


def validate_plan(pool: SlotPool, plan: CommitPlan, out: VerifyOutput) -> None:
    """Raise CommitRejectedError unless every lane of `plan` can be committed from `out` into `pool`."""
    L = len(plan.slot_ids_host)
    G, L_out, W = out.replay_log.shape[:3]
    _, G_pool, nv, dk, dv = pool.recurrent_state.shape
    expect = {
        "replay_log": (tuple(out.replay_log.shape), (G_pool, L, W, nv, 1 + dk + dv)),
        "conv_windows": (tuple(out.conv_windows.shape),
                         (G_pool, L, pool.conv_history.shape[2], pool.conv_history.shape[3] + W)),
        "accepted_nodes": (tuple(plan.accepted_nodes.shape), (L, W)),
        "accepted_len": (tuple(plan.accepted_len.shape), (L,)),
        "slot_ids": (tuple(plan.slot_ids.shape), (L,)),
    }
    for name, (got, want) in expect.items():
        if got != want:
            raise CommitRejectedError(f"{name} is {list(got)}, expected {list(want)} for {L} lanes of width {W}")
    _check_lanes(pool, plan, W)


def _check_lanes(pool: SlotPool, plan: CommitPlan, width: int) -> None:
    """validate_plan's checks of the plan's lanes (its host mirrors) against the pool, for verify rows of
    `width` per lane."""
    L = len(plan.slot_ids_host)
    if len(plan.accepted_len_host) != L or len(plan.start_host) != L:
        raise CommitRejectedError(f"plan: {L} slot ids, {len(plan.accepted_len_host)} accepted lengths, "
                                  f"{len(plan.start_host)} starts")
    if plan.chain_host:
        check_chains(pool, plan.slot_ids_host, plan.accepted_len_host, plan.start_host, width)
        return
    if plan.accepted_nodes_host is None or plan.parents_host is None:
        raise CommitRejectedError("plan: a tree commit needs accepted_nodes_host and parents_host")
    _walk_lanes(pool, plan.slot_ids_host, plan.accepted_len_host, plan.start_host, width,
                plan.accepted_nodes_host, plan.parents_host)


def check_chains(pool: SlotPool, slots, counts, starts, width: int) -> None:
    """The lane checks of a chain commit from host values alone (lane i: slot, rows committed, first
    position): what the runner's width-1 round runs before its verify, whose graph also commits. All
    lanes at once in a few passes; only a failing plan is walked lane by lane, to name the bad lane."""
    lanes = [(slot, n, start) for slot, n, start in zip(slots, counts, starts) if slot != -1]
    if lanes:
        s, c, p = zip(*lanes)
        lengths = pool.lengths
        if (0 <= min(s) and max(s) < pool.num_slots and len(set(s)) == len(s) and 0 <= min(c)
                and max(c) <= width and all(lengths[slot] == start for slot, start in zip(s, p))
                and max(start + n for start, n in zip(p, c)) <= pool.max_len):
            return
        _walk_lanes(pool, slots, counts, starts, width)


def _walk_lanes(pool: SlotPool, slots, counts, starts, width: int, paths=None, parents=None) -> None:
    """Raise CommitRejectedError at the first lane that cannot commit (paths / parents: tree lanes)."""
    seen = set()
    for lane, (slot, n, start) in enumerate(zip(slots, counts, starts)):
        if slot == -1:
            continue
        if not 0 <= slot < pool.num_slots:
            raise CommitRejectedError(f"lane {lane}: slot {slot} out of range 0..{pool.num_slots - 1}")
        if slot in seen:
            raise CommitRejectedError(f"duplicate slot ids in commit: {list(slots)}")
        seen.add(slot)
        if not 0 <= n <= width:
            raise CommitRejectedError(f"lane {lane}: accepted_len {n} outside 0..{width}")
        if start != pool.lengths[slot]:
            raise CommitRejectedError(f"lane {lane}: rows verified from position {start}, but slot {slot} "
                                      f"holds {pool.lengths[slot]} committed positions")
        if start + n > pool.max_len:
            raise CommitRejectedError(f"lane {lane}: commit past max_len {pool.max_len} ({start} + {n})")
        if paths is not None:
            _check_path(lane, paths[lane][:n], parents[lane], width)


def _check_path(lane: int, path, parents, width: int) -> None:
    """path: node ids in token order, a root path of the tree `parents` (parents[0] = -1)."""
    previous = -1
    for node in path:
        if not 0 <= node < width or parents[node] != previous:
            raise CommitRejectedError(f"lane {lane}: accepted nodes {list(path)} are not a root path of the "
                                      f"verified tree (parents {list(parents)})")
        previous = node


def commit(pool: SlotPool, plan: CommitPlan, out: VerifyOutput, kernels: Kernels) -> None:
    """Replay the accepted rows into the recurrent state, rebuild conv history from the windows,
    move accepted tree rows' K/V to their positions and set the committed lengths."""
    validate_plan(pool, plan, out)
    kernels.commit_state(pool.recurrent_state, out.replay_log, pool.conv_history, out.conv_windows, plan)
    _compact_tree_rows(pool, plan)
    record_lengths(pool, plan.slot_ids_host, plan.start_host, plan.accepted_len_host)


def commit_unread_chains(pool: SlotPool, out: VerifyOutput, kernels: Kernels, slot_ids, rows, slots_host, starts_host,
                         most_host, width: int) -> None:
    """A chain round's commit launched before the host has read how many rows each lane accepted: lane l
    commits its first rows[l] (device [L], 1..most_host[l], as acceptance bounds it) verify rows from
    starts_host[l]. Validated first, as `commit` validates, with each lane's most rows standing for its
    count (slots, committed lengths, room in the slot; the verify outputs' shapes); the caller records the
    lengths (record_lengths) once the round's one read gives the counts. Chains move no K/V row."""
    plan = CommitPlan.chain(slot_ids, rows, width, slot_ids_host=slots_host, accepted_len_host=most_host,
                            start_host=starts_host)
    validate_plan(pool, plan, out)
    kernels.commit_state(pool.recurrent_state, out.replay_log, pool.conv_history, out.conv_windows, plan)


def record_lengths(pool: SlotPool, slots, starts, counts) -> None:
    """The committed lengths after a commit (host bookkeeping, its last step): slot i holds starts[i] +
    counts[i] positions."""
    lengths = pool.lengths
    for slot, start, n in zip(slots, starts, counts):
        if slot >= 0:
            lengths[slot] = start + n


def _compact_tree_rows(pool: SlotPool, plan: CommitPlan) -> None:
    """Verify stored row n at start + n; the accepted path's t-th node belongs at start + t.
    A chain's path is 0, 1, 2, ... so nothing moves. Sources are read before any row is written."""
    if plan.chain_host:
        return
    moves = [(slot, start + node, start + t)
             for slot, start, n, path in zip(plan.slot_ids_host, plan.start_host, plan.accepted_len_host,
                                             plan.accepted_nodes_host)
             if slot >= 0 for t, node in enumerate(path[:n]) if node != t]
    if not moves:
        return
    device = pool.key_cache.device
    slot, src, dst = (to_device(column, device) for column in zip(*moves))
    src_rows = pool.tables.rows(slot, src[:, None])[:, 0]
    dst_rows = pool.tables.rows(slot, dst[:, None])[:, 0]
    for cache in (pool.key_cache, pool.value_cache):
        rows = cache.flatten(1, 2)  # [A, (P+1) * page_size, nkv, hd], a view
        rows[:, dst_rows] = rows[:, src_rows].clone()
