"""The torch references of the draft-tree kernels (ops/tree/build.py, greedy_walk.py, topk.py; the ancestor
mask's, ancestors.py's, is core.batch.ancestor_mask): tensors in, tensors out.

speculative/tree.py builds its DraftTree from build_tree_nodes and accepts greedy lanes with greedy_walk (the
kernel sets' reference entries); the math of trees and their acceptance: its docstring and DESIGN.md §4.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from deltaflash.core.batch import ancestor_mask

EPS = 1e-6  # path score lost per depth: a child never ties its parent

# child_scores(d, parent_tokens [L, P]) -> (log-probabilities [L, P, k], tokens [L, P, k]) of the
# depth-d children (d = 1..depths) of P parent nodes
ChildScores = Callable[[int, Tensor], tuple[Tensor, Tensor]]


def build_tree_nodes(child_scores: ChildScores, anchors: Tensor, depths: int, budget: int) -> tuple[Tensor, ...]:
    """The `budget` - 1 best nodes (by path score) of every lane's implicit tree over `depths` depths, the
    anchor (anchors [L] long) as node 0: (tokens, parents, depth, rank, order) [L, budget] long - nodes
    numbered depth by depth, best first within a depth. Per depth the best budget - 1 children of the
    previous depth's best, then the best budget - 1 over all depths; the sorts are stable, so equal scores
    order by depth, then the parent's place within its depth, then rank (what ops/tree/build.py's kernel
    pops in). Needs budget - 1 <= sum over d of min(budget - 1, k ** d)."""
    L, device = anchors.shape[0], anchors.device
    M = budget - 1
    lanes = torch.arange(L, device=device)[:, None]
    score, tokens, parts = torch.zeros(L, 1, device=device), anchors[:, None], []
    start = total = 0  # global id of the previous depth's first node; nodes so far
    for d in range(1, depths + 1):
        log_p, child_tokens = child_scores(d, tokens)  # [L, P, k]
        k = log_p.shape[-1]
        children = (score[:, :, None] + log_p.float() - EPS).flatten(1)
        score, pick = (x[:, :M] for x in children.sort(dim=1, descending=True, stable=True))  # best first
        tokens = child_tokens.flatten(1).gather(1, pick)
        parent = torch.full_like(pick, -1) if d == 1 else start + pick // k
        parts.append((score, parent, tokens, pick % k, torch.full_like(pick, d)))
        start, total = total, total + pick.shape[1]
    # the global id of a candidate node is its place in the depth-major concatenation of the parts
    scores, parents, node_tokens, ranks, depth = (torch.cat(x, dim=1) for x in zip(*parts))
    assert scores.shape[1] >= M, f"a tree of {budget} nodes needs more candidates ({scores.shape[1]} + 1)"
    chosen = scores.sort(dim=1, descending=True, stable=True).indices[:, :M]  # by path score, then depth
    ids, score_order = chosen.sort(dim=1)  # depth-major: parents before children
    node_of = torch.full_like(scores, -1, dtype=torch.long)
    node_of[lanes, ids] = torch.arange(1, M + 1, device=device).expand(L, M)
    parent_ids = parents.gather(1, ids)
    tree_parents = torch.where(parent_ids < 0, 0, node_of.gather(1, parent_ids.clamp(min=0)))
    zero = torch.zeros(L, 1, dtype=torch.long, device=device)
    return (torch.cat([anchors[:, None], node_tokens.gather(1, ids)], 1), torch.cat([zero - 1, tree_parents], 1),
            torch.cat([zero, depth.gather(1, ids)], 1), torch.cat([zero, ranks.gather(1, ids)], 1),
            torch.cat([zero, score_order + 1], 1))


def ranked_children(log_p: Tensor, tokens: Tensor) -> ChildScores:
    """Depth d's candidates, whatever the parent: tokens [L, D, k] with log probabilities log_p [L, D, k],
    best first (DFlash's: the drafter's top-k at each depth)."""

    def children(d: int, parent_tokens: Tensor) -> tuple[Tensor, Tensor]:
        P = parent_tokens.shape[1]
        return log_p[:, d - 1, None].expand(-1, P, -1), tokens[:, d - 1, None].expand(-1, P, -1)

    return children


def row_top_k(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The k largest entries of each row of x [..., V], best first, equal values in index order (a stable
    descending sort, cut): (values, indices) [..., k]. ops/tree/topk.row_top_k's contract (torch.topk leaves
    the order of equal values open: the two kernel sets would build different trees from tied logits)."""
    values, indices = x.sort(dim=-1, descending=True, stable=True)
    return values[..., :k], indices[..., :k]


def build_ranked_tree_ref(log_p: Tensor, tokens: Tensor, anchors: Tensor, budget: int) -> tuple[Tensor, ...]:
    """build_tree_nodes over ranked_children (log_p, tokens [L, D, k]): ops/tree/build.ranked_tree's contract."""
    return build_tree_nodes(ranked_children(log_p, tokens), anchors, log_p.shape[1], budget)


def greedy_walk(tree, greedy_next: Tensor, depth_limit: Tensor) -> tuple[Tensor, Tensor]:
    """Greedy acceptance without a loop over depths (tree: a speculative.tree.DraftTree - tokens, parents,
    depth, rank, valid [L, N], max_depth): a node matches when it is valid, within the lane's depth limit
    and the target's argmax at its parent (greedy_next [L, N]), and no sibling of lower rank matches
    (siblings of one candidate list hold distinct tokens; the rule keeps the walk's choice if they did
    not); the accepted nodes are those whose every node below the root matches - one path, ending at the
    deepest. Returns (path [L, max_depth]: the accepted nodes by depth, -1 past the last; the last accepted
    node [L], 0 = the root)."""
    L, N = tree.tokens.shape
    D, device = tree.max_depth, tree.tokens.device
    parent_next = greedy_next.gather(1, tree.parents.clamp(min=0))
    ok = tree.valid & (tree.parents >= 0) & (tree.tokens == parent_next) & (tree.depth <= depth_limit[:, None])
    elder = (tree.parents[:, :, None] == tree.parents[:, None, :]) & (tree.rank[:, None, :] < tree.rank[:, :, None])
    ok = ok & ~(elder & ok[:, None, :]).any(dim=2)  # [l, n, m]: m a matching sibling ranked before n
    ok[:, 0] = True  # the root: the committed token
    ancestors = ancestor_mask(tree.parents)
    accepted = ~(ancestors & ~ok[:, None, :]).any(dim=2)  # [L, N]: no unmatched node on the way up
    last = torch.where(accepted, tree.depth, -1).argmax(dim=1)  # the deepest accepted node
    on_path = ancestors[torch.arange(L, device=device), last] & (tree.depth > 0)  # [L, N]
    slots = torch.where(on_path, tree.depth - 1, D)  # each accepted node at its depth's column, others spare
    path = torch.full((L, D + 1), -1, dtype=torch.long, device=device)
    path.scatter_(1, slots, torch.where(on_path, torch.arange(N, device=device), -1).expand(L, N).contiguous())
    return path[:, :D], last
