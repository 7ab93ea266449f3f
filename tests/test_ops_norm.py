"""ops/norm kernels against their torch references: on CPU under TRITON_INTERPRET=1, or on CUDA."""

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction

from deltaflash.ops.norm.naive import gated_rms_norm_ref, plain_rms_norm_ref, zero_centered_rms_norm_ref
from deltaflash.ops.norm.rms_norm import gated_rms_norm, plain_rms_norm, rms_norm_kernel, zero_centered_rms_norm

INTERPRETED = isinstance(rms_norm_kernel, InterpretedFunction)
DEVICE = "cpu" if INTERPRETED else "cuda"
pytestmark = pytest.mark.skipif(not INTERPRETED and not torch.cuda.is_available(),
                                reason="kernel tests need TRITON_INTERPRET=1 before import, or CUDA")

# Triton 3.6's interpreter rounds fp32 -> bf16 otherwise than torch does: bf16 bits are checked on CUDA only
HALF = torch.float16 if INTERPRETED else torch.bfloat16
CASES = [(5, torch.float32), (64, torch.float32), (96, torch.bfloat16), (256, torch.bfloat16)]


def tolerance(dtype):
    """bf16: the gated norm rounds three times (normed, times w, times the gate), each may flip an ulp
    (0.4-0.8%) when the fp32 sums differ in their last bit."""
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=3e-2, atol=1e-2)


@pytest.mark.parametrize("D,dtype", CASES)
def test_zero_centered_norm_matches_ref_on_strided_rows(D, dtype):
    g = torch.Generator().manual_seed(D)
    both = (torch.randn(3, 4, 2, 2 * D, generator=g) * 3).to(dtype).to(DEVICE)
    x = both.chunk(2, dim=-1)[0]  # rows of D with stride 2D, as attention's q beside its gate
    w = (0.1 * torch.randn(D, generator=g)).to(dtype).to(DEVICE)
    y = zero_centered_rms_norm(x, w, 1e-6)
    assert y.shape == x.shape and y.dtype == dtype
    torch.testing.assert_close(y, zero_centered_rms_norm_ref(x, w, 1e-6), **tolerance(dtype))


@pytest.mark.parametrize("D,dtype", CASES)
def test_norm_reads_head_rows_in_place_from_projection_columns(D, dtype):
    """Attention's q and k are heads of a column slice of the merged projection ([L, T, H, D], token stride
    wider than H * D, q's heads 2D apart beside their gates): their rows are read where they are, with
    the bits of a contiguous copy's norm."""
    g = torch.Generator().manual_seed(D + 5)
    L, T, H = 2, 5, 3
    projection = (3 * torch.randn(L, T, 2 * H * D + 2 * D + 7, generator=g)).to(dtype).to(DEVICE)
    q = projection[..., :2 * H * D].unflatten(-1, (H, 2 * D))[..., :D]  # heads of [q | gate]
    k = projection[..., 2 * H * D + 4:2 * H * D + 4 + 2 * D].unflatten(-1, (2, D))  # 2 heads, then 3 more columns
    w = (0.1 * torch.randn(D, generator=g)).to(dtype).to(DEVICE)
    for x in (q, k):
        y = zero_centered_rms_norm(x, w, 1e-6)
        assert y.shape == x.shape and y.is_contiguous()
        assert torch.equal(y, zero_centered_rms_norm(x.contiguous(), w, 1e-6))
        torch.testing.assert_close(y, zero_centered_rms_norm_ref(x, w, 1e-6), **tolerance(dtype))


@pytest.mark.parametrize("D,dtype", CASES)
def test_gated_norm_matches_ref(D, dtype):
    g = torch.Generator().manual_seed(D + 1)
    x = torch.randn(2, 5, 3, D, generator=g).to(dtype).to(DEVICE)
    z = (2 * torch.randn(2, 5, 3 * D, generator=g)).to(dtype).unflatten(-1, (3, D)).to(DEVICE)
    w = (1 + 0.1 * torch.randn(D, generator=g)).to(dtype).to(DEVICE)
    y = gated_rms_norm(x, z, w, 1e-6)
    assert y.shape == x.shape and y.dtype == dtype
    torch.testing.assert_close(y, gated_rms_norm_ref(x, z, w, 1e-6), **tolerance(dtype))


