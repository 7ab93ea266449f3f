"""ops/rope: the one-launch RoPE kernel against the torch route, bit for bit (CPU under TRITON_INTERPRET=1, or
CUDA): partial rotation (rd < hd), the whole head, strided views of a projection's output, padded head counts."""

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction

from deltaflash.ops.rope.naive import apply_rope_ref
from deltaflash.ops.rope.rotary import apply_rope, rope_kernel

INTERPRETED = isinstance(rope_kernel, InterpretedFunction)
DEVICE = "cpu" if INTERPRETED else "cuda"
pytestmark = pytest.mark.skipif(not INTERPRETED and not torch.cuda.is_available(),
                                reason="kernel tests need TRITON_INTERPRET=1 before import, or CUDA")
HALF = torch.float16 if INTERPRETED else torch.bfloat16

CASES = [  # (leading dims, heads, head dim, rotary dims)
    ((2, 5), 4, 64, 16),
    ((1, 7), 3, 256, 64),    # the 9B shape's quarter rotation, an odd head count
    ((3, 1), 20, 32, 32),    # the whole head; more heads than one program's 16
    ((4,), 2, 128, 64),
]


def cos_sin(lead, rd, dtype, g):
    angles = torch.rand(*lead, rd // 2, generator=g) * 40.0
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos().to(dtype).to(DEVICE), emb.sin().to(dtype).to(DEVICE)


@pytest.mark.parametrize("lead,heads,hd,rd", CASES, ids=[f"{c[1]}x{c[2]}-rd{c[3]}" for c in CASES])
@pytest.mark.parametrize("dtype", [torch.float32, HALF], ids=["fp32", "half"])
def test_rope_matches_the_torch_route_bit_for_bit(lead, heads, hd, rd, dtype):
    g = torch.Generator().manual_seed(hd + rd)
    x = (torch.randn(*lead, heads, hd, generator=g) * 3).to(dtype).to(DEVICE)
    cos, sin = cos_sin(lead, rd, dtype, g)
    out, ref = apply_rope(x, cos, sin), apply_rope_ref(x, cos, sin)
    assert out.is_contiguous() and out.shape == ref.shape
    assert torch.equal(out, ref)


def test_rope_reads_strided_views_in_place():
    """q as the attention layer holds it: per head [q | gate] columns of one projection output."""
    g = torch.Generator().manual_seed(5)
    L, T, heads, hd, rd = 2, 3, 4, 64, 16
    merged = torch.randn(L, T, heads * 2 * hd, generator=g).to(DEVICE)
    q, _ = merged.unflatten(-1, (heads, 2 * hd)).chunk(2, dim=-1)
    assert not q.is_contiguous()
    cos, sin = cos_sin((L, T), rd, torch.float32, g)
    assert torch.equal(apply_rope(q, cos, sin), apply_rope_ref(q, cos, sin))


def test_rope_rejects_shapes_that_do_not_fit():
    x = torch.zeros(2, 3, 4, 16, device=DEVICE)
    with pytest.raises(ValueError, match="do not fit"):
        apply_rope(x, torch.zeros(2, 3, 18, device=DEVICE), torch.zeros(2, 3, 18, device=DEVICE))  # rd > hd
    with pytest.raises(ValueError, match="do not fit"):
        apply_rope(x, torch.zeros(3, 2, 8, device=DEVICE), torch.zeros(3, 2, 8, device=DEVICE))  # other rows
    with pytest.raises(ValueError, match="share a dtype"):
        apply_rope(x, torch.zeros(2, 3, 8, device=DEVICE, dtype=torch.float16),
                   torch.zeros(2, 3, 8, device=DEVICE, dtype=torch.float16))
