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
from deltaflash.ops.tree.naive import ChildScores, build_tree_nodes, greedy_walk, ranked_children, row_top_k
from deltaflash.speculative.acceptance import Accepted, with_logprobs
from deltaflash.speculative.sampling import STREAM_ACCEPT, STREAM_TOKEN, LaneSampling, lane_probs, sample_from, uniform_noise


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

    @staticmethod
    def of(nodes: tuple[Tensor, ...], depths: int, top_k: int) -> "DraftTree":
        """Whole trees (every node valid) from (tokens, parents, depth, rank, order) [L, N] over `depths`
        draft depths, as build_tree_nodes and the kernel sets' build_ranked_tree return them."""
        return DraftTree(*nodes, valid=torch.ones_like(nodes[0], dtype=torch.bool),
                         max_depth=min(depths, nodes[0].shape[1] - 1), top_k=top_k)

    def cut(self, budgets: Tensor) -> "DraftTree":
        """The same trees with only the best budgets[l] nodes of lane l valid (budgets [L] long)."""
        return DraftTree(self.tokens, self.parents, self.depth, self.rank, self.order,
                         self.valid & (self.order < budgets[:, None]), self.max_depth, self.top_k)


def build_tree(child_scores: ChildScores, anchors: Tensor, depths: int, budget: int, top_k: int) -> DraftTree:
    """Trees of `budget` nodes (the anchor included) over `depths` draft depths; see the module docstring and
    ops/tree/naive.build_tree_nodes. anchors [L] long. Needs budget - 1 <= sum over d of min(budget - 1,
    top_k ** d)."""
    return DraftTree.of(build_tree_nodes(child_scores, anchors, depths, budget), depths, top_k)


def max_nodes(depths: int, top_k: int, budget: int) -> int:
    """How many nodes `build_tree` can find: the anchor and, per depth, min(budget - 1, top_k ** d)."""
    return 1 + sum(min(budget - 1, top_k ** d) for d in range(1, depths + 1))


def dflash_candidates(logits: Tensor, top_k: int, top_k_op: Callable = row_top_k) -> tuple[Tensor, Tensor]:
    """DFlash: depth d's candidates are the top_k of the drafter's log-softmax at block slot d
    (logits [L, B-1, V] of slots 1..B-1), whatever the parent: (log_p, tokens) [L, B-1, top_k], equal
    log-probabilities in token order. top_k_op: a kernel set's vocab_top_k."""
    return top_k_op(logits.float().log_softmax(dim=-1), top_k)


def dflash_children(logits: Tensor, top_k: int) -> ChildScores:
    """DFlash's candidates (dflash_candidates) as child scores."""
    return ranked_children(*dflash_candidates(logits, top_k))


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
