"""The commit transaction: advance each lane's persistent state by its accepted verify rows.

Everything is validated on the host before the first write (lanes, slots, committed lengths, accepted
counts, accepted node paths, the shapes of the verify outputs); a bad plan raises CommitRejectedError
and leaves the pool unchanged. The plan's host mirrors were read at the round's one sync, so
validation asks nothing of the device. The fused kernels commit a round before that read
(`commit_unread_chains`, `commit_unread_tree`): each lane's most rows stand for its count in the
checks, and the accepted counts and paths are acceptance's own, bounded and rooted by construction.
"""

from __future__ import annotations

from torch import Tensor

from deltaflash.cache.slots import SlotPool
from deltaflash.core.batch import CommitPlan, VerifyOutput, to_device
from deltaflash.errors import CommitRejectedError
from deltaflash.ops.kernels import Kernels


def validate_plan(pool: SlotPool, plan: CommitPlan, out: VerifyOutput) -> None:
    """Raise CommitRejectedError unless every lane of `plan` can be committed from `out` into `pool`."""
    _check_shapes(pool, plan, out)
    _check_lanes(pool, plan, out.replay_log.shape[2])


def _check_shapes(pool: SlotPool, plan: CommitPlan, out: VerifyOutput) -> None:
    """validate_plan's checks of the verify outputs' and the plan's device tensors' shapes."""
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
    if plan.chain_host:
        kernels.commit_state(pool.recurrent_state, out.replay_log, pool.conv_history, out.conv_windows, plan)
    else:
        apply_tree_plan(pool, plan, out, kernels, to_device(plan.start_host, pool.key_cache.device))
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


def commit_unread_tree(pool: SlotPool, out: VerifyOutput, kernels: Kernels, slot_ids, start, path, rows, slots_host,
                       starts_host, most_host, width: int) -> None:
    """A tree round's commit launched before the host has read which nodes each lane accepted (the fused
    kernels: the commit reads its plan on the device): lane l commits the first rows[l] (device [L],
    1..most_host[l]) nodes of path[l] (device [L, <= width], node ids in token order, the root first - a
    root path of the verified tree, as acceptance builds it) from start[l] (device; starts_host[l] on the
    host). Validated first with each lane's most rows standing for its count (slots, committed lengths,
    room in the slot; the outputs' shapes); the caller records the lengths once the read gives the counts."""
    plan = CommitPlan.tree(slot_ids, path, rows, width, slot_ids_host=slots_host, accepted_len_host=most_host,
                           start_host=starts_host)
    _check_shapes(pool, plan, out)
    check_chains(pool, slots_host, most_host, starts_host, width)
    apply_tree_plan(pool, plan, out, kernels, start)


def apply_tree_plan(pool: SlotPool, plan: CommitPlan, out: VerifyOutput, kernels: Kernels, start: Tensor) -> None:
    """The writes of a validated tree commit: replay and conv history along each lane's accepted path,
    then its nodes' K/V moved to their positions (start [L] device: the lanes' first verified position).
    Device work only (what a greedy tree round's graph captures; the fused commit reads the device plan)."""
    kernels.commit_state(pool.recurrent_state, out.replay_log, pool.conv_history, out.conv_windows, plan)
    kernels.move_tree_rows(pool.key_cache, pool.value_cache, pool.tables.tables, plan.slot_ids, start,
                           plan.accepted_nodes, plan.accepted_len)


def record_lengths(pool: SlotPool, slots, starts, counts) -> None:
    """The committed lengths after a commit (host bookkeeping, its last step): slot i holds starts[i] +
    counts[i] positions."""
    lengths = pool.lengths
    for slot, start, n in zip(slots, starts, counts):
        if slot >= 0:
            lengths[slot] = start + n
