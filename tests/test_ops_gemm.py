"""ops/gemm: the batch-invariant linear against F.linear (CPU under TRITON_INTERPRET=1, or CUDA), and
a row's bits independent of the rows beside it."""

import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from triton.runtime.interpreter import InterpretedFunction

from deltaflash.core.request import SamplingParams
from deltaflash.models.layers import RoutedLinear
from deltaflash.ops.gemm.invariant import BM, invariant_linear, invariant_linear_kernel
from tests import bench_scripts
from tests.spec_pairs import engine_for, make_pair, prompts

INTERPRETED = isinstance(invariant_linear_kernel, InterpretedFunction)
DEVICE = "cpu" if INTERPRETED else "cuda"
pytestmark = pytest.mark.skipif(not INTERPRETED and not torch.cuda.is_available(),
                                reason="kernel tests need TRITON_INTERPRET=1 before import, or CUDA")
HALF = torch.float16 if INTERPRETED else torch.bfloat16  # the interpreter's bf16 tl.dot is wrong


def operands(M, K, N, dtype, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(DEVICE, dtype)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(DEVICE, dtype)
    b = torch.randn(N, generator=g).to(DEVICE, dtype) if bias else None
    return x, w, b


@pytest.mark.parametrize("M,K,N", [(1, 64, 64), (3, 48, 10), (70, 100, 130), (129, 64, 200)])
@pytest.mark.parametrize("dtype", [torch.float32, HALF], ids=["fp32", "half"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_matches_f_linear(M, K, N, dtype, bias):
    x, w, b = operands(M, K, N, dtype, bias)
    got = invariant_linear(x, w, b)
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    assert got.shape == (M, N) and got.dtype == dtype
    torch.testing.assert_close(got.float(), want, **tol)


def test_leading_dims_and_strided_rows():
    x, w, b = operands(24, 64, 32, torch.float32, True)
    x3 = x.view(2, 12, 64)
    torch.testing.assert_close(invariant_linear(x3, w, b), F.linear(x3, w, b), rtol=1e-5, atol=1e-5)
    wide = torch.randn(24, 128, device=DEVICE)[:, :64]  # rows with a stride
    torch.testing.assert_close(invariant_linear(wide, w), F.linear(wide, w), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="one dtype"):
        invariant_linear(x.half(), w)


@pytest.mark.parametrize("dtype", [torch.float32, HALF], ids=["fp32", "half"])
def test_a_rows_bits_do_not_depend_on_the_other_rows(dtype):
    """Rows of the first tile alone and among 200 rows of other values: the same bits (the GPU also
    for a row alone: under the interpreter numpy's BLAS rounds by a row's place in the tile)."""
    x, w, _ = operands(200, 96, 80, dtype, False)
    full = invariant_linear(x, w)
    first_tile = invariant_linear(x[:BM].contiguous(), w)
    assert torch.equal(first_tile, full[:BM])
    other = x.clone()
    other[BM:] = other[BM:].flip(0) * 3
    assert torch.equal(invariant_linear(other, w)[:BM], full[:BM])
    if not INTERPRETED:
        for i in (0, 5, 63, 64, 150):
            assert torch.equal(invariant_linear(x[i:i + 1].contiguous(), w)[0], full[i])


def test_an_engine_runs_its_products_batch_invariant():
    """EngineConfig.batch_invariant switches every product of the target (nn.Linear layers, merged
    projections, router, lm_head) to the kernel, and greedy speculative output still equals target-only."""
    with tempfile.TemporaryDirectory() as tmp:
        target, draft = make_pair(Path(tmp), kind="moe")
        plain = engine_for(target, max_model_len=64)
        batch = prompts(96, [5, 9, 3], seed=2)
        params = SamplingParams(max_new_tokens=12, ignore_eos=True)
        want = [c.token_ids for c in plain.generate(batch, params)[0]]
        spec = engine_for(target, draft, max_model_len=64, batch_invariant=True)
        model = spec.runner.model
        assert not any(type(m) is torch.nn.Linear for m in model.modules())
        assert any(isinstance(m, RoutedLinear) and m.product is invariant_linear for m in model.modules())
        assert model.linear is invariant_linear and model.layers[0].mlp.linear is invariant_linear
        assert [c.token_ids for c in spec.generate(batch, params)[0]] == want


@pytest.mark.parametrize("M", [1, 40, 96])
def test_bench_swiglu_gemm_matches_the_unfused_route(M):
    from deltaflash.ops.activation.naive import silu_mul_ref

    bench = bench_scripts.load("swiglu_gemm")
    x, w, _ = operands(M, 64, 128, HALF, False)
    tile = bench.SwigluTile(BM=32, BN=32, BK=32, warps=4, stages=2, group_m=2)
    got = bench.swiglu_gemm(x, w, tile)
    gate, up = F.linear(x.float(), w.float()).to(HALF).split(64, dim=-1)
    assert got.shape == (M, 64)
    torch.testing.assert_close(got.float(), silu_mul_ref(gate, up).float(), rtol=2e-2, atol=2e-2)
    persistent = bench.swiglu_gemm(x, w, bench.dataclasses.replace(tile, persistent=True))
    assert torch.equal(persistent, got)  # the same tiles, walked by fewer programs
    with pytest.raises(ValueError, match="multiple of BN"):
        bench.swiglu_gemm(x, w[:96], tile)
