"""Greedy acceptance of draft trees in one launch: each lane walks from the root to the child whose token
is the target's argmax at the current node, while there is one.

Reference and contract: naive.greedy_walk (the torch route: sibling and ancestor masks, about
fifty small launches a round). One program per lane holds the lane's tree in registers and walks at most
max_depth steps; at each, the matching children are the valid nodes under the current one within the
lane's depth limit whose token is the argmax there, and the walk takes the lowest-ranked of them (the
reference's rule; siblings hold distinct ranks). The outputs are integers: the reference's exactly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def greedy_walk_kernel(tokens, parents, depth, rank, valid, greedy_next, depth_limit, path, last,
                       stride_t, stride_p, stride_d, stride_r, stride_v, stride_g, stride_o,
                       N, D, BN: tl.constexpr):
    """Lane i_l: path[i_l, d - 1] = the node accepted at depth d (-1 past the last), last[i_l] = the
    deepest accepted node (0: the root)."""
    i_l = tl.program_id(0).to(tl.int64)
    o_n = tl.arange(0, BN)
    m_n = o_n < N
    b_tok = tl.load(tokens + i_l * stride_t + o_n, mask=m_n, other=-1)
    b_par = tl.load(parents + i_l * stride_p + o_n, mask=m_n, other=-2).to(tl.int32)
    b_depth = tl.load(depth + i_l * stride_d + o_n, mask=m_n, other=0)
    b_rank = tl.load(rank + i_l * stride_r + o_n, mask=m_n, other=0)
    b_ok = (tl.load(valid + i_l * stride_v + o_n, mask=m_n, other=0) != 0) & m_n
    b_next = tl.load(greedy_next + i_l * stride_g + o_n, mask=m_n, other=-1)
    b_ok = b_ok & (b_depth <= tl.load(depth_limit + i_l))
    cur = tl.full([], 0, tl.int32)
    for d in range(0, D):
        want = tl.sum(tl.where(o_n == cur, b_next, 0))  # the target's argmax at the current node
        match = b_ok & (b_par == cur) & (b_tok == want)
        best = tl.min(tl.where(match, b_rank, 1 << 30))
        node = tl.min(tl.where(match & (b_rank == best), o_n, BN))
        found = node < BN
        tl.store(path + i_l * stride_o + d, tl.where(found, node, -1).to(tl.int64))
        b_ok = b_ok & found  # past the last accepted node nothing matches
        cur = tl.where(found, node, cur)
    tl.store(last + i_l, cur.to(tl.int64))


def greedy_walk(tree, greedy_next: torch.Tensor, depth_limit: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """naive.greedy_walk's contract: tree a DraftTree of L lanes, N nodes; greedy_next [L, N]
    long, the target's argmax at each node; depth_limit [L]. Returns (path [L, max_depth] long, last [L])."""
    L, N = tree.tokens.shape
    D = tree.max_depth
    if greedy_next.shape != (L, N) or depth_limit.shape != (L,):
        raise ValueError(f"greedy_next [L={L}, N={N}] and depth_limit [L] expected, got {tuple(greedy_next.shape)}, "
                         f"{tuple(depth_limit.shape)}")
    path = torch.empty(L, D, dtype=torch.long, device=tree.tokens.device)
    last = torch.empty(L, dtype=torch.long, device=tree.tokens.device)
    if L == 0:
        return path, last
    tensors = [tree.tokens, tree.parents, tree.depth, tree.rank, tree.valid, greedy_next]
    tensors = [t if t.stride(1) == 1 else t.contiguous() for t in tensors]
    greedy_walk_kernel[(L,)](*tensors, depth_limit.contiguous(), path, last, *(t.stride(0) for t in tensors),
                             path.stride(0), N, D, BN=triton.next_power_of_2(N), num_warps=1)
    return path, last
