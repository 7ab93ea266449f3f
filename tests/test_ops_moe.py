"""ops/moe: the Triton grouped GEMM against the torch reference (CPU under TRITON_INTERPRET=1, or
CUDA), the reference against a per-token float64 loop, and neither path syncing with the host."""

import sys
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from triton.runtime.interpreter import InterpretedFunction

from deltaflash.models import layers
from deltaflash.ops.kernels import reference_kernels, triton_kernels
from deltaflash.ops.moe.fused_moe import (fused_moe_experts, group_pairs_by_expert, moe_gate_up_kernel,
                                          moe_tiles, rows_bound)
from deltaflash.ops.moe.naive import moe_experts_ref

INTERPRETED = isinstance(moe_gate_up_kernel, InterpretedFunction)
DEVICE = "cpu" if INTERPRETED else "cuda"
needs_kernels = pytest.mark.skipif(not INTERPRETED and not torch.cuda.is_available(),
                                   reason="kernel tests need TRITON_INTERPRET=1 before import, or CUDA")

# (N, E, k, H, I): N = 1, 5, 12, 37, and 70 pairs-heavy enough for the 64-row tiles.
SHAPES = [(1, 4, 1, 48, 40), (5, 8, 2, 64, 32), (12, 4, 3, 48, 40), (37, 8, 2, 64, 32), (37, 8, 3, 48, 40),
          (70, 4, 2, 64, 32)]
ROUTINGS = ["random", "same", "alternating"]


def routing(N: int, E: int, k: int, kind: str, g: torch.Generator) -> torch.Tensor:
    """topk_ids [N, k], distinct per token. "same": every token to experts E-1, ..., E-k (duplicate
    patterns, the other experts get no token, one expert may fill several blocks); "alternating":
    two patterns by token parity; "random": any k experts."""
    if kind == "same":
        return torch.arange(E - 1, E - 1 - k, -1).expand(N, k).clone()
    if kind == "alternating":
        return torch.stack([torch.arange(k) * 2 + n % 2 for n in range(N)]) % E
    return torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])


def make_inputs(N, E, k, H, I, kind, dtype=torch.float32, device=DEVICE, seed=0):
    g = torch.Generator().manual_seed(seed + 131 * N + 7 * E + k)
    x = torch.randn(N, H, generator=g)
    weights = torch.softmax(torch.randn(N, k, generator=g), -1)
    gate_up = torch.randn(E, 2 * I, H, generator=g) / H ** 0.5
    down = torch.randn(E, H, I, generator=g) / I ** 0.5
    ids = routing(N, E, k, kind, g)
    return (x.to(device, dtype), weights.to(device, dtype), ids.to(device), gate_up.to(device, dtype),
            down.to(device, dtype))


