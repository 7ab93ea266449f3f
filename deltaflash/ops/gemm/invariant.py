"""A batch-invariant linear layer in Triton: y = x W^T (+ b) whose row i has the same bits whatever
other rows share the call.

cuBLAS picks its kernel (tiles, split-K, GEMV for one row) by the shape of the call, so a token's
projections can round differently when it is verified among 16 rows than when it is decoded alone
(measured on the H200: fp32 at every batch size, bf16 for the K = 12288 down projection; see
`bench/batch_invariance.py`). Speculative greedy output then equals target-only output only up to
near-ties. This kernel uses one tile shape for every call and walks K in the same pieces in the same
order, with no split-K: a row's dot products are the same instructions on the same operands at any M.
It is opt-in (`EngineConfig.batch_invariant`, `--batch-invariant`) until its speed is measured.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BM, BN, BK = 64, 64, 64


@triton.jit(do_not_specialize=["M"])  # any number of rows, one binary
def invariant_linear_kernel(x, w, bias, out, M, N, K, stride_xm, stride_wn, stride_om,
                            HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
                            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    i_m, i_n = tl.program_id(0), tl.program_id(1)
    o_m = (i_m * BM + tl.arange(0, BM)).to(tl.int64)
    o_n = (i_n * BN + tl.arange(0, BN)).to(tl.int64)
    m_m, m_n = o_m < M, o_n < N
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < K
        a = tl.load(x + o_m[:, None] * stride_xm + o_k[None, :], mask=m_m[:, None] & m_k[None, :], other=0.0)
        b = tl.load(w + o_n[None, :] * stride_wn + o_k[:, None], mask=m_n[None, :] & m_k[:, None], other=0.0)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    if HAS_BIAS:
        acc += tl.load(bias + o_n, mask=m_n, other=0.0).to(tl.float32)[None, :]
    tl.store(out + o_m[:, None] * stride_om + o_n[None, :], acc.to(out.dtype.element_ty),
             mask=m_m[:, None] & m_n[None, :])


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [..., K] and weight [N, K] of one dtype (fp32, bf16 or fp16),
    batch-invariant (module docstring); fp32 sums of fp32 inputs are IEEE (no TF32)."""
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1] or x.dtype != weight.dtype:
        raise ValueError(f"x [..., K] and weight [N, K] of one dtype, got {tuple(x.shape)} {x.dtype} and "
                         f"{tuple(weight.shape)} {weight.dtype}")
    N, K = weight.shape
    rows = x.reshape(-1, K)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    out = torch.empty(rows.shape[0], N, dtype=x.dtype, device=x.device)
    M = rows.shape[0]
    if M and N:
        invariant_linear_kernel[(triton.cdiv(M, BM), triton.cdiv(N, BN))](
            rows, weight, weight if bias is None else bias, out, M, N, K, rows.stride(0), weight.stride(0),
            out.stride(0), HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32, BM=BM, BN=BN, BK=BK,
            num_warps=4)
    return out.view(*x.shape[:-1], N)
