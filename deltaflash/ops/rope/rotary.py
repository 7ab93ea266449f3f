"""naive.apply_rope_ref in one launch: each program reads a row's heads once (x may be a strided view) and
writes the rotated dims and the kept ones into a new contiguous tensor. The torch route's roundings: the two
products rounded to the dtype, then their sum rounded (`enable_fp_fusion=False`: no FMA); a negation is
exact. So both kernel sets give the attention layers the same bits on a GPU (README.md)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def rope_kernel(x, cos, sin, out, stride_x_r, stride_x_h, stride_c_r, H, HD, RD,
                BH: tl.constexpr, BD: tl.constexpr):
    """Row i_r, heads [i_h * BH, +BH): out[d] = x[d] cos[d] + (-x[d + rd/2] if d < rd/2 else x[d - rd/2]) sin[d]
    for d < rd, x[d] past it."""
    i_r, i_h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o_h = i_h * BH + tl.arange(0, BH)
    o_d = tl.arange(0, BD)
    half = RD // 2
    m_h = o_h < H
    m = m_h[:, None] & (o_d < HD)[None, :]
    rotary = o_d < RD
    partner = tl.where(o_d < half, o_d + half, o_d - half)
    p_x = x + i_r * stride_x_r + o_h[:, None] * stride_x_h
    b_x = tl.load(p_x + o_d[None, :], mask=m, other=0.0)
    b_p = tl.load(p_x + partner[None, :], mask=m & rotary[None, :], other=0.0).to(tl.float32)
    b_c = tl.load(cos + i_r * stride_c_r + o_d, mask=rotary, other=0.0).to(tl.float32)
    b_s = tl.load(sin + i_r * stride_c_r + o_d, mask=rotary, other=0.0).to(tl.float32)
    b_p = tl.where((o_d < half)[None, :], -b_p, b_p)
    dtype = out.dtype.element_ty
    b_a = (b_x.to(tl.float32) * b_c[None, :]).to(dtype).to(tl.float32)
    b_b = (b_p * b_s[None, :]).to(dtype).to(tl.float32)
    b_o = tl.where(rotary[None, :], (b_a + b_b).to(dtype), b_x)
    tl.store(out + (i_r * H + o_h[:, None]) * HD + o_d[None, :], b_o, mask=m)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """naive.apply_rope_ref in one launch. x [..., heads, hd] (unit stride over hd; heads and rows may be
    strided); cos / sin [..., rd] with x's leading dims, rd even and at most hd, of x's dtype. Returns a
    contiguous [..., heads, hd]. No host sync."""
    H, HD, RD = x.shape[-2], x.shape[-1], cos.shape[-1]
    lead = x.shape[:-2]
    if cos.shape != (*lead, RD) or sin.shape != cos.shape or RD % 2 or RD > HD:
        raise ValueError(f"cos / sin {tuple(cos.shape)} / {tuple(sin.shape)} do not fit x {tuple(x.shape)}: "
                         f"[..., rd] with x's leading dims, rd even and at most the head dim")
    if x.dtype != cos.dtype or sin.dtype != cos.dtype:
        raise ValueError(f"x, cos and sin must share a dtype, got {x.dtype}, {cos.dtype}, {sin.dtype}")
    rows = x.reshape(-1, H, HD) if x.stride(-1) == 1 else x.contiguous().reshape(-1, H, HD)
    c, s = cos.reshape(-1, RD), sin.reshape(-1, RD)
    if c.stride(-1) != 1 or s.stride(0) != c.stride(0) or s.stride(-1) != 1:
        c, s = c.contiguous(), s.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    R = rows.shape[0]
    if R and H:
        BH = min(triton.next_power_of_2(H), 16)
        rope_kernel[(R, triton.cdiv(H, BH))](rows, c, s, out, rows.stride(0), rows.stride(1), c.stride(0), H, HD, RD,
                                              BH=BH, BD=triton.next_power_of_2(HD), num_warps=4,
                                              enable_fp_fusion=False)
    return out
