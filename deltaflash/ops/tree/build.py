"""Draft trees of parent-independent candidates (DFlash) in one launch.

Reference and contract: naive.build_ranked_tree_ref (build_tree_nodes over ranked_children: per depth a
sort of the previous depth's best nodes' children, then a sort of all depths' - some twenty small launches
a round). A node at depth d is a path of candidate ranks; its score is its parent's plus the log-probability
of its rank at depth d, less EPS; the tree holds the budget - 1 best nodes under the order (score
descending, then depth, then the parent's place within its depth, then rank: the reference's stable sorts).

One program per lane pops the best node of a frontier budget - 1 times (a lazy best-first search: the
frontier holds, for every popped node, its first child and its next sibling, each ordered after it, so the
best unpopped node is always there), then numbers the popped nodes as the reference does: depth by depth,
best first within a depth. The scores are the reference's sums in the same order and precision, so the
trees are the same.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaflash.ops.tree.naive import EPS


@triton.jit
def ranked_tree_kernel(log_p, cand, anchors, tokens_out, parents_out, depth_out, rank_out, order_out,
                       stride_p_l, stride_p_d, stride_c_l, stride_c_d, stride_o_l,
                       D, K, M, EPS: tl.constexpr, BF: tl.constexpr, BN: tl.constexpr):
    """Lane i_l: log_p / cand [L, D, K] (the ranked candidates of depths 1..D); outputs [L, M + 1]."""
    i_l = tl.program_id(0).to(tl.int64)
    p_lp = log_p + i_l * stride_p_l
    o_f, o_n = tl.arange(0, BF), tl.arange(0, BN)
    BIG: tl.constexpr = 1 << 30
    # the frontier: score, depth, the parent's place within its depth, rank, parent (pop index; -1: the
    # root), the parent's score; it starts with the root's first child
    first = tl.load(p_lp).to(tl.float32)
    f_score = tl.where(o_f == 0, (0.0 + first) - EPS, float("-inf"))
    f_depth = tl.where(o_f == 0, 1, 0)
    f_ppos = tl.zeros([BF], dtype=tl.int32)
    f_rank = tl.zeros([BF], dtype=tl.int32)
    f_par = tl.full([BF], -1, tl.int32)
    f_pscore = tl.zeros([BF], dtype=tl.float32)
    n_f = tl.full([], 1, tl.int32)
    # the popped nodes, by pop index: depth, rank, parent, place within the depth
    n_depth = tl.zeros([BN], dtype=tl.int32)
    n_rank = tl.zeros([BN], dtype=tl.int32)
    n_par = tl.full([BN], -1, tl.int32)
    n_pos = tl.zeros([BN], dtype=tl.int32)
    for i in range(0, M):
        best = tl.max(f_score)
        pick = f_score == best
        d = tl.min(tl.where(pick, f_depth, BIG))
        pick = pick & (f_depth == d)
        pp = tl.min(tl.where(pick, f_ppos, BIG))
        pick = pick & (f_ppos == pp)
        r = tl.min(tl.where(pick, f_rank, BIG))
        s = tl.min(tl.where(pick & (f_rank == r), o_f, BF))
        par = tl.sum(tl.where(o_f == s, f_par, 0))
        pscore = tl.sum(tl.where(o_f == s, f_pscore, 0.0))
        pos = tl.sum(((n_depth == d) & (o_n < i)).to(tl.int32))  # popped before it at its depth
        n_depth = tl.where(o_n == i, d, n_depth)
        n_rank = tl.where(o_n == i, r, n_rank)
        n_par = tl.where(o_n == i, par, n_par)
        n_pos = tl.where(o_n == i, pos, n_pos)
        # its next sibling joins the frontier; its first child takes its slot (none past depth D)
        sib = (pscore + tl.load(p_lp + (d - 1) * stride_p_d + r + 1, mask=r + 1 < K, other=0.0).to(tl.float32)) - EPS
        kid = (best + tl.load(p_lp + d * stride_p_d, mask=d < D, other=0.0).to(tl.float32)) - EPS
        add = (o_f == n_f) & (r + 1 < K)
        f_score = tl.where(add, sib, f_score)
        f_depth = tl.where(add, d, f_depth)
        f_ppos = tl.where(add, pp, f_ppos)
        f_rank = tl.where(add, r + 1, f_rank)
        f_par = tl.where(add, par, f_par)
        f_pscore = tl.where(add, pscore, f_pscore)
        n_f = n_f + (r + 1 < K).to(tl.int32)
        here = o_f == s
        f_score = tl.where(here, tl.where(d < D, kid, float("-inf")), f_score)
        f_depth = tl.where(here, d + 1, f_depth)
        f_ppos = tl.where(here, pos, f_ppos)
        f_rank = tl.where(here, 0, f_rank)
        f_par = tl.where(here, i, f_par)
        f_pscore = tl.where(here, best, f_pscore)
    # node ids: depth by depth, best first (pop order) within a depth; node 0 is the anchor
    live = o_n < M
    shallower = tl.sum((tl.expand_dims(n_depth, 0) < tl.expand_dims(n_depth, 1)) & tl.expand_dims(live, 0), axis=1)
    ids = 1 + shallower.to(tl.int32) + n_pos
    parent_ids = tl.sum(tl.where(tl.expand_dims(o_n, 0) == tl.expand_dims(n_par, 1), tl.expand_dims(ids, 0), 0), axis=1)
    parent_ids = tl.where(n_par < 0, 0, parent_ids)
    token = tl.load(cand + i_l * stride_c_l + (n_depth - 1) * stride_c_d + n_rank, mask=live, other=0)
    p_out = i_l * stride_o_l + ids
    tl.store(tokens_out + p_out, token.to(tl.int64), mask=live)
    tl.store(parents_out + p_out, parent_ids.to(tl.int64), mask=live)
    tl.store(depth_out + p_out, n_depth.to(tl.int64), mask=live)
    tl.store(rank_out + p_out, n_rank.to(tl.int64), mask=live)
    tl.store(order_out + p_out, (o_n + 1).to(tl.int64), mask=live)
    root = i_l * stride_o_l
    tl.store(tokens_out + root, tl.load(anchors + i_l).to(tl.int64))
    tl.store(parents_out + root, tl.full([], -1, tl.int64))
    tl.store(depth_out + root, tl.full([], 0, tl.int64))
    tl.store(rank_out + root, tl.full([], 0, tl.int64))
    tl.store(order_out + root, tl.full([], 0, tl.int64))


def ranked_tree(log_p: torch.Tensor, cand: torch.Tensor, anchors: torch.Tensor, budget: int):
    """naive.build_ranked_tree_ref's contract: log_p [L, D, K] (each depth's candidates' log
    probabilities, best first), cand [L, D, K] long, anchors [L] long -> (tokens, parents, depth, rank,
    order) [L, budget] long. Needs budget - 1 <= sum over d of min(budget - 1, K ** d)."""
    L, D, K = log_p.shape
    M = budget - 1
    if cand.shape != log_p.shape or anchors.shape != (L,):
        raise ValueError(f"log_p and cand [L, D, K], anchors [L] expected, got {tuple(log_p.shape)}, "
                         f"{tuple(cand.shape)}, {tuple(anchors.shape)}")
    if M < 1 or M > sum(min(M, K ** d) for d in range(1, D + 1)):
        raise ValueError(f"a tree of {budget} nodes does not fit {D} depths of {K} candidates")
    outs = [torch.empty(L, budget, dtype=torch.long, device=log_p.device) for _ in range(5)]
    if L:
        log_p, cand = log_p.contiguous(), cand.contiguous()
        ranked_tree_kernel[(L,)](log_p, cand, anchors.contiguous(), *outs, log_p.stride(0), log_p.stride(1),
                                 cand.stride(0), cand.stride(1), outs[0].stride(0), D, K, M, EPS=EPS,
                                 BF=triton.next_power_of_2(M + 2), BN=triton.next_power_of_2(M), num_warps=1)
    return tuple(outs)