@pytest.mark.parametrize("D,dtype", CASES)
def test_plain_norm_matches_ref_and_the_drafters_module(D, dtype):
    """The drafter's plain norm (w * normed.to(dtype)) in one launch: the reference's value, on strided
    per-head rows, and the drafter's RMSNorm module gives the same through its op as through torch."""
    from deltaflash.models.dflash import RMSNorm

    g = torch.Generator().manual_seed(D + 3)
    x = (3 * torch.randn(2, 5, 3, 2 * D, generator=g)).to(dtype).to(DEVICE)[..., :D]  # strided rows
    w = (1 + 0.1 * torch.randn(D, generator=g)).to(dtype).to(DEVICE)
    y = plain_rms_norm(x, w, 1e-6)
    assert y.shape == x.shape and y.dtype == dtype
    want = plain_rms_norm_ref(x, w, 1e-6)
    torch.testing.assert_close(y, want, **tolerance(dtype))
    module = RMSNorm(D, 1e-6).to(DEVICE)
    with torch.no_grad():
        module.weight.copy_(w.float())
    module = module.to(dtype)
    assert torch.equal(module(x), want)  # torch's ops: the reference, to the bit
    module.op = plain_rms_norm
    assert torch.equal(module(x), y)


def test_the_drafters_rope_is_the_kernels_to_the_bit():
    """The drafter rotates whole heads; ops/rope's kernel with rd = hd gives its torch route's bits (in
    half precision fp16 under the interpreter, whose numpy products do not round bf16 as torch does;
    bf16 on CUDA)."""
    from deltaflash.models.dflash import apply_rope as drafter_rope
    from deltaflash.ops.rope.rotary import apply_rope

    g = torch.Generator().manual_seed(5)
    for dtype in (torch.float32, torch.float16 if INTERPRETED else torch.bfloat16):
        x = torch.randn(2, 5, 3, 64, generator=g).to(dtype).to(DEVICE)
        angles = torch.randn(2, 5, 32, generator=g)
        cos, sin = (torch.cat([t, t], -1).to(dtype).to(DEVICE) for t in (angles.cos(), angles.sin()))
        assert torch.equal(apply_rope(x, cos, sin), drafter_rope(x, cos, sin))


@pytest.mark.parametrize("D,dtype", CASES)
def test_gated_norm_reads_the_gate_in_place_from_projection_columns(D, dtype):
    """The GDN gate z is a column slice of the merged projection, [L, T, H, D] with a token stride wider
    than H * D: its rows are read where they are (no copy), with the same result as from a copy."""
    g = torch.Generator().manual_seed(D + 2)
    L, T, H = 2, 5, 3
    projection = (2 * torch.randn(L, T, 7 + H * D + 4, generator=g)).to(dtype).to(DEVICE)
    z = projection[..., 7:7 + H * D].unflatten(-1, (H, D))
    x = torch.randn(L, T, H, D, generator=g).to(dtype).to(DEVICE)
    w = (1 + 0.1 * torch.randn(D, generator=g)).to(dtype).to(DEVICE)
    y = gated_rms_norm(x, z, w, 1e-6)
    assert torch.equal(y, gated_rms_norm(x, z.contiguous(), w, 1e-6))
    torch.testing.assert_close(y, gated_rms_norm_ref(x, z, w, 1e-6), **tolerance(dtype))


@pytest.mark.parametrize("D", [5, 128, 256])
def test_a_rows_bits_do_not_depend_on_how_many_rows_the_call_has(D):
    """Narrow rows go several to a program (rows_per_program): any row count - a ragged last program
    too - gives each row the bits it gets alone (batch invariance), for the plain, the gated and the
    residual norms."""
    from deltaflash.ops.norm.rms_norm import add_rms_norm, rows_per_program

    g = torch.Generator().manual_seed(D + 4)
    R = 3 * rows_per_program(D) + 1
    x, z, r = ((3 * torch.randn(R, D, generator=g)).to(HALF).to(DEVICE) for _ in range(3))
    w = (1 + 0.1 * torch.randn(D, generator=g)).to(HALF).to(DEVICE)
    whole = (zero_centered_rms_norm(x, w, 1e-6), gated_rms_norm(x, z, w, 1e-6), *add_rms_norm(x, r, w, 1e-6))
    assert rows_per_program(D) > 1 or D > 2048
    for rows in (slice(0, 1), slice(R - 1, R), slice(1, R - 2)):
        part = (zero_centered_rms_norm(x[rows], w, 1e-6), gated_rms_norm(x[rows], z[rows], w, 1e-6),
                *add_rms_norm(x[rows], r[rows], w, 1e-6))
        for got, want in zip(part, whole):
            assert torch.equal(got, want[rows])
    torch.testing.assert_close(whole[0], zero_centered_rms_norm_ref(x, w, 1e-6), **tolerance(HALF))
    torch.testing.assert_close(whole[1], gated_rms_norm_ref(x, z, w, 1e-6), **tolerance(HALF))


