"""The ancestor mask of draft trees in one launch: [l, n, m] = m is n or an ancestor of n.

Reference and contract: core.batch.ancestor_mask (reachability by squaring: a comparison, a cast and
log2 N batched matmuls with their clamps, about a dozen launches). One program per lane holds the lane's
parents and, for every node at once, climbs one parent step per iteration (at most N - 1: a tree of N nodes
is at most N - 1 deep), marking each node reached. Parents of -1 end a climb (roots; forests too). The mask is
boolean: the reference's exactly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def ancestor_mask_kernel(parents, out, stride_p, N, BN: tl.constexpr):
    """Lane i_l: out[i_l, n, m] = 1 where m is on the way from n up to its root (n included)."""
    i_l = tl.program_id(0).to(tl.int64)
    o_n = tl.arange(0, BN)
    m_n = o_n < N
    cur = tl.where(m_n, o_n, -1)  # each node's climber; -1 once past the root
    seen = (cur[:, None] == o_n[None, :]) & m_n[:, None]
    for _ in range(1, N):
        cur = tl.load(parents + i_l * stride_p + cur, mask=cur >= 0, other=-1).to(tl.int32)
        seen = seen | ((cur[:, None] == o_n[None, :]) & (cur >= 0)[:, None])
    m_nm = m_n[:, None] & m_n[None, :]
    tl.store(out + i_l * N * N + o_n[:, None] * N + o_n[None, :], seen.to(tl.int8), mask=m_nm)


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """core.batch.ancestor_mask's contract: parents [L, N] long (-1: none) -> [L, N, N] bool."""
    if parents.dim() != 2:
        raise ValueError(f"parents [L, N] expected, got {tuple(parents.shape)}")
    L, N = parents.shape
    out = torch.empty(L, N, N, dtype=torch.int8, device=parents.device)
    if L and N:
        parents = parents if parents.stride(1) == 1 else parents.contiguous()
        ancestor_mask_kernel[(L,)](parents, out, parents.stride(0), N, BN=triton.next_power_of_2(N), num_warps=1)
    return out.view(torch.bool)
