"""Gated attention's output gate, out * sigmoid(gate), with the heads merged, in one launch: gate is read
where the query projection wrote it (each head's [q | gate] columns: a strided view), and the torch
route's two launches (sigmoid written out, read back for the product) become one pass. Same roundings as
naive.sigmoid_gate_ref (README.md): bit for bit on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaflash.ops.gdn.verify import exact_add, exact_exp

BLOCK = 1024


@triton.jit
def sigmoid_gate_kernel(x, gate, out, T, stride_xl, stride_xt, stride_xh, stride_gl, stride_gt, stride_gh, F,
                        HD: tl.constexpr, BF: tl.constexpr):
    """Token i_n = l * T + t, merged features [i_b * BF, +BF) (head o // HD, feature o % HD): out =
    x * (sigmoid(gate) rounded to the dtype), in fp32, rounded."""
    i_n, i_b = tl.program_id(0).to(tl.int64), tl.program_id(1)
    i_l, i_t = i_n // T, i_n % T
    o_f = i_b * BF + tl.arange(0, BF)
    m_f = o_f < F
    o_h, o_d = o_f // HD, o_f % HD
    b_x = tl.load(x + i_l * stride_xl + i_t * stride_xt + o_h * stride_xh + o_d, mask=m_f, other=0.0).to(tl.float32)
    b_g = tl.load(gate + i_l * stride_gl + i_t * stride_gt + o_h * stride_gh + o_d, mask=m_f, other=0.0)
    b_s = tl.math.div_rn(1.0, exact_add(exact_exp(-b_g.to(tl.float32)), 1.0))
    b_s = b_s.to(out.dtype.element_ty).to(tl.float32)
    tl.store(out + i_n * F + o_f, (b_x * b_s).to(out.dtype.element_ty), mask=m_f)


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """naive.sigmoid_gate_ref in one launch. x, gate [L, T, heads, head_dim] of one dtype, each with unit
    feature stride (any token / head strides); returns a contiguous [L, T, heads * head_dim]. No host sync."""
    if x.shape != gate.shape or x.dtype != gate.dtype or x.device != gate.device or x.dim() != 4:
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} and gate {tuple(gate.shape)} {gate.dtype} must be one "
                         "[L, T, heads, head_dim] shape and dtype")
    if x.stride(-1) != 1 or gate.stride(-1) != 1:
        raise ValueError("x and gate need unit feature stride")
    L, T, H, D = x.shape
    out = torch.empty(L, T, H * D, dtype=x.dtype, device=x.device)
    if out.numel():
        sigmoid_gate_kernel[(L * T, triton.cdiv(H * D, BLOCK))](
            x, gate, out, T, *x.stride()[:3], *gate.stride()[:3], H * D, HD=D, BF=BLOCK, num_warps=4,
            enable_fp_fusion=False)
    return out
