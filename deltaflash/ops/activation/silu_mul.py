"""SwiGLU's activation, silu(gate) * up, in one launch reading gate and up where the merged projection
wrote them (two column views of one GEMM output) - the torch route reads them twice and writes silu(gate)
in between. Same roundings as naive.silu_mul_ref (README.md): bit for bit on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaflash.ops.gdn.verify import exact_exp

BLOCK = 1024


@triton.jit
def silu_mul_kernel(gate, up, out, stride_g, stride_u, I, BI: tl.constexpr):
    """Row i_r, features [i_b * BI, +BI): out = (silu(gate) rounded to the dtype) * up, in fp32, rounded."""
    i_r, i_b = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o_i = i_b * BI + tl.arange(0, BI)
    m_i = o_i < I
    b_g = tl.load(gate + i_r * stride_g + o_i, mask=m_i, other=0.0).to(tl.float32)
    b_u = tl.load(up + i_r * stride_u + o_i, mask=m_i, other=0.0).to(tl.float32)
    b_s = tl.math.div_rn(b_g, 1.0 + exact_exp(-b_g)).to(out.dtype.element_ty).to(tl.float32)
    tl.store(out + i_r * I + o_i, (b_s * b_u).to(out.dtype.element_ty), mask=m_i)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., I] -> [R, I] with unit feature stride (a view for column views of a 2-D-strided output)."""
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(1) == 1 else t.contiguous()


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """naive.silu_mul_ref in one launch. gate, up [..., I] of one dtype (rows may be strided); returns a
    contiguous [..., I]. No host sync."""
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.device != up.device:
        raise ValueError(f"gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} must match")
    I = gate.shape[-1]
    g, u = _rows(gate), _rows(up)
    out = torch.empty(g.shape, dtype=gate.dtype, device=gate.device)
    if g.shape[0] and I:
        silu_mul_kernel[(g.shape[0], triton.cdiv(I, BLOCK))](g, u, out, g.stride(0), u.stride(0), I, BI=BLOCK,
                                                             num_warps=4, enable_fp_fusion=False)
    return out.view(gate.shape)
