"""Verify-route Triton kernels on CUDA against the torch references (skips without CUDA).

The fused route and the unfused route are bit-identical on a GPU; the GDN recurrence of both is a kernel
whose arithmetic the pure-torch references match to fp32 tolerance (contract in
deltaflash/ops/gdn/README.md). Tolerance checks run first so a failure shows how far off it is."""

import os
from types import SimpleNamespace

import pytest
import torch

from deltaflash.core.batch import CommitPlan
from deltaflash.ops.kernels import reference_kernels, triton_kernels
from tests.test_ops_verify import path_plan, random_tree_parents, root_path

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DEV = "cuda"
K_CONV = 4


@pytest.fixture(scope="module")
def ops():
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("TRITON_INTERPRET is set: the kernels would be interpreted, not run on the GPU")
    from deltaflash.ops.conv.naive import conv_commit_ref, conv_tree_step_ref
    from deltaflash.ops.conv.tree_step import conv_tree_step
    from deltaflash.ops.gdn.commit import conv_commit, replay_commit
    from deltaflash.ops.gdn.naive import gdn_verify_ref, replay_commit_ref
    from deltaflash.ops.gdn.verify import gdn_verify, gdn_verify_unfused

    return SimpleNamespace(**locals())


def make_gdn(L, W, nk, nv, dk, dv, S=8, G=2, dtype=torch.bfloat16, seed=0):
    """a, b and q, k, v are strided views of bigger projections; lane 1 is padding; slots permuted."""
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    qkv = rnd(L, W, 2 * nk * dk + nv * dv).to(dtype).to(DEV)
    ba = (rnd(L, W, 3 * nv) * 2).to(dtype).to(DEV)
    slots = torch.tensor([5, -1, 2, 7, 0, 3, 1, 6][:L], dtype=torch.int32, device=DEV)
    return dict(q=qkv[..., :nk * dk].unflatten(-1, (nk, dk)), k=qkv[..., nk * dk:2 * nk * dk].unflatten(-1, (nk, dk)),
                v=qkv[..., 2 * nk * dk:].unflatten(-1, (nv, dv)), b=ba[..., :nv], a=ba[..., 2 * nv:],
                A_log=(rnd(nv) * 0.5).to(DEV), dt_bias=rnd(nv).to(DEV), pool=(rnd(S, G, nv, dk, dv) * 0.3).to(DEV),
                layer=1, slots=slots)


def chain_parents(L, W):
    return (torch.arange(W, device=DEV) - 1).expand(L, W).contiguous()


def tree_parents(L, W, seed, forest=False):
    return random_tree_parents(L, W, seed, forest).to(DEV)


def verify_args(p, parents):
    return (p["q"], p["k"], p["v"], p["a"], p["b"], p["A_log"], p["dt_bias"], p["pool"][:, p["layer"]],
            p["slots"], parents)


def run_verify(ops, p, parents, route="gdn_verify"):
    L, W, _, dk = p["q"].shape
    nv, dv = p["v"].shape[2:]
    o = torch.full((L, W, nv, dv), float("nan"), dtype=p["q"].dtype, device=DEV)
    log = torch.full((L, W, nv, 1 + dk + dv), float("nan"), device=DEV)
    return getattr(ops, route)(*verify_args(p, parents), out=o, replay_log_out=log)


@pytest.mark.parametrize("L,W,nk,nv,dk,dv,tree", [
    (3, 1, 2, 4, 128, 128, False), (4, 5, 2, 4, 128, 128, True), (4, 12, 1, 3, 64, 96, True),
    (8, 16, 2, 4, 128, 128, False), (3, 16, 2, 4, 128, 128, True), (2, 32, 1, 2, 128, 128, True),
    (3, 16, 2, 4, 128, 128, "forest")])
