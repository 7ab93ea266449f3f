"""Draft trees from one DFlash block, and their acceptance (DESIGN.md §4).

A DFlash block gives in one drafter pass a distribution for every depth d = 1..B-1 of the draft (the
token at the anchor's position + d). The tree of a lane takes the N - 1 best nodes (node 0 is the
anchor) of the implicit tree whose depth-d children are the top_k candidates of depth d, best by path
score: the sum along the path of each node's log-probability among its siblings - DFlash: the drafter's
log-softmax at that depth, the same under every parent; DFlash2: the selector's scores given the parent
token, softmaxed over its candidates. A child scores below its parent (EPS less per depth breaks ties),
so the N - 1 best nodes form a tree. It is built on the device for every lane at once: per depth the
best N - 1 children of the previous depth's best N - 1, then the best N - 1 over all depths. Nodes are
numbered depth by depth, best first within a depth, so parents[n] < n.

Acceptance walks each lane from the root, on the device, without a host sync:
- greedy: to the child whose token is the target's argmax at the current node while there is one; the
  next token is the argmax at the last node reached, so the output is target-only greedy decoding;
- sampling: the children of the current node are tried in rank order as deterministic drafts: child c is
  accepted with probability r(c) / sum(r), r being the target distribution p at the node without the
  tokens of the siblings already rejected; when all are rejected the next token is drawn from r
  normalised; at a leaf or the lane's depth limit, from p. Every step is an exact draw from p (lossless),
  with the request's own noise streams.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn import functional as F

from deltaflash.core.batch import ancestor_mask
from deltaflash.speculative.acceptance import Accepted, with_logprobs
from deltaflash.speculative.sampling import STREAM_ACCEPT, STREAM_TOKEN, LaneSampling, lane_probs, sample_from, uniform_noise

EPS = 1e-6  # path score lost per depth: a child never ties its parent

# child_scores(d, parent_tokens [L, P]) -> (log-probabilities [L, P, k], tokens [L, P, k]) of the
# depth-d children (d = 1..depths) of P parent nodes
ChildScores = Callable[[int, Tensor], tuple[Tensor, Tensor]]


@dataclass(frozen=True)
class DraftTree:
    """The draft trees of L lanes, N nodes each.

    tokens [L, N] long (node 0 the anchor); parents [L, N] long (-1 at node 0; parents[n] < n);
    depth [L, N] long (0 at node 0); rank [L, N] long: the node's candidate rank among its parent's
    children (0 = the best: a path with a node of rank > 0 left the top-1 chain); order [L, N] long: the
    node's place by path score (node 0 first), so the best b nodes of a lane are those with order < b;
    valid [L, N] bool: nodes the lane may accept (a request's smaller budget cuts its tree).
    max_depth and top_k (host ints) bound the walk."""

    tokens: Tensor
    parents: Tensor
    depth: Tensor
    rank: Tensor
    order: Tensor
    valid: Tensor
    max_depth: int
    top_k: int

    @property
    def budget(self) -> int:
        return self.tokens.shape[1]

    def ancestors(self) -> Tensor:
        """[L, N, N] bool: [l, n, m] = m is n or an ancestor of n."""
        return ancestor_mask(self.parents)

    def cut(self, budgets: Tensor) -> "DraftTree":
        """The same trees with only the best budgets[l] nodes of lane l valid (budgets [L] long)."""
        return DraftTree(self.tokens, self.parents, self.depth, self.rank, self.order,
                         self.valid & (self.order < budgets[:, None]), self.max_depth, self.top_k)


def build_tree(child_scores: ChildScores, anchors: Tensor, depths: int, budget: int, top_k: int) -> DraftTree:
    """Trees of `budget` nodes (the anchor included) over `depths` draft depths; see the module docstring.
    anchors [L] long. Needs budget - 1 <= sum over d of min(budget - 1, top_k ** d)."""
    L, device = anchors.shape[0], anchors.device
    M = budget - 1
    lanes = torch.arange(L, device=device)[:, None]
    score, tokens, parts = torch.zeros(L, 1, device=device), anchors[:, None], []
    start = total = 0  # global id of the previous depth's first node; nodes so far
    for d in range(1, depths + 1):
        log_p, child_tokens = child_scores(d, tokens)  # [L, P, k]
        k = log_p.shape[-1]
        children = (score[:, :, None] + log_p.float() - EPS).flatten(1)
        # best first; equal scores keep the earlier parent, then the lower rank (a stable sort: the order
        # ops/tree/build.py's kernel reproduces)
        score, pick = (x[:, :M] for x in children.sort(dim=1, descending=True, stable=True))
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
    return DraftTree(tokens=torch.cat([anchors[:, None], node_tokens.gather(1, ids)], 1),
                     parents=torch.cat([zero - 1, tree_parents], 1), depth=torch.cat([zero, depth.gather(1, ids)], 1),
                     rank=torch.cat([zero, ranks.gather(1, ids)], 1), order=torch.cat([zero, score_order + 1], 1),
                     valid=torch.ones(L, budget, dtype=torch.bool, device=device), max_depth=min(depths, M),
                     top_k=top_k)


def build_ranked_tree(log_p: Tensor, tokens: Tensor, anchors: Tensor, budget: int) -> tuple[Tensor, ...]:
    """build_tree over ranked_children (DFlash's candidates, whatever the parent: log_p, tokens [L, D, k],
    best first) as (tokens, parents, depth, rank, order) [L, budget]: the reference of the kernel sets'
    build_ranked_tree (ops/tree/build.py builds the same trees in one launch)."""
    L, D, k = log_p.shape
    tree = build_tree(ranked_children(log_p, tokens), anchors, D, budget, k)
    return tree.tokens, tree.parents, tree.depth, tree.rank, tree.order


def max_nodes(depths: int, top_k: int, budget: int) -> int:
    """How many nodes `build_tree` can find: the anchor and, per depth, min(budget - 1, top_k ** d)."""
    return 1 + sum(min(budget - 1, top_k ** d) for d in range(1, depths + 1))


def dflash_candidates(logits: Tensor, top_k: int) -> tuple[Tensor, Tensor]:
    """DFlash: depth d's candidates are the top_k of the drafter's log-softmax at block slot d
    (logits [L, B-1, V] of slots 1..B-1), whatever the parent: (log_p, tokens) [L, B-1, top_k]."""
    return logits.float().log_softmax(dim=-1).topk(top_k, dim=-1)


def dflash_children(logits: Tensor, top_k: int) -> ChildScores:
    """DFlash's candidates (dflash_candidates) as child scores."""
    return ranked_children(*dflash_candidates(logits, top_k))


def ranked_children(log_p: Tensor, tokens: Tensor) -> ChildScores:
    """Depth d's candidates, whatever the parent: tokens [L, D, k] with log probabilities log_p [L, D, k],
    best first (what dflash_children takes from the drafter's logits)."""

    def children(d: int, parent_tokens: Tensor) -> tuple[Tensor, Tensor]:
        P = parent_tokens.shape[1]
        return log_p[:, d - 1, None].expand(-1, P, -1), tokens[:, d - 1, None].expand(-1, P, -1)

    return children


def dflash2_children(selector, hidden: Tensor, logits: Tensor, top_k: int) -> ChildScores:
    """DFlash2: depth d's candidates are the selector's top-K tokens of slot d, scored given the parent
    token t as unary(c) + <predecessor[t] * projection(h_d), successor[c]> and log-softmaxed over the K
    (temperature 1); the top_k of them are the children."""
    unary, candidates = logits.topk(selector.top_k, dim=-1)  # [L, B-1, K]
    projected = selector.hidden_projection(hidden)  # [L, B-1, rank]
    successors = F.embedding(candidates, selector.successor_codebook)  # [L, B-1, K, rank]
    k = min(top_k, selector.top_k)

    def children(d: int, parent_tokens: Tensor) -> tuple[Tensor, Tensor]:
        query = F.embedding(parent_tokens, selector.predecessor_codebook) * projected[:, d - 1, None]  # [L, P, rank]
        scores = unary[:, d - 1, None] + torch.einsum("lpr,lkr->lpk", query, successors[:, d - 1])  # [L, P, K]
        log_p, pick = scores.float().log_softmax(dim=-1).topk(k, dim=-1)
        return log_p, candidates[:, d - 1, None].expand_as(scores).gather(-1, pick)

    return children


def children_by_rank(tree: DraftTree) -> Tensor:
    """[L, N, top_k] long: the valid children of each node in rank order (-1: none at that rank)."""
    L, N = tree.tokens.shape
    k = tree.top_k
    slot = torch.where(tree.valid & (tree.parents >= 0), tree.parents.clamp(min=0) * k + tree.rank.clamp(max=k - 1),
                       N * k)  # invalid nodes and the root go to a spare column
    table = torch.full((L, N * k + 1), -1, dtype=torch.long, device=tree.tokens.device)
    table.scatter_(1, slot, torch.arange(N, device=table.device).expand(L, N))
    return table[:, :N * k].view(L, N, k)


def accept_tree(logits: Tensor, tree: DraftTree, depth_limit: Tensor, sampling: LaneSampling,
                top_logprobs: int | None = None, raw: Tensor | None = None, walk=None) -> Accepted:
    """logits [L, N, V] fp32: the target's rows at every node, the lanes' logit rules already applied
    (raw: the same before the rules, for logprobs; None: logits); depth_limit [L] long: drafts a lane may
    accept; walk: greedy_walk's implementation (the engine's kernel set's; None: greedy_walk). Returns
    Accepted with `path` [L, D+1] (node ids, the root first, then the accepted nodes; 0 past counts) and
    tokens [L, D+1] (the accepted nodes' tokens, then the next token)."""
    L, N, V = logits.shape
    device = logits.device
    lanes = torch.arange(L, device=device)
    greedy_next = logits.argmax(dim=-1)  # [L, N]
    path, cur = (walk or greedy_walk)(tree, greedy_next, depth_limit)
    next_token = greedy_next[lanes, cur]
    if not sampling.all_greedy:
        kids_of = children_by_rank(tree)
        sampled_path, sampled_next = _sample_walk(logits, tree, kids_of, depth_limit, sampling)
        path = torch.where(sampling.greedy[:, None], path, sampled_path)
        next_token = torch.where(sampling.greedy, next_token, sampled_next)
    counts = (path >= 0).sum(dim=1)
    path = torch.cat([torch.zeros(L, 1, dtype=torch.long, device=device), path.clamp(min=0)], dim=1)  # [L, D+1]
    tokens = torch.cat([tree.tokens.gather(1, path[:, 1:]), torch.zeros(L, 1, dtype=torch.long, device=device)], 1)
    tokens = tokens.scatter(1, counts[:, None], next_token[:, None])
    accepted = Accepted(counts=counts, tokens=tokens, path=path)
    if top_logprobs is None:
        return accepted
    rows = (logits if raw is None else raw)[lanes[:, None], path]  # [L, D+1, V]: the row each token came from
    return with_logprobs(accepted, rows, top_logprobs)


def greedy_walk(tree: DraftTree, greedy_next: Tensor, depth_limit: Tensor) -> tuple[Tensor, Tensor]:
    """Greedy acceptance without a loop over depths: a node matches when it is valid, within the lane's
    depth limit and the target's argmax at its parent, and no sibling of lower rank matches (siblings of
    one candidate list hold distinct tokens; the rule keeps the walk's choice if they did not); the
    accepted nodes are those whose every node below the root matches - one path, ending at the deepest.
    Returns (path [L, D]: the accepted nodes by depth, -1 past the last; the last accepted node [L], 0 =
    the root)."""
    L, N = tree.tokens.shape
    D, device = tree.max_depth, tree.tokens.device
    parent_next = greedy_next.gather(1, tree.parents.clamp(min=0))
    ok = tree.valid & (tree.parents >= 0) & (tree.tokens == parent_next) & (tree.depth <= depth_limit[:, None])
    elder = (tree.parents[:, :, None] == tree.parents[:, None, :]) & (tree.rank[:, None, :] < tree.rank[:, :, None])
    ok = ok & ~(elder & ok[:, None, :]).any(dim=2)  # [l, n, m]: m a matching sibling ranked before n
    ok[:, 0] = True  # the root: the committed token
    ancestors = tree.ancestors()
    accepted = ~(ancestors & ~ok[:, None, :]).any(dim=2)  # [L, N]: no unmatched node on the way up
    last = torch.where(accepted, tree.depth, -1).argmax(dim=1)  # the deepest accepted node
    on_path = ancestors[torch.arange(L, device=device), last] & (tree.depth > 0)  # [L, N]
    slots = torch.where(on_path, tree.depth - 1, D)  # each accepted node at its depth's column, others spare
    path = torch.full((L, D + 1), -1, dtype=torch.long, device=device)
    path.scatter_(1, slots, torch.where(on_path, torch.arange(N, device=device), -1).expand(L, N).contiguous())
    return path[:, :D], last


def _sample_walk(logits, tree: DraftTree, kids_of: Tensor, depth_limit: Tensor,
                 sampling: LaneSampling) -> tuple[Tensor, Tensor]:
    """(path [L, D] of accepted nodes, -1 past the last; next token [L]) by recursive rejection."""
    L, N, V = logits.shape
    D, k, device = tree.max_depth, kids_of.shape[-1], logits.device
    lanes = torch.arange(L, device=device)
    p = lane_probs(logits, sampling)  # [L, N, V]
    u = uniform_noise(sampling.stream(STREAM_ACCEPT), (L, max(D, 1) * k)).view(L, max(D, 1), k)
    cur, alive = torch.zeros(L, dtype=torch.long, device=device), torch.ones(L, dtype=torch.bool, device=device)
    final, steps = torch.zeros(L, V, device=device), []
    for step in range(D):
        residual = p[lanes, cur]  # [L, V]
        active = alive & (step < depth_limit)
        moved, nxt = torch.zeros_like(alive), cur
        kids = kids_of[lanes, cur]
        for j in range(k):
            child = kids[:, j]
            trying = active & ~moved & (child >= 0)
            token = tree.tokens.gather(1, child.clamp(min=0)[:, None])  # [L, 1]
            mass = residual.gather(1, token)[:, 0]
            taken = trying & (u[:, step, j] * residual.sum(dim=1) < mass)
            nxt, moved = torch.where(taken, child, nxt), moved | taken
            residual = residual.scatter(1, token, torch.where((trying & ~taken)[:, None], 0.0, mass[:, None]))
        stopped = alive & ~moved  # rejections, no children left, or the depth limit
        final = torch.where(stopped[:, None], residual, final)
        cur, alive = torch.where(moved, nxt, cur), moved
        steps.append(torch.where(moved, nxt, -1))
    final = torch.where(alive[:, None], p[lanes, cur], final)  # walked to the deepest depth: draw from p
    total = final.sum(dim=1, keepdim=True)
    final = torch.where(total > 0, final / total.clamp(min=torch.finfo(torch.float32).tiny), p[lanes, cur])
    path = torch.stack(steps, dim=1) if steps else torch.zeros(L, 0, dtype=torch.long, device=device)
    return path, sample_from(final, sampling.stream(STREAM_TOKEN))
