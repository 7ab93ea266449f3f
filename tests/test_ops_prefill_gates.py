"""ops/gdn/prefill_gates: the chunked rule's gate inputs in one launch against the torch route (CPU under
TRITON_INTERPRET=1, or CUDA): a copied and beta = sigmoid(b) in fp32 from strided views of a projection, with
and without a fixed-shape batch's padding rows; on CUDA, beta bit for bit fla-core's own sigmoid kernel and
the chunked rule's outputs those of fla-core computing beta itself."""

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction

from deltaflash.ops.gdn.prefill_gates import prefill_gates, prefill_gates_kernel, prefill_gates_ref

INTERPRETED = isinstance(prefill_gates_kernel, InterpretedFunction)
DEVICE = "cpu" if INTERPRETED else "cuda"
pytestmark = pytest.mark.skipif(not INTERPRETED and not torch.cuda.is_available(),
                                reason="kernel tests need TRITON_INTERPRET=1 before import, or CUDA")
HALF = torch.float16 if INTERPRETED else torch.bfloat16  # (the interpreter has no bf16 constants)


def projection(lead, H, g, dtype=HALF):
    """b and a as column views of a wider projection output [..., 3 H + 5] (b, a adjacent, as in a GDN layer)."""
    x = (torch.randn(*lead, 3 * H + 5, generator=g) * 4).to(dtype).to(DEVICE)
    return x[..., H + 5:2 * H + 5], x[..., H:2 * H]  # a, b


@pytest.mark.parametrize("lead,H", [((3, 70), 32), ((1, 33), 6), ((100,), 48), ((2, 1), 1)])
@pytest.mark.parametrize("masked", [False, True])
def test_prefill_gates_equal_the_torch_route(lead, H, masked):
    g = torch.Generator().manual_seed(H)
    a, b = projection(lead, H, g)
    valid = None
    if masked:  # each lane's first rows valid (a 1-D batch: any pattern)
        valid = (torch.rand(*lead, generator=g) < 0.6).to(DEVICE)
        if len(lead) == 2:
            valid = torch.arange(lead[1])[None] < torch.randint(0, lead[1] + 1, (lead[0], 1), generator=g)
            valid = valid.to(DEVICE)
    a_out, beta = prefill_gates(a, b, valid)
    a_ref, beta_ref = prefill_gates_ref(a, b, valid)
    assert a_out.shape == a.shape and a_out.is_contiguous() and a_out.dtype == a.dtype
    assert beta.shape == a.shape and beta.dtype == torch.float32
    assert torch.equal(a_out, a_ref)
    torch.testing.assert_close(beta, beta_ref, rtol=1e-6, atol=1e-7)
    if masked:  # padding rows inert: a = -inf, beta exactly 0
        assert torch.isneginf(a_out[~valid]).all() and not beta[~valid].any()
        assert torch.equal(a_out[valid], a[valid])


def test_prefill_gates_of_no_rows():
    a, b = projection((0,), 4, torch.Generator().manual_seed(0))
    a_out, beta = prefill_gates(a, b, torch.zeros(0, dtype=torch.bool, device=DEVICE))
    assert a_out.shape == beta.shape == (0, 4)


@pytest.mark.skipif(INTERPRETED or not torch.cuda.is_available(), reason="fla-core's kernels need CUDA")
def test_beta_and_the_chunked_rule_equal_fla_cores_own_on_cuda():
    """beta bit for bit fla-core's fused_beta_sigmoid; the chunked rule given it (and a made contiguous) gives
    the outputs and final state of fla-core computing beta from the raw b itself."""
    pytest.importorskip("fla")
    from fla.ops.common.gate import fused_beta_sigmoid_fwd
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    from deltaflash.ops.gdn.chunk import l2_normalize

    g = torch.Generator().manual_seed(1)
    T, Hk, H, d = 200, 2, 4, 64
    a, b = projection((1, T), H, g)
    _, beta = prefill_gates(a, b)
    assert torch.equal(beta, fused_beta_sigmoid_fwd(b.contiguous()))
    q, k = (l2_normalize(torch.randn(1, T, Hk, d, generator=g)).to(torch.bfloat16).cuda() for _ in range(2))
    v = torch.randn(1, T, H, d, generator=g).to(torch.bfloat16).cuda()
    A_log, dt_bias = (torch.randn(H, generator=g).cuda() * 0.1 for _ in range(2))
    state = torch.randn(1, H, d, d, generator=g).cuda() * 0.1
    common = dict(scale=d ** -0.5, initial_state=state, output_final_state=True, use_gate_in_kernel=True,
                  A_log=A_log, dt_bias=dt_bias)
    a_in, beta = prefill_gates(a, b)
    ours = chunk_gated_delta_rule(q, k, v, a_in, beta, use_beta_sigmoid_in_kernel=False, **common)
    theirs = chunk_gated_delta_rule(q, k, v, a, b, use_beta_sigmoid_in_kernel=True, **common)
    for x, y in zip(ours, theirs):
        assert torch.equal(x, y)
