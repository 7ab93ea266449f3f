"""The chunked rule's gate inputs in one launch: a GDN layer's raw a and b columns (strided views of its input
projection) into what fla-core's chunked kernels take - a contiguous, beta = sigmoid(b) in fp32 - with the
padding rows of a fixed-shape batch made inert (a = -inf: g = 0, no decay; beta = 0: no write).

fla-core would otherwise copy each strided view contiguous and run its own sigmoid launch, and a fixed-shape
batch masked a and b with a `where` each: four launches a layer become one. beta is fla-core's own
arithmetic (`fused_beta_sigmoid`: the fp32 sigmoid of b, times a scale of 1), so the rule sees the same bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ROWS = 32  # rows per program


@triton.jit
def prefill_gates_kernel(a_ptr, b_ptr, valid_ptr, a_out_ptr, beta_ptr, n_rows, stride_a, stride_b,
                         H: tl.constexpr, BLOCK_H: tl.constexpr, ROWS: tl.constexpr, MASKED: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    heads = tl.arange(0, BLOCK_H)
    inside = (rows < n_rows)[:, None] & (heads < H)[None, :]
    a = tl.load(a_ptr + rows[:, None] * stride_a + heads[None, :], mask=inside)
    b = tl.load(b_ptr + rows[:, None] * stride_b + heads[None, :], mask=inside).to(tl.float32)
    beta = tl.sigmoid(b)
    if MASKED:
        valid = tl.load(valid_ptr + rows, mask=rows < n_rows, other=0) != 0
        a = tl.where(valid[:, None], a, float("-inf"))
        beta = tl.where(valid[:, None], beta, 0.0)
    out = rows[:, None] * H + heads[None, :]
    tl.store(a_out_ptr + out, a, mask=inside)
    tl.store(beta_ptr + out, beta, mask=inside)


def prefill_gates(a: torch.Tensor, b: torch.Tensor, rows_valid: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """a, b [..., H] (unit stride along H; any stride between rows that flattens); rows_valid [...] bool or
    None (every row valid). Returns (a contiguous, -inf at invalid rows; beta fp32, 0 at invalid rows)."""
    H = a.shape[-1]
    a2, b2 = a.reshape(-1, H), b.reshape(-1, H)
    if a2.stride(-1) != 1 or b2.stride(-1) != 1:
        a2, b2 = a2.contiguous(), b2.contiguous()
    n = a2.shape[0]
    a_out = torch.empty(a.shape, dtype=a.dtype, device=a.device)
    beta = torch.empty(a.shape, dtype=torch.float32, device=a.device)
    valid = rows_valid.reshape(-1) if rows_valid is not None else a_out  # (unread when not masked)
    if n:
        prefill_gates_kernel[(triton.cdiv(n, ROWS),)](
            a2, b2, valid, a_out, beta, n, a2.stride(0), b2.stride(0),
            H=H, BLOCK_H=triton.next_power_of_2(H), ROWS=ROWS, MASKED=rows_valid is not None, num_warps=1)
    return a_out, beta


def prefill_gates_ref(a: torch.Tensor, b: torch.Tensor, rows_valid: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The same in torch."""
    beta = b.float().sigmoid()
    if rows_valid is None:
        return a.contiguous(), beta
    return torch.where(rows_valid[..., None], a, float("-inf")), torch.where(rows_valid[..., None], beta, 0.0)