def test_gdn_verify_kernel_matches_ref_and_never_writes_state(ops, L, W, nk, nv, dk, dv, tree):
    p = make_gdn(L, W, nk, nv, dk, dv, seed=W)
    parents = tree_parents(L, W, seed=W, forest=tree == "forest") if tree else chain_parents(L, W)
    before = p["pool"].clone()
    o, log = run_verify(ops, p, parents)
    torch.cuda.synchronize()
    assert torch.equal(p["pool"], before), "verify wrote the recurrent state"
    o_ref, log_ref = ops.gdn_verify_ref(*verify_args(p, parents))
    assert not o.isnan().any() and not log.isnan().any(), "unwritten output"
    torch.testing.assert_close(log, log_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(o.float(), o_ref.float(), rtol=2e-2, atol=2e-2)
    assert torch.equal(log[..., 0], log_ref[..., 0]), "gamma differs from torch's exp / softplus"
    assert torch.equal(log[..., 1:1 + dk], log_ref[..., 1:1 + dk]), "k in the log is not k as given"
    o_un, log_un = run_verify(ops, p, parents, "gdn_verify_unfused")
    assert torch.equal(log, log_un), "replay log differs from the unfused route"
    assert torch.equal(o, o_un), "o differs from the unfused route"


def test_gdn_verify_kernel_fp32_matches_ref_and_bitwise_equals_unfused(ops):
    p = make_gdn(3, 8, 2, 4, 128, 128, dtype=torch.float32, seed=3)
    parents = tree_parents(3, 8, seed=4)
    o, log = run_verify(ops, p, parents)
    o_ref, log_ref = ops.gdn_verify_ref(*verify_args(p, parents))
    torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(log, log_ref, rtol=1e-5, atol=1e-5)
    o_un, log_un = run_verify(ops, p, parents, "gdn_verify_unfused")
    assert torch.equal(o, o_un) and torch.equal(log, log_un)


@pytest.mark.parametrize("fp_fusion,widen_at_load", [(True, False), (False, True), (True, True)])
def test_gdn_verify_build_options_keep_the_contract(ops, monkeypatch, fp_fusion, widen_at_load):
    """Every verify.BuildOptions the tuning may switch on: the routes still agree bit for bit, gamma is
    still torch's, and the torch reference is within tolerance (chains and trees)."""
    import deltaflash.ops.gdn.verify as verify_mod

    monkeypatch.setattr(verify_mod, "BUILD", verify_mod.BuildOptions(fp_fusion, widen_at_load))
    p = make_gdn(4, 16, 2, 4, 128, 128, seed=21)
    for parents in (chain_parents(4, 16), tree_parents(4, 16, seed=22)):
        o, log = run_verify(ops, p, parents)
        o_ref, log_ref = ops.gdn_verify_ref(*verify_args(p, parents))
        torch.testing.assert_close(log, log_ref, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(o.float(), o_ref.float(), rtol=2e-2, atol=2e-2)
        assert torch.equal(log[..., 0], log_ref[..., 0]), "gamma differs from torch's exp / softplus"
        o_un, log_un = run_verify(ops, p, parents, "gdn_verify_unfused")
        assert torch.equal(o, o_un) and torch.equal(log, log_un), "the routes differ"


def test_gdn_verify_kernel_tree_nodes_bitwise_equal_chain_along_root_path(ops):
    p = make_gdn(2, 12, 2, 4, 128, 128, seed=5)
    parents = tree_parents(2, 12, seed=6)
    o, log = run_verify(ops, p, parents)
    for lane in (0, 1):
        for node in (4, 9, 11):
            path = torch.tensor(root_path(parents[lane].tolist(), node), device=DEV)
            sub = {**p, **{n: p[n][lane:lane + 1, path] for n in "qkvab"}, "slots": p["slots"][lane:lane + 1]}
            o_c, log_c = run_verify(ops, sub, chain_parents(1, len(path)))
            assert torch.equal(o[lane, node], o_c[0, -1]) and torch.equal(log[lane, node], log_c[0, -1])


def test_commit_matches_ref_and_continues_verify_exactly(ops):
    """replay_commit == replay_commit_ref to fp32 tolerance; verify from the committed state continues the
    original verify bit for bit (the commit is the verify row's own update)."""
    L, W, m = 4, 16, 9
    p = make_gdn(L, W, 2, 4, 128, 128, G=3, seed=7)
    logs = torch.stack([run_verify(ops, {**p, "layer": g}, chain_parents(L, W))[1] for g in range(3)])
    o_all = run_verify(ops, p, chain_parents(L, W))[0]
    accepted_len = torch.tensor([m, 5, m, m], device=DEV)  # lane 1 is padding
    nodes = chain_parents(L, W) + 1
    pool, pool_ref = p["pool"].clone(), p["pool"].clone()
    ops.replay_commit(pool, logs, p["slots"], nodes, accepted_len)
    ops.replay_commit_ref(pool_ref, logs, p["slots"], nodes, accepted_len)
    torch.testing.assert_close(pool, pool_ref, rtol=1e-5, atol=1e-6)
    rest = {**p, **{n: p[n][:, m:] for n in "qkvab"}, "pool": pool}
    o_rest = run_verify(ops, rest, chain_parents(L, W - m))[0]
    for lane in (0, 2, 3):
        assert torch.equal(o_rest[lane], o_all[lane, m:])


def test_replay_commit_tree_paths_match_ref(ops):
    L, W = 4, 8
    p = make_gdn(L, W, 2, 4, 128, 128, G=2, seed=8)
    parents = tree_parents(L, W, seed=9)
    logs = torch.stack([run_verify(ops, {**p, "layer": g}, parents)[1] for g in range(2)])
    nodes, lens = path_plan(parents.cpu(), lambda lane: W - 1 - lane)
    nodes = nodes.to(DEV)
    pool, pool_ref = p["pool"].clone(), p["pool"].clone()
    ops.replay_commit(pool, logs, p["slots"], nodes, torch.tensor(lens, device=DEV))
    ops.replay_commit_ref(pool_ref, logs, p["slots"], nodes, torch.tensor(lens, device=DEV))
    torch.testing.assert_close(pool, pool_ref, rtol=1e-5, atol=1e-6)


def make_conv(L, W, C, dtype, S=8, G=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    big = torch.randn(L, W, C + 8, generator=gen).to(dtype).to(DEV)
    return dict(rows=big[..., 4:4 + C], history=torch.randn(S, G, C, K_CONV - 1, generator=gen).to(dtype).to(DEV),
                weight=torch.randn(C, 1, K_CONV, generator=gen).to(dtype).to(DEV)[:, 0, :],
                slots=torch.tensor([5, -1, 2, 7, 0, 3][:L], device=DEV))


@pytest.mark.parametrize("W,C,tree,dtype", [(1, 300, False, torch.bfloat16), (5, 1000, True, torch.bfloat16),
                                            (16, 4096, True, torch.bfloat16), (12, 200, False, torch.float32)])
def test_conv_tree_step_bitwise_equals_ref(ops, W, C, tree, dtype):
    L = 4
    c = make_conv(L, W, C, dtype, seed=W)
    parents = tree_parents(L, W, seed=W, forest=tree == "forest") if tree else chain_parents(L, W)
    before = c["history"].clone()
    out = torch.full((L, W, C), float("nan"), dtype=dtype, device=DEV)
    window = torch.full((L, C, K_CONV - 1 + W), float("nan"), dtype=dtype, device=DEV)
    ops.conv_tree_step(c["rows"], c["history"][:, 1], c["slots"], parents, c["weight"], out=out, window_out=window)
    out_ref, window_ref = ops.conv_tree_step_ref(c["rows"], c["history"][:, 1], c["slots"], parents, c["weight"])
    assert torch.equal(c["history"], before), "conv tree step wrote the conv history"
    assert torch.equal(window, window_ref)
    assert torch.equal(out, out_ref), f"max diff {(out.float() - out_ref.float()).abs().max()}"


@pytest.mark.parametrize("L,T,C,dtype", [(6, 2048, 8192, torch.bfloat16), (5, 77, 1000, torch.bfloat16),
                                         (4, 33, 300, torch.float32)])
def test_conv_extend_bitwise_equals_ref(ops, L, T, C, dtype):
    """The prefill conv kernel and its torch route agree bit for bit (the README's arithmetic), at
    every kind of lane: padding (0 rows), fewer rows than K-1, some, all."""
    from deltaflash.ops.conv.extend import causal_conv_extend, causal_conv_extend_ref
    from tests.test_ops_verify import make_extend

    rows, history, weight, n_rows = (t.to(DEV) for t in make_extend(L, T, C, dtype, seed=T))
    out, new = causal_conv_extend(rows, history, weight, n_rows)
    out_ref, new_ref = causal_conv_extend_ref(rows, history, weight, n_rows)
    assert torch.equal(new, new_ref)
    assert torch.equal(out, out_ref), f"max diff {(out.float() - out_ref.float()).abs().max()}"


def test_conv_extend_tilings_agree_bit_for_bit(ops):
    from tests.test_ops_verify import conv_tilings_agree

    conv_tilings_agree(DEV)


@pytest.mark.parametrize("nk,nv,dk,T", [(16, 32, 128, 2048), (2, 2, 64, 77)])
def test_conv_extend_heads_equals_ref(ops, nk, nv, dk, T):
    """The prefill conv with the chunked rule's head split: v and the history bit for bit with the torch
    route, the normalised q / k within a rounding (the sum of squares runs in the kernel's order)."""
    from deltaflash.ops.conv.extend import conv_extend_heads, conv_extend_heads_ref
    from tests.test_ops_verify import extend_pool, make_extend

    L, C = 5, 2 * nk * dk + nv * dk
    rows, history, weight, n_rows = (t.to(DEV) for t in make_extend(L, T, C, torch.bfloat16, seed=T))
    (pool, slots), (pool_ref, _) = ((t.to(DEV) for t in extend_pool(history.cpu(), seed=T)) for _ in range(2))
    got = conv_extend_heads(rows, pool[:, 1], slots, weight, n_rows, nk, nv, dk)
    ref = conv_extend_heads_ref(rows, pool_ref[:, 1], slots, weight, n_rows, nk, nv, dk)
    assert torch.equal(got[2], ref[2]) and torch.equal(pool, pool_ref)
    for a, b in zip(got[:2], ref[:2]):
        torch.testing.assert_close(a.float(), b.float(), rtol=8e-3, atol=1e-3)


def test_conv_commit_bitwise_equals_ref(ops):
    L, W, C = 4, 8, 1000
    c = make_conv(L, W, C, torch.bfloat16, seed=10)
    parents = tree_parents(L, W, seed=11)
    windows = torch.stack([ops.conv_tree_step(c["rows"], c["history"][:, g], c["slots"], parents, c["weight"])[1]
                           for g in range(2)])
    nodes, lens = path_plan(parents.cpu(), lambda lane: W - 1 - lane)
    nodes = nodes.to(DEV)
    for cut in range(W + 1):
        accepted_len = torch.tensor([min(cut, n) for n in lens], device=DEV)
        hist, hist_ref = c["history"].clone(), c["history"].clone()
        ops.conv_commit(hist, windows, c["slots"], nodes, accepted_len)
        ops.conv_commit_ref(hist_ref, windows, c["slots"], nodes, accepted_len)
        assert torch.equal(hist, hist_ref)


@pytest.mark.parametrize("slots,accepted_len", [([5, 5, 2, 7], [1, 1, 1, 1]), ([5, 8, 2, 7], [1, 1, 1, 1]),
                                                ([5, -1, 2, 7], [1, 0, 17, 1])])
def test_rejected_commit_changes_nothing(ops, slots, accepted_len):
    from deltaflash.errors import CommitRejectedError

    L, W = 4, 16
    p, c = make_gdn(L, W, 2, 4, 128, 128, seed=12), make_conv(L, W, 64, torch.bfloat16, seed=13)
    logs = torch.randn(2, L, W, 4, 1 + 128 + 128, device=DEV)
    windows = torch.randn(2, L, 64, K_CONV - 1 + W, device=DEV).to(torch.bfloat16)
    pool, hist = p["pool"].clone(), c["history"].clone()
    args = (torch.tensor(slots, device=DEV), chain_parents(L, W) + 1, torch.tensor(accepted_len, device=DEV))
    with pytest.raises(CommitRejectedError):
        ops.replay_commit(pool, logs, *args)
    with pytest.raises(CommitRejectedError):
        ops.conv_commit(hist, windows, *args)
    torch.cuda.synchronize()
    assert torch.equal(pool, p["pool"]) and torch.equal(hist, c["history"])


ISSUE_CASES = [  # the configurations issue 4 names: (nk, nv, dk, lanes, slots in the pool, W, tree)
    (16, 32, 128, 4, 6, 16, False),
    (8, 8, 64, 3, 3, 5, False),
    (16, 32, 128, 1, 1, 1, False),
    (2, 4, 128, 4, 6, 12, True),
]


@pytest.mark.parametrize("nk,nv,dk,L,S,W,tree", ISSUE_CASES)
def test_fused_route_bitwise_equals_unfused_route(ops, nk, nv, dk, L, S, W, tree):
    """Whole verify route (conv tree step -> GDN verify) and commit of every prefix, fused vs unfused:
    identical bits in o, replay log, conv output and windows; persistent state untouched by verify."""
    gen = torch.Generator().manual_seed(W * 100 + L)
    C = 2 * nk * dk + nv * dk
    proj = torch.randn(L, W, C + 3 * nv, generator=gen).to(torch.bfloat16).to(DEV)  # qkv | b | z-ish | a
    rows, b, a = proj[..., :C], proj[..., C:C + nv], proj[..., C + 2 * nv:]
    history = torch.randn(S, 2, C, K_CONV - 1, generator=gen).to(torch.bfloat16).to(DEV)
    pool = (torch.randn(S, 2, nv, dk, dk, generator=gen) * 0.3).to(DEV)
    weight = torch.randn(C, K_CONV, generator=gen).to(torch.bfloat16).to(DEV)
    A_log, dt_bias = (torch.randn(nv, generator=gen) * 0.5).to(DEV), torch.randn(nv, generator=gen).to(DEV)
    slots = torch.randperm(S, generator=gen)[:L].to(DEV)  # lanes read permuted slots
    parents = tree_parents(L, W, seed=W, forest=tree == "forest") if tree else chain_parents(L, W)
    before = (pool.clone(), history.clone())

    def route(conv, verify):
        out, window = conv(rows, history[:, 1], slots, parents, weight)
        q, k, v = out.split([nk * dk, nk * dk, nv * dk], dim=-1)
        o, log = verify(q.unflatten(-1, (nk, dk)), k.unflatten(-1, (nk, dk)), v.unflatten(-1, (nv, dk)), a, b,
                        A_log, dt_bias, pool[:, 1], slots, parents)
        return out, window, o, log

    fused = route(ops.conv_tree_step, ops.gdn_verify)
    unfused = route(ops.conv_tree_step_ref, ops.gdn_verify_unfused)
    assert torch.equal(pool, before[0]) and torch.equal(history, before[1]), "verify wrote persistent state"
    for name, x, y in zip(("conv output", "window", "o", "replay log"), fused, unfused):
        assert torch.equal(x, y), f"{name} differs between the fused and the unfused route"
    if not tree:  # the chain-only kernel the engine runs for its (always chain) verify rounds
        lean = route(ops.conv_tree_step, lambda *args: ops.gdn_verify(*args, chains=True))
        for name, x, y in zip(("o", "replay log"), lean[2:], unfused[2:]):
            assert torch.equal(x, y), f"{name} differs between the chain-only kernel and the unfused route"
    logs = torch.stack([fused[3], fused[3]])  # both pool layers replay the same log
    windows = torch.stack([fused[1], fused[1]])
    for n in range(W + 1):
        nodes = torch.zeros(L, W, dtype=torch.long, device=DEV)
        lens = []
        for lane in range(L):
            path = root_path(parents[lane].tolist(), W - 1)[:n] if tree else list(range(n))
            nodes[lane, :len(path)] = torch.tensor(path, dtype=torch.long, device=DEV)
            lens.append(len(path))
        accepted = torch.tensor(lens, device=DEV)
        plan = CommitPlan(slots, nodes, accepted, tuple(slots.tolist()), tuple(lens), (0,) * L, chain_host=not tree,
                          accepted_nodes_host=tuple(tuple(row[:m]) for row, m in zip(nodes.tolist(), lens)))
        got, want, near = ((pool.clone(), history.clone()) for _ in range(3))
        triton_kernels().commit_state(got[0], logs, got[1], windows, plan)
        reference_kernels().commit_state(want[0], logs, want[1], windows, plan)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), f"commit of prefix {n} differs"
        ops.replay_commit_ref(near[0], logs, slots, nodes, accepted)
        torch.testing.assert_close(got[0], near[0], rtol=1e-5, atol=1e-6)