@pytest.fixture
def nan_scratch(monkeypatch):
    """The kernel path's scratch (the activations [R, I] and the per-pair outputs [N*k, H]) comes
    from torch.empty: fill it with NaN so a row the kernels fail to write shows in the result."""
    empty = torch.empty

    def nan_empty(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", nan_empty)


@needs_kernels
@pytest.mark.parametrize("kind", ROUTINGS)
@pytest.mark.parametrize("N,E,k,H,I", SHAPES)
def test_kernel_matches_ref_fp32(N, E, k, H, I, kind, nan_scratch):
    args = make_inputs(N, E, k, H, I, kind)
    out = fused_moe_experts(*args)
    assert out.shape == (N, H) and out.dtype == torch.float32
    torch.testing.assert_close(out, moe_experts_ref(*args), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(INTERPRETED or not torch.cuda.is_available(),
                    reason="bf16 needs CUDA: the Triton 3.6 interpreter's tl.dot multiplies bf16 bit patterns as ints")
@pytest.mark.parametrize("kind", ROUTINGS)
@pytest.mark.parametrize("N,E,k,H,I", SHAPES + [(300, 8, 2, 256, 128)])
def test_kernel_matches_ref_bf16(N, E, k, H, I, kind, nan_scratch):
    """Same roundings as the reference (gate, up, silu, product, down, weight); the fp32 sums and the
    order of the sum over k differ, so an output may be a few bf16 ulps off."""
    args = make_inputs(N, E, k, H, I, kind, dtype=torch.bfloat16)
    out = fused_moe_experts(*args)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, moe_experts_ref(*args), rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(INTERPRETED or not torch.cuda.is_available(),
                    reason="needs CUDA: under the interpreter numpy's BLAS rounds by a row's place in the tile")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tokens_bits_do_not_depend_on_the_batch(dtype):
    """A token's output is the same bits in a decode-sized batch (16-row blocks) and in a verify-sized
    one past the block-size threshold (64-row blocks), as speculative == target-only greedy needs."""
    E, k, H, I = 4, 2, 64, 32
    x, w, ids, gate_up, down = make_inputs(200, E, k, H, I, "random", dtype=dtype)
    assert moe_tiles(3 * k, E, dtype)[0] != moe_tiles(200 * k, E, dtype)[0]
    big = fused_moe_experts(x, w, ids, gate_up, down)
    for i in range(0, 200, 37):
        small = fused_moe_experts(x[i:i + 3], w[i:i + 3], ids[i:i + 3], gate_up, down)
        assert torch.equal(small, big[i:i + 3])


@needs_kernels
@pytest.mark.parametrize("kind", ROUTINGS)
@pytest.mark.parametrize("N,E,k", [(1, 4, 1), (12, 4, 3), (37, 8, 2), (70, 4, 2)])
@pytest.mark.parametrize("BM", [16, 64])
def test_pairs_grouped_by_expert_in_padded_blocks(N, E, k, kind, BM):
    ids = routing(N, E, k, kind, torch.Generator().manual_seed(N)).to(DEVICE)
    blocks = group_pairs_by_expert(ids, E, BM)
    R = rows_bound(N * k, E, BM)
    assert blocks.pair_ids.shape == (R,) and blocks.block_expert.shape == (R // BM,)
    pair_ids, block_expert = blocks.pair_ids.cpu(), blocks.block_expert.cpu()
    live = pair_ids[pair_ids >= 0]
    assert sorted(live.tolist()) == list(range(N * k))  # every pair exactly once
    row_expert = block_expert.repeat_interleave(BM)
    assert torch.equal(ids.cpu().reshape(-1)[live], row_expert[pair_ids >= 0])  # rows sit in their expert's blocks
    routed = block_expert[block_expert < E]
    assert torch.equal(routed, torch.sort(routed).values)  # experts in order, blocks past the total last
    assert (block_expert[len(routed):] == E).all() and (pair_ids[len(routed) * BM:] == -1).all()
    assert len(routed) == sum(-(-c // BM) for c in torch.bincount(ids.cpu().reshape(-1), minlength=E).tolist())


def test_rows_bound_covers_every_routing():
    assert rows_bound(5, 8, 16) == 5 * 16  # each pair on an expert of its own reaches the bound
    assert rows_bound(100, 8, 16) == 224  # 100 + 8 * 15 = 220 rows, in whole blocks
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        P, E = int(torch.randint(1, 200, (1,), generator=g)), int(torch.randint(1, 64, (1,), generator=g))
        skew = torch.rand(E, generator=g) ** 8  # from nearly uniform to nearly all on one expert
        counts = torch.bincount(torch.multinomial(skew + 1e-9, P, replacement=True, generator=g), minlength=E)
        for BM in (16, 64):
            assert sum(-(-c // BM) * BM for c in counts.tolist()) <= rows_bound(P, E, BM)


@pytest.mark.parametrize("N,E,k,H,I", [(1, 4, 1, 48, 40), (12, 4, 3, 48, 40), (37, 8, 2, 64, 32)])
def test_ref_matches_per_token_float64_loop(N, E, k, H, I):
    x, weights, ids, gate_up, down = make_inputs(N, E, k, H, I, "random", device="cpu")
    expected = torch.zeros(N, H, dtype=torch.float64)
    for n in range(N):
        for j in range(k):
            e = ids[n, j]
            gate, up = (gate_up[e].double() @ x[n].double()).split(I)
            expected[n] += weights[n, j].double() * (down[e].double() @ (F.silu(gate) * up))
    torch.testing.assert_close(moe_experts_ref(x, weights, ids, gate_up, down).double(), expected,
                               rtol=1e-5, atol=1e-5)


@pytest.fixture
def host_syncs(monkeypatch):
    """Counts calls of the Tensor methods that read device data on the host. Calls from Triton's own
    modules are not counted: the interpreter copies tensors to the host to emulate the device."""
    calls = []
    for name in ("item", "tolist", "cpu", "__bool__", "__int__", "__float__", "nonzero"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            if not sys._getframe(1).f_globals.get("__name__", "").startswith("triton"):
                calls.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return calls


@needs_kernels
@pytest.mark.parametrize("path", ["reference", "kernel"])
def test_no_host_sync(path, host_syncs):
    args = make_inputs(12, 8, 3, 48, 40, "random")
    assert host_syncs == []
    (moe_experts_ref if path == "reference" else fused_moe_experts)(*args)
    assert host_syncs == []
    bool(args[0][0, 0])  # the counter works
    assert host_syncs == ["__bool__"]


@needs_kernels
def test_sparse_moe_layer_runs_the_kernel_set_it_is_given():
    torch.manual_seed(0)
    moe = layers.SparseMoE(hidden=48, num_experts=8, top_k=2, intermediate=40, shared_intermediate=32).to(DEVICE)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.1)
    moe.shared_expert.merge_projections()
    x = torch.randn(3, 5, 48, device=DEVICE)
    calls = []
    fused = replace(triton_kernels(), moe_experts=lambda *a: calls.append(1) or fused_moe_experts(*a))
    out = moe(x, fused)
    assert calls == [1] and out.shape == x.shape
    torch.testing.assert_close(out, moe(x, reference_kernels()), rtol=1e-5, atol=1e-5)


def test_bad_arguments_raise():
    x, weights, ids, gate_up, down = make_inputs(5, 4, 2, 48, 40, "random", device="cpu")
    with pytest.raises(ValueError, match="x must be"):
        fused_moe_experts(x[None], weights, ids, gate_up, down)
    with pytest.raises(ValueError, match="gate_up_proj must be"):
        fused_moe_experts(x, weights, ids, gate_up[:, :, :40], down)
    with pytest.raises(ValueError, match="down_proj must be"):
        fused_moe_experts(x, weights, ids, gate_up, down[:, :, :8])
    with pytest.raises(ValueError, match="topk_ids must be"):
        fused_moe_experts(x, weights, ids.int(), gate_up, down)
    with pytest.raises(ValueError, match="topk_weights must be"):
        fused_moe_experts(x, weights[:, :1], ids, gate_up, down)
    with pytest.raises(ValueError, match="down_proj must be torch.float32"):
        fused_moe_experts(x, weights, ids, gate_up, down.double())
    assert fused_moe_experts(x[:0], weights[:0], ids[:0], gate_up, down).shape == (0, 48)
