"""RMS norms in one kernel launch each (the torch references take about nine).

Reference: naive.py. Statistics in fp32, one row of D features at a time; a program takes `rows_per_program(D)`
rows (narrow rows - the GDN output's heads of 128, attention's q / k heads of 256 - a tile of several, so that a
2048-token prefill's 65,536 head rows are not 65,536 one-warp programs). The count follows D alone, so a row's
bits never depend on how many rows the call has.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def rms_norm_kernel(x, gate, weight, y, total, R, stride_x_t, stride_x_h, X_H, stride_g_t, stride_g_h, G_H, eps,
                    D: tl.constexpr, BD: tl.constexpr, GATED: tl.constexpr, RESIDUAL: tl.constexpr,
                    PLAIN: tl.constexpr = False, BR: tl.constexpr = 1):
    """Rows [BR * program, +BR) of R, each: y = x * rsqrt(mean(x^2) + eps) * (1 + w) (zero-centered); with
    PLAIN, y = w * normed.to(dtype) (naive.plain_rms_norm_ref: the drafter's norms); with GATED,
    y = (w * normed.to(dtype)) * silu(gate) with the roundings of naive.gated_rms_norm_ref. With
    RESIDUAL (zero-centered only), x is first replaced by x + gate rounded to the dtype, which is
    also written to `total` (the residual stream's add and the next norm in one pass). Row i_r of x lies
    at (i_r // X_H) * stride_x_t + (i_r % X_H) * stride_x_h, gate row i_r likewise (G_H, stride_g_*): rows
    of heads of a strided view (attention's q and k, the GDN gate z: per-head rows of a column slice of the
    projection) are read in place. y and total are contiguous [R, D]."""
    i_r = (tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR))[:, None]  # [BR, 1]
    o_d = tl.arange(0, BD)[None, :]
    m = (o_d < D) & (i_r < R)
    p_g = gate + (i_r // G_H) * stride_g_t + (i_r % G_H) * stride_g_h + o_d
    b_x = tl.load(x + (i_r // X_H) * stride_x_t + (i_r % X_H) * stride_x_h + o_d, mask=m, other=0.0).to(tl.float32)
    if RESIDUAL:
        b_r = tl.load(p_g, mask=m, other=0.0).to(tl.float32)
        b_s = (b_x + b_r).to(y.dtype.element_ty)
        tl.store(total + i_r * D + o_d, b_s, mask=m)
        b_x = b_s.to(tl.float32)
    b_n = b_x * tl.math.rsqrt(tl.sum(b_x * b_x, axis=1)[:, None] / D + eps)
    b_w = tl.load(weight + o_d, mask=o_d < D, other=0.0)
    dtype = y.dtype.element_ty
    if (GATED or PLAIN) and not RESIDUAL:
        b_y = (b_w.to(tl.float32) * b_n.to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        if GATED:
            b_g = tl.load(p_g, mask=m, other=0.0).to(tl.float32)
            b_y = b_y * (b_g / (1.0 + tl.exp(-b_g)))
    else:
        b_y = b_n * (1.0 + b_w.to(tl.float32))
    tl.store(y + i_r * D + o_d, b_y.to(dtype), mask=m)


TILE = 2048  # features per program at most, rows of them: 16 rows of 128, 8 of 256, one of 4096


def rows_per_program(D: int) -> int:
    """Rows one program normalises: as many whole rows as fit TILE features, at most 16 (by D alone)."""
    return max(1, min(16, TILE // triton.next_power_of_2(D)))


def _rows(t: torch.Tensor, D: int) -> torch.Tensor:
    """[..., D] -> [R, D] with unit feature stride (a view when the rows are evenly strided)."""
    t = t.reshape(-1, D)
    return t if t.stride(1) == 1 else t.contiguous()


def _head_rows(t: torch.Tensor, D: int) -> tuple[torch.Tensor, int, int, int]:
    """[..., D] -> (a tensor holding its rows, stride_t, stride_h, heads): row r of the [R, D] flattening
    at (r // heads) * stride_t + (r % heads) * stride_h. Without a copy when the rows are evenly strided
    or evenly strided heads of evenly strided tokens ([..., H, D] views of a wider tensor's columns). Evenly
    strided rows come as one head a token (heads 1: the kernel's row arithmetic then folds away)."""
    if t.stride(-1) == 1:
        try:
            rows = t.view(-1, D)
            return rows, rows.stride(0), 0, 1
        except RuntimeError:
            pass
    if t.dim() >= 3 and t.stride(-1) == 1:
        try:
            tokens = t.view(-1, *t.shape[-2:])  # [N, H, D]: leading dims merged, no copy
        except RuntimeError:
            tokens = None
        if tokens is not None:
            return tokens, tokens.stride(0), tokens.stride(1), tokens.shape[1]
    rows = _rows(t, D)
    return rows, rows.stride(0), 0, 1


def rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor, eps: float, gate: torch.Tensor | None = None,
                 residual: torch.Tensor | None = None, plain: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the norm, and with `residual` x + residual, which is what is normed; else None)."""
    D = x.shape[-1]
    dtype = x.dtype if gate is None else gate.dtype
    x2, stride_x_t, stride_x_h, x_heads = _head_rows(x, D)  # q / k heads of the projection: read in place
    if gate is None and residual is None:
        g2, stride_g_t, stride_g_h, heads = x2, stride_x_t, stride_x_h, x_heads
    else:
        g2, stride_g_t, stride_g_h, heads = _head_rows(gate if residual is None else residual, D)
    R = x.numel() // D if D else 0
    y = torch.empty(R, D, dtype=dtype, device=x.device)
    total = torch.empty_like(y) if residual is not None else None
    if R:
        BD, BR = triton.next_power_of_2(D), rows_per_program(D)
        rms_norm_kernel[(triton.cdiv(R, BR),)](x2, g2, weight, y, y if total is None else total, R, stride_x_t,
                                               stride_x_h, x_heads, stride_g_t, stride_g_h, heads, eps, D=D, BD=BD,
                                               GATED=gate is not None, RESIDUAL=residual is not None, PLAIN=plain,
                                               BR=BR, num_warps=min(8, max(1, BR * BD // 512)))
    return y.view(x.shape), None if total is None else total.view(x.shape)


def zero_centered_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """naive.zero_centered_rms_norm_ref in one launch. x [..., D] (rows may be strided), weight [D]."""
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"weight must be [{x.shape[-1]}]; got {tuple(weight.shape)}")
    return rms_norm_fwd(x, weight, eps)[0]


def plain_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """naive.plain_rms_norm_ref in one launch (about eight in torch). x [..., D], weight [D] in x's dtype."""
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"weight must be [{x.shape[-1]}]; got {tuple(weight.shape)}")
    return rms_norm_fwd(x, weight, eps, plain=True)[0]


def add_rms_norm(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """naive.add_rms_norm_ref in one launch: (s = x + y in x's dtype, zero_centered_rms_norm(s)). x, y
    [..., D] of one dtype; s is a new contiguous tensor."""
    if y.shape != x.shape or y.dtype != x.dtype or weight.shape != (x.shape[-1],):
        raise ValueError(f"x {tuple(x.shape)} {x.dtype}, y {tuple(y.shape)} {y.dtype} and weight "
                         f"{tuple(weight.shape)} do not fit: y like x, weight [{x.shape[-1]}]")
    normed, total = rms_norm_fwd(x, weight, eps, residual=y)
    return total, normed


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """naive.gated_rms_norm_ref in one launch. x, gate [..., D], weight [D] in gate's dtype."""
    if gate.shape != x.shape or weight.shape != (x.shape[-1],):
        raise ValueError(f"gate must be {tuple(x.shape)} and weight [{x.shape[-1]}]; "
                         f"got {tuple(gate.shape)} and {tuple(weight.shape)}")
    return rms_norm_fwd(x, weight, eps, gate)[0]
