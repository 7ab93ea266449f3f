"""ops/norm kernels against their torch references: on CPU under TRITON_INTERPRET=1, or on CUDA."""

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction

from deltaflash.ops.norm.naive import gated_rms_norm_ref, zero_centered_rms_norm_ref
from deltaflash.ops.norm.rms_norm import gated_rms_norm, rms_norm_kernel, zero_centered_rms_norm

INTERPRETED = isinstance(rms_norm_kernel, InterpretedFunction)
DEVICE = "cpu" if INTERPRETED else "cuda"
pytestmark = pytest.mark.skipif(not INTERPRETED and not torch.cuda.is_available(),
                                reason="kernel tests need TRITON_INTERPRET=1 before import, or CUDA")

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
def test_gated_norm_matches_ref(D, dtype):
    g = torch.Generator().manual_seed(D + 1)
    x = torch.randn(2, 5, 3, D, generator=g).to(dtype).to(DEVICE)
    z = (2 * torch.randn(2, 5, 3 * D, generator=g)).to(dtype).unflatten(-1, (3, D)).to(DEVICE)
    w = (1 + 0.1 * torch.randn(D, generator=g)).to(dtype).to(DEVICE)
    y = gated_rms_norm(x, z, w, 1e-6)
    assert y.shape == x.shape and y.dtype == dtype
    torch.testing.assert_close(y, gated_rms_norm_ref(x, z, w, 1e-6), **tolerance(dtype))


def test_empty_input_and_bad_weight():
    assert zero_centered_rms_norm(torch.empty(0, 8, device=DEVICE), torch.zeros(8, device=DEVICE), 1e-6).shape == (0, 8)
    with pytest.raises(ValueError, match="weight must be"):
        zero_centered_rms_norm(torch.randn(2, 8), torch.zeros(4), 1e-6)
    with pytest.raises(ValueError, match="gate must be"):
        gated_rms_norm(torch.randn(2, 8), torch.randn(2, 4), torch.ones(8), 1e-6)
