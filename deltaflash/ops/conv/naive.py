"""Pure-torch references for the verify route's depthwise causal conv: tree step and commit.

Shapes: L lanes, W rows per lane (a tree given by `parents`), C channels, K taps, S slots, G GDN
layers. A lane's window [C, K-1+W] is [history (K-1 raw inputs) | rows by node index]; column K-1+n
holds node n. Math in README.md; tree_step.py and ../gdn/commit.py are the kernels that match these.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deltaflash.core.batch import to_device
from deltaflash.errors import CommitRejectedError
from deltaflash.ops.gdn.naive import check_commit_lanes, gather_slots_ref


def tap_columns_ref(parents, K: int):
    """parents [L, W] -> window columns [L, W, K] long: tap j of node n reads column cols[l, n, j].
    Tap K-1 is the node itself; each earlier tap steps to the parent, past a root (parent -1) into the
    history (column K-2, then K-3, ...)."""
    L, W = parents.shape
    par = parents.long()
    cols = torch.empty(L, W, K, dtype=torch.long, device=parents.device)
    cur = (torch.arange(W, device=parents.device) + (K - 1)).expand(L, W)
    cols[..., K - 1] = cur
    for j in range(K - 2, -1, -1):
        p = par.gather(1, (cur - (K - 1)).clamp(min=0))
        step = torch.where(p >= 0, p + (K - 1), torch.full_like(p, K - 2))
        cur = torch.where(cur >= K - 1, step, cur - 1)
        cols[..., j] = cur
    return cols


def conv_tree_step_ref(rows, conv_history, state_slot_ids, parents, weight):
    """rows [L, W, C] this round's projected qkv rows (activation dtype); conv_history [S, C, K-1]
    one layer's view of the pool (read only; slot -1: zeros); parents [L, W]; weight [C, K] depthwise.

    out[l, n, c] = silu(sum_j weight[c, j] * x_j) with x_j the input K-1-j steps up node n's path,
    accumulated in fp32 in tap order j = 0..K-1 starting from 0, cast to rows' dtype.
    Returns (out [L, W, C], window [L, C, K-1+W]) in rows' dtype.
    """
    check_tree_step_shapes(rows, conv_history, state_slot_ids, parents, weight)
    L, W, C = rows.shape
    K = weight.shape[1]
    history = gather_slots_ref(conv_history, state_slot_ids).to(rows.dtype)  # [L, C, K-1]
    window = torch.cat([history, rows.transpose(1, 2)], dim=2)  # [L, C, K-1+W]
    cols = tap_columns_ref(parents, K).view(L, 1, W * K).expand(L, C, W * K)
    x = window.gather(2, cols).view(L, C, W, K).float()
    w = weight.float()
    acc = torch.zeros(L, C, W, dtype=torch.float32, device=rows.device)
    for j in range(K):
        acc = acc + w[:, j, None] * x[..., j]
    out = F.silu(acc).to(rows.dtype).transpose(1, 2).contiguous()
    return out, window


def check_device(rows: torch.Tensor, **others: torch.Tensor) -> None:
    """Every tensor named in `others` is on rows' device (a typed message naming the first that is not)."""
    for name, t in others.items():
        if t.device != rows.device:
            raise ValueError(f"{name} is on {t.device}, rows on {rows.device}")


def check_rows_and_weight(rows, weight, rows_name: str = "W") -> tuple[int, int, int, int]:
    """rows [L, W or T, C] and a depthwise weight [C, K >= 2]; returns (L, rows per lane, C, K)."""
    if rows.dim() != 3:
        raise ValueError(f"rows must be [L, {rows_name}, C]; got {tuple(rows.shape)}")
    L, W, C = rows.shape
    if weight.dim() != 2 or weight.shape[0] != C or weight.shape[1] < 2:
        raise ValueError(f"weight must be [C={C}, K>=2]; got {tuple(weight.shape)}")
    return L, W, C, weight.shape[1]


def check_tree_step_shapes(rows, conv_history, state_slot_ids, parents, weight):
    L, W, C, K = check_rows_and_weight(rows, weight)
    if conv_history.dim() != 3 or tuple(conv_history.shape[1:]) != (C, K - 1):
        raise ValueError(f"conv_history must be [S, C={C}, K-1={K - 1}]; got {tuple(conv_history.shape)}")
    if tuple(state_slot_ids.shape) != (L,):
        raise ValueError(f"state_slot_ids must be [L={L}]; got {tuple(state_slot_ids.shape)}")
    if tuple(parents.shape) != (L, W):
        raise ValueError(f"parents must be [L={L}, W={W}]; got {tuple(parents.shape)}")


def check_conv_commit_shapes(conv_history, windows, state_slot_ids):
    """conv_history [S, G, C, K-1]; windows [G, L, C, K-1+W]. Returns W."""
    if conv_history.dim() != 4:
        raise CommitRejectedError(f"conv commit: conv_history must be [S, G, C, K-1]; got {tuple(conv_history.shape)}")
    _, G, C, Km1 = conv_history.shape
    L = state_slot_ids.shape[0] if state_slot_ids.dim() == 1 else -1
    if windows.dim() != 4 or tuple(windows.shape[:3]) != (G, L, C) or windows.shape[3] < Km1:
        raise CommitRejectedError(
            f"conv commit: windows must be [G={G}, L={L}, C={C}, K-1+W] with K-1={Km1}; got {tuple(windows.shape)}")
    if windows.device != conv_history.device:
        raise CommitRejectedError(f"conv commit: windows on {windows.device}, conv_history on {conv_history.device}")
    return windows.shape[3] - Km1


def commit_columns(n_acc: int, path, Km1: int):
    """Window columns of the last K-1 raw inputs of (history, accepted path rows)."""
    seq = list(range(Km1)) + [Km1 + node for node in path[:n_acc]]
    return seq[len(seq) - Km1:]


def conv_commit_ref(conv_history, windows, state_slot_ids, accepted_nodes, accepted_len):
    """In place: each lane's conv history := the last K-1 raw inputs of (history, accepted path rows),
    read from the window; all GDN layers at once. conv_history: the whole pool [S, G, C, K-1];
    windows [G, L, C, K-1+W]; accepted_nodes [L, W]; accepted_len [L] in 0..W.
    Validates first (CommitRejectedError, nothing changed)."""
    W = check_conv_commit_shapes(conv_history, windows, state_slot_ids)
    lanes = check_commit_lanes(state_slot_ids, accepted_nodes, accepted_len, conv_history.shape[0], W, "conv commit")
    conv_lanes_ref(conv_history, windows, lanes)


def conv_lanes_ref(conv_history, windows, lanes):
    """conv_commit_ref's update for a validated transaction: lanes [(lane, slot, accepted_len, path)]
    host values (no host sync)."""
    Km1 = conv_history.shape[3]
    for lane, slot, n_acc, path in lanes:
        cols = to_device(commit_columns(n_acc, path, Km1), windows.device)
        conv_history[slot] = windows[:, lane].index_select(2, cols).to(conv_history.dtype)