def test_empty_input_and_bad_weight():
    assert zero_centered_rms_norm(torch.empty(0, 8, device=DEVICE), torch.zeros(8, device=DEVICE), 1e-6).shape == (0, 8)
    with pytest.raises(ValueError, match="weight must be"):
        zero_centered_rms_norm(torch.randn(2, 8), torch.zeros(4), 1e-6)
    with pytest.raises(ValueError, match="gate must be"):
        gated_rms_norm(torch.randn(2, 8), torch.randn(2, 4), torch.ones(8), 1e-6)


@pytest.mark.parametrize("I,dtype", [(1500, torch.float32), (2048, torch.bfloat16), (7, torch.bfloat16)])
def test_silu_mul_matches_ref_on_column_views(I, dtype):
    """SwiGLU's activation (ops/activation) on the two column views of one merged projection: the same
    bits as the torch route on a GPU (README: same roundings); under the interpreter bf16 casts may land
    an ulp off at each of the two roundings."""
    from deltaflash.ops.activation.naive import silu_mul_ref
    from deltaflash.ops.activation.silu_mul import silu_mul

    g = torch.Generator().manual_seed(I)
    merged = (torch.randn(3, 5, 2 * I, generator=g) * 4).to(dtype).to(DEVICE)
    gate, up = merged[..., :I], merged[..., I:]
    out, ref = silu_mul(gate, up), silu_mul_ref(gate, up)
    assert out.shape == ref.shape and out.dtype == dtype and out.is_contiguous()
    if DEVICE == "cuda":
        assert torch.equal(out, ref), f"max diff {(out.float() - ref.float()).abs().max()}"
    else:
        torch.testing.assert_close(out, ref, **(dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else
                                                dict(rtol=2e-2, atol=2e-2)))


@pytest.mark.parametrize("L,T,H,D,dtype", [(2, 3, 4, 64, torch.float32), (1, 5, 16, 256, torch.bfloat16),
                                             (3, 2, 3, 40, torch.bfloat16)])
def test_sigmoid_gate_matches_ref_on_the_projections_strided_gate(L, T, H, D, dtype):
    """Gated attention's output gate (ops/activation/sigmoid_gate.py): x * sigmoid(gate), the gate read in
    place from the query projection's per-head [q | gate] columns and x a transposed view; the heads merged.
    The same bits as the torch route on a GPU; under the interpreter bf16 casts may land an ulp off."""
    from deltaflash.ops.activation.naive import sigmoid_gate_ref
    from deltaflash.ops.activation.sigmoid_gate import sigmoid_gate

    g = torch.Generator().manual_seed(H * D)
    projection = (torch.randn(L, T, H, 2 * D, generator=g) * 4).to(dtype).to(DEVICE)
    gate = projection[..., D:]
    x = torch.randn(L, H, T, D, generator=g).to(dtype).to(DEVICE).transpose(1, 2)
    out, ref = sigmoid_gate(x, gate), sigmoid_gate_ref(x, gate)
    assert out.shape == ref.shape == (L, T, H * D) and out.dtype == dtype and out.is_contiguous()
    if DEVICE == "cuda":
        assert torch.equal(out, ref), f"max diff {(out.float() - ref.float()).abs().max()}"
    else:
        torch.testing.assert_close(out, ref, **(dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else
                                                dict(rtol=2e-2, atol=2e-2)))
    with pytest.raises(ValueError, match="must be one"):
        sigmoid_gate(x, gate[:, :1])
    with pytest.raises(ValueError, match="unit feature stride"):
        sigmoid_gate(projection[..., ::2], gate)


@pytest.mark.parametrize("D,dtype", [(5, torch.float32), (96, HALF), (256, HALF)])
def test_add_and_norm_is_the_add_then_the_norm(D, dtype):
    """kernels.add_rms_norm: the sum is the torch add's bits, its norm the norm kernel's bits of that sum
    (so fusing the residual add changes nothing), close to the reference; y is left as it was."""
    from deltaflash.ops.norm.naive import add_rms_norm_ref
    from deltaflash.ops.norm.rms_norm import add_rms_norm

    g = torch.Generator().manual_seed(D + 2)
    x = (3 * torch.randn(2, 7, D, generator=g)).to(dtype).to(DEVICE)
    y = torch.randn(2, 7, D, generator=g).to(dtype).to(DEVICE)
    w = (0.1 * torch.randn(D, generator=g)).to(dtype).to(DEVICE)
    kept = y.clone()
    total, normed = add_rms_norm(x, y, w, 1e-6)
    assert torch.equal(total, x + y) and torch.equal(y, kept)
    assert torch.equal(normed, zero_centered_rms_norm(x + y, w, 1e-6))
    want_total, want_normed = add_rms_norm_ref(x, y, w, 1e-6)
    assert torch.equal(total, want_total)
    torch.testing.assert_close(normed, want_normed, **tolerance(dtype))
    with pytest.raises(ValueError, match="do not fit"):
        add_rms_norm(x, y[:, :3], w, 1e-6)
