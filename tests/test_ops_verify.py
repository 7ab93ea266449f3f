"""Verify-route ops on CPU: torch references against the obvious per-token recurrence, commit
transactions, and the Triton kernels (TRITON_INTERPRET=1) against the references."""

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from deltaflash.errors import CommitRejectedError  # noqa: E402
from deltaflash.ops.conv.naive import conv_commit_ref, conv_tree_step_ref  # noqa: E402
from deltaflash.ops.gdn.naive import gdn_gates_ref, gdn_verify_ref, replay_commit_ref  # noqa: E402
from tests.guards import no_host_reads  # noqa: E402

K_CONV = 4


# ---------------------------------------------------------------------------------------------
# Problem builders and the obvious sequential recurrences.


def make_gdn(L=3, W=5, nk=2, nv=4, dk=32, dv=16, S=6, G=3, dtype=torch.float32, seed=0):
    """Random verify inputs. a, b are strided views of one projection; q, k, v views of one conv output;
    the pool holds G layers and layer 1 is verified. Lane 1 is padding, slots are permuted."""
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    qkv = rnd(L, W, 2 * nk * dk + nv * dv).to(dtype)
    q = qkv[..., :nk * dk].unflatten(-1, (nk, dk))
    k = qkv[..., nk * dk:2 * nk * dk].unflatten(-1, (nk, dk))
    v = qkv[..., 2 * nk * dk:].unflatten(-1, (nv, dv))
    ba = rnd(L, W, 3 * nv).to(dtype) * 2
    b, a = ba[..., :nv], ba[..., 2 * nv:]
    A_log = rnd(nv) * 0.5
    dt_bias = rnd(nv)
    pool = rnd(S, G, nv, dk, dv) * 0.3
    slots = torch.tensor([4, -1, 1, 5, 0, 2, 3][:L])
    return dict(q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias, pool=pool, layer=1, slots=slots)


def chain_parents(L, W):
    return (torch.arange(W) - 1).expand(L, W).contiguous()


def random_tree_parents(L, W, seed, forest=False):
    """Random trees (parents[n] uniform in [0, n)); a forest also draws -1: nodes starting from the slot state."""
    gen = torch.Generator().manual_seed(seed)
    par = torch.full((L, W), -1, dtype=torch.long)
    for n in range(1, W):
        par[:, n] = torch.randint(-1 if forest else 0, n, (L,), generator=gen)
    return par


def root_path(parents_row, node):
    path = []
    while node >= 0:
        path.append(node)
        node = int(parents_row[node])
    return path[::-1]

def path_plan(parents, last_node):
    """accepted_nodes [L, W] along each lane's root path to last_node(lane), and the path lengths."""
    L, W = parents.shape
    nodes = torch.zeros(L, W, dtype=torch.long)
    lengths = []
    for lane in range(L):
        path = root_path(parents[lane], last_node(lane))
        nodes[lane, :len(path)] = torch.tensor(path)
        lengths.append(len(path))
    return nodes, lengths


def sequential_gdn(q, k, v, a, b, A_log, dt_bias, state):
    """One lane, rows in order, per token and per head. q, k [T, nk, dk]; v [T, nv, dv]; a, b [T, nv];
    state [nv, dk, dv]. Returns o [T, nv, dv], states after each prefix [T+1, nv, dk, dv], log [T, nv, 1+dk+dv]
    ([gamma, k as given, delta / |k|])."""
    T, nk, dk = q.shape
    nv = v.shape[1]
    S = state.clone().float()
    outs, states, logs = [], [S.clone()], []
    for t in range(T):
        o_t, log_t = [], []
        for h in range(nv):
            k_raw = k[t, h // (nv // nk)].float()
            qh = q[t, h // (nv // nk)].float()
            k_norm = torch.sqrt((k_raw * k_raw).sum() + 1e-6)
            kh = k_raw / k_norm
            qh = qh / torch.sqrt((qh * qh).sum() + 1e-6) * dk ** -0.5
            g = -torch.exp(A_log[h]) * F.softplus(a[t, h].float() + dt_bias[h])
            beta = torch.sigmoid(b[t, h].float())
            S[h] = torch.exp(g) * S[h]
            delta = beta * (v[t, h].float() - S[h].T @ kh)
            S[h] = S[h] + torch.outer(kh, delta)
            o_t.append(S[h].T @ qh)
            log_t.append(torch.cat([torch.exp(g)[None], k_raw, delta / k_norm]))
        outs.append(torch.stack(o_t))
        logs.append(torch.stack(log_t))
        states.append(S.clone())
    return torch.stack(outs), torch.stack(states), torch.stack(logs)


def sequential_conv(rows, history, weight):
    """One lane, a chain. rows [T, C]; history [C, K-1]. Returns out [T, C] fp32 and the raw sequence [C, K-1+T]."""
    seq = torch.cat([history.float(), rows.float().T], dim=1)
    K = weight.shape[1]
    out = torch.stack([F.silu((weight.float() * seq[:, t:t + K]).sum(-1)) for t in range(rows.shape[0])])
    return out, seq


def verify_args(p, parents):
    return (p["q"], p["k"], p["v"], p["a"], p["b"], p["A_log"], p["dt_bias"], p["pool"][:, p["layer"]],
            p["slots"], parents)


# ---------------------------------------------------------------------------------------------
# References.


def test_gates_ref_matches_formula_and_softplus_threshold():
    a = torch.tensor([[-30.0, 0.0, 19.0, 25.0]])
    b = torch.tensor([[-3.0, 0.0, 1.0, 8.0]])
    A_log, dt_bias = torch.tensor([0.1, -0.2, 0.3, 0.0]), torch.tensor([0.0, 0.5, 1.5, 0.0])
    g, beta = gdn_gates_ref(a, b, A_log, dt_bias)
    x = (a + dt_bias).double()
    sp = torch.where(x > 20, x, torch.log1p(torch.exp(x)))
    torch.testing.assert_close(g.double(), -torch.exp(A_log.double()) * sp, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(beta.double(), torch.sigmoid(b.double()), rtol=1e-6, atol=1e-7)
    assert g.dtype == beta.dtype == torch.float32 and (g <= 0).all()


@pytest.mark.parametrize("nk,nv,dk,dv", [(2, 4, 32, 16), (1, 1, 16, 8)])
def test_verify_ref_chain_matches_sequential(nk, nv, dk, dv):
    p = make_gdn(nk=nk, nv=nv, dk=dk, dv=dv)
    L, W = p["q"].shape[:2]
    o, log = gdn_verify_ref(*verify_args(p, chain_parents(L, W)))
    assert o.shape == (L, W, nv, dv) and log.shape == (L, W, nv, 1 + dk + dv)
    o_c, log_c = gdn_verify_ref(*verify_args(p, chain_parents(L, W)), chains=True)  # the engine's chain hint
    assert torch.equal(o_c, o) and torch.equal(log_c, log)
    for lane in range(L):
        slot = int(p["slots"][lane])
        s0 = p["pool"][slot, p["layer"]] if slot >= 0 else torch.zeros(nv, dk, dv)
        o_seq, _, log_seq = sequential_gdn(*(p[n][lane] for n in "qkvab"), p["A_log"], p["dt_bias"], s0)
        torch.testing.assert_close(o[lane], o_seq, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(log[lane], log_seq, rtol=1e-5, atol=1e-6)


def test_verify_ref_never_writes_state_and_keeps_dtype():
    p = make_gdn(dtype=torch.bfloat16)
    before = p["pool"].clone()
    o, log = gdn_verify_ref(*verify_args(p, random_tree_parents(3, 5, seed=1)))
    assert torch.equal(p["pool"], before)
    assert o.dtype == torch.bfloat16 and log.dtype == torch.float32


def test_replay_commit_ref_every_prefix_equals_sequential_state():
    p = make_gdn()
    L, W = p["q"].shape[:2]
    G = p["pool"].shape[1]
    parents = chain_parents(L, W)
    logs = torch.stack([gdn_verify_ref(*verify_args({**p, "layer": g}, parents))[1] for g in range(G)])
    for n_acc in range(W + 1):
        pool = p["pool"].clone()
        accepted_len = torch.tensor([n_acc, W, max(n_acc - 1, 0)])  # lane 1 is padding: ignored
        replay_commit_ref(pool, logs, p["slots"], chain_parents(L, W) + 1, accepted_len)
        for lane in range(L):
            slot = int(p["slots"][lane])
            if slot < 0:
                continue
            for g in range(G):
                _, states, _ = sequential_gdn(*(p[n][lane] for n in "qkvab"), p["A_log"], p["dt_bias"],
                                              p["pool"][slot, g])
                torch.testing.assert_close(pool[slot, g], states[int(accepted_len[lane])], rtol=1e-5, atol=1e-6)
        untouched = [s for s in range(pool.shape[0]) if s not in p["slots"].tolist()]
        assert torch.equal(pool[untouched], p["pool"][untouched])


def test_verify_ref_tree_nodes_equal_chain_along_root_path():
    p = make_gdn(W=7, seed=3)
    L, W = p["q"].shape[:2]
    parents = random_tree_parents(L, W, seed=4)
    o, log = gdn_verify_ref(*verify_args(p, parents))
    for lane in range(L):
        for node in range(W):
            path = torch.tensor(root_path(parents[lane], node))
            sub = {**p, **{n: p[n][lane:lane + 1, path] for n in "qkvab"}, "slots": p["slots"][lane:lane + 1]}
            o_c, log_c = gdn_verify_ref(*verify_args(sub, chain_parents(1, len(path))))
            torch.testing.assert_close(o[lane, node], o_c[0, -1], rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(log[lane, node], log_c[0, -1], rtol=1e-6, atol=1e-6)


def test_replay_commit_ref_tree_path_equals_sequential_state():
    p = make_gdn(W=6, seed=5)
    L, W = p["q"].shape[:2]
    parents = random_tree_parents(L, W, seed=6)
    logs = torch.stack([gdn_verify_ref(*verify_args({**p, "layer": g}, parents))[1] for g in range(p["pool"].shape[1])])
    paths = [root_path(parents[lane], W - 1 - lane) for lane in range(L)]
    nodes = torch.zeros(L, W, dtype=torch.long)
    for lane, path in enumerate(paths):
        nodes[lane, :len(path)] = torch.tensor(path)
    pool = p["pool"].clone()
    replay_commit_ref(pool, logs, p["slots"], nodes, torch.tensor([len(x) for x in paths]))
    for lane, path in enumerate(paths):
        slot = int(p["slots"][lane])
        if slot < 0:
            continue
        idx = torch.tensor(path)
        _, states, _ = sequential_gdn(*(p[n][lane, idx] for n in "qkvab"), p["A_log"], p["dt_bias"],
                                      p["pool"][slot, 2])
        torch.testing.assert_close(pool[slot, 2], states[-1], rtol=1e-5, atol=1e-6)


def make_conv(L=3, W=5, C=24, S=6, G=2, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    big = torch.randn(L, W, C + 8, generator=gen).to(dtype)
    return dict(rows=big[..., 4:4 + C], history=torch.randn(S, G, C, K_CONV - 1, generator=gen).to(dtype),
                weight=torch.randn(C, 1, K_CONV, generator=gen)[:, 0, :], slots=torch.tensor([4, -1, 1, 5, 0][:L]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_tree_step_ref_chain_matches_sequential(dtype):
    c = make_conv(dtype=dtype)
    L, W, C = c["rows"].shape
    before = c["history"].clone()
    out, window = conv_tree_step_ref(c["rows"], c["history"][:, 1], c["slots"], chain_parents(L, W), c["weight"])
    assert torch.equal(c["history"], before)
    assert out.shape == (L, W, C) and out.dtype == dtype and window.shape == (L, C, K_CONV - 1 + W)
    for lane in range(L):
        slot = int(c["slots"][lane])
        hist = c["history"][slot, 1] if slot >= 0 else torch.zeros(C, K_CONV - 1, dtype=dtype)
        o_seq, seq = sequential_conv(c["rows"][lane], hist, c["weight"])
        tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(out[lane].float(), o_seq, **tol)
        assert torch.equal(window[lane].float(), seq)


def test_conv_tree_step_ref_tree_nodes_equal_chain_along_root_path():
    c = make_conv(W=8, seed=2)
    L, W, C = c["rows"].shape
    parents = random_tree_parents(L, W, seed=3)
    out, _ = conv_tree_step_ref(c["rows"], c["history"][:, 0], c["slots"], parents, c["weight"])
    for lane in range(L):
        for node in range(W):
            path = torch.tensor(root_path(parents[lane], node))
            o_c, _ = conv_tree_step_ref(c["rows"][lane:lane + 1, path], c["history"][:, 0], c["slots"][lane:lane + 1],
                                        chain_parents(1, len(path)), c["weight"])
            torch.testing.assert_close(out[lane, node], o_c[0, -1], rtol=1e-6, atol=1e-7)


def test_conv_commit_ref_every_prefix_keeps_last_raw_inputs():
    c = make_conv()
    L, W, C = c["rows"].shape
    G = c["history"].shape[1]
    parents = chain_parents(L, W)
    windows = torch.stack([conv_tree_step_ref(c["rows"], c["history"][:, g], c["slots"], parents, c["weight"])[1]
                           for g in range(G)])
    for n_acc in range(W + 1):
        hist = c["history"].clone()
        conv_commit_ref(hist, windows, c["slots"], parents + 1, torch.full((L,), n_acc))
        for lane in range(L):
            slot = int(c["slots"][lane])
            if slot < 0:
                continue
            for g in range(G):
                seq = torch.cat([c["history"][slot, g], c["rows"][lane, :n_acc].T], dim=1)
                assert torch.equal(hist[slot, g], seq[:, -(K_CONV - 1):])
        untouched = [s for s in range(hist.shape[0]) if s not in c["slots"].tolist()]
        assert torch.equal(hist[untouched], c["history"][untouched])


REJECTED = {
    "duplicate slot": dict(slots=[4, 1, 4]),
    "slot out of range": dict(slots=[4, 6, 1]),
    "slot below -1": dict(slots=[4, -2, 1]),
    "accepted > W": dict(accepted_len=[2, 0, 6]),
    "accepted < 0": dict(accepted_len=[-1, 0, 2]),
    "node out of range": dict(nodes_row0=[0, 5, 2, 3, 4]),
    "nodes not increasing": dict(nodes_row0=[0, 2, 1, 3, 4]),
}


def test_commit_ref_padding_lane_and_zero_accepted_write_nothing():
    p = make_gdn()
    logs = torch.stack([gdn_verify_ref(*verify_args({**p, "layer": g}, chain_parents(3, 5)))[1] for g in range(3)])
    pool = p["pool"].clone()
    replay_commit_ref(pool, logs, torch.tensor([-1, 2, -1]), chain_parents(3, 5) + 1, torch.tensor([5, 0, 99]))
    assert torch.equal(pool, p["pool"])


# ---------------------------------------------------------------------------------------------
# Triton kernels (TRITON_INTERPRET=1 on CPU) against the references. Outputs are pre-filled with NaN.

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from deltaflash.ops.conv.tree_step import conv_tree_step  # noqa: E402
from deltaflash.ops.gdn.commit import conv_commit, replay_commit, state_commit  # noqa: E402
from deltaflash.ops.gdn.verify import gdn_verify, gdn_verify_kernel, gdn_verify_unfused  # noqa: E402

interpreted = pytest.mark.skipif(
    not isinstance(gdn_verify_kernel, InterpretedFunction),
    reason="CPU kernel tests need TRITON_INTERPRET=1 before import (CUDA: tests/test_ops_gpu.py)")

KERNEL_CASES = {  # name: (L, W, nk, nv, dk, dv, tree, dtype)
    "W1 dk32": (2, 1, 1, 2, 32, 16, False, torch.float32),
    "W5 dk64 chain nk!=nv": (3, 5, 2, 4, 64, 48, False, torch.float32),
    "W5 dk32 tree bf16": (4, 5, 1, 3, 32, 32, True, torch.bfloat16),
    "W12 dk32 tree": (2, 12, 2, 4, 32, 16, True, torch.float32),
    "W5 dk128 dv40 tree": (2, 5, 1, 1, 128, 40, True, torch.float32),
    "W9 dk32 forest": (3, 9, 1, 2, 32, 16, "forest", torch.float32),
}


def run_verify_kernel(p, parents, chains=False, route=gdn_verify):
    L, W, nk, dk = p["q"].shape
    nv, dv = p["v"].shape[2:]
    o = torch.full((L, W, nv, dv), float("nan"), dtype=p["q"].dtype)
    log = torch.full((L, W, nv, 1 + dk + dv), float("nan"))
    return route(*verify_args(p, parents), out=o, replay_log_out=log, chains=chains)


@interpreted
@pytest.mark.parametrize("case", list(KERNEL_CASES))
def test_gdn_verify_kernel_matches_ref(case):
    L, W, nk, nv, dk, dv, tree, dtype = KERNEL_CASES[case]
    p = make_gdn(L=L, W=W, nk=nk, nv=nv, dk=dk, dv=dv, dtype=dtype, seed=7)
    parents = random_tree_parents(L, W, seed=8, forest=tree == "forest").int() if tree else chain_parents(L, W)
    if tree == "forest":
        assert (parents[:, 1:] < 0).any()
    before = p["pool"].clone()
    o_ref, log_ref = gdn_verify_ref(*verify_args(p, parents))
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    for route in (gdn_verify, gdn_verify_unfused):  # the fused kernel; torch gates and gathers + its recurrence
        o, log = run_verify_kernel(p, parents, route=route)
        assert torch.equal(p["pool"], before)
        assert not o.isnan().any() and not log.isnan().any()
        torch.testing.assert_close(o, o_ref, **tol)
        torch.testing.assert_close(log, log_ref, rtol=1e-5, atol=1e-6)
        assert torch.equal(log[..., 1:1 + dk], log_ref[..., 1:1 + dk])  # k as given (exact in fp32)
        if route is gdn_verify_unfused:  # torch's gamma through the kernel's per-row pick, bit for bit
            assert torch.equal(log[..., 0], log_ref[..., 0])


@interpreted
@pytest.mark.parametrize("case", ["W1 dk32", "W5 dk64 chain nk!=nv"])
def test_gdn_verify_chain_kernel_bitwise_equals_general_kernel(case):
    """chains=True (tree path compiled out, parents unread) gives the general kernel's bits on chains."""
    L, W, nk, nv, dk, dv, _, dtype = KERNEL_CASES[case]
    p = make_gdn(L=L, W=W, nk=nk, nv=nv, dk=dk, dv=dv, dtype=dtype, seed=17)
    general = run_verify_kernel(p, chain_parents(L, W))
    lean = run_verify_kernel(p, chain_parents(L, W), chains=True)
    assert all(torch.equal(a, b) for a, b in zip(general, lean))


@interpreted
def test_gdn_verify_build_options_change_no_value(monkeypatch):
    """verify.BuildOptions only change how the kernel compiles: here (no FMA contraction in the
    interpreter, bf16 -> fp32 exact wherever it happens) every option gives the default's bits."""
    import deltaflash.ops.gdn.verify as verify_mod

    L, W, nk, nv, dk, dv, _, dtype = KERNEL_CASES["W5 dk32 tree bf16"]
    p = make_gdn(L=L, W=W, nk=nk, nv=nv, dk=dk, dv=dv, dtype=dtype, seed=23)
    parents = random_tree_parents(L, W, seed=24)
    default = run_verify_kernel(p, parents)
    for options in (verify_mod.BuildOptions(), verify_mod.BuildOptions(widen_at_load=True),
                    verify_mod.BuildOptions(fp_fusion=True), verify_mod.BuildOptions(True, True)):
        monkeypatch.setattr(verify_mod, "BUILD", options)
        assert all(torch.equal(x, y) for x, y in zip(run_verify_kernel(p, parents), default)), options


@interpreted
def test_gdn_verify_kernel_tree_nodes_bitwise_equal_chain_along_root_path():
    p = make_gdn(L=2, W=7, nk=1, nv=2, dk=32, dv=16, seed=9)
    parents = random_tree_parents(2, 7, seed=10)
    o, log = run_verify_kernel(p, parents)
    for lane in range(2):
        for node in (3, 5, 6):
            path = torch.tensor(root_path(parents[lane], node))
            sub = {**p, **{n: p[n][lane:lane + 1, path] for n in "qkvab"}, "slots": p["slots"][lane:lane + 1]}
            o_c, log_c = run_verify_kernel(sub, chain_parents(1, len(path)))
            assert torch.equal(o[lane, node], o_c[0, -1]) and torch.equal(log[lane, node], log_c[0, -1])


@interpreted
def test_replay_commit_kernel_bitwise_equals_ref_and_continues_verify_exactly():
    """Commit m rows then verify the rest from the committed state == one verify over all rows, bit for bit."""
    p = make_gdn(L=3, W=6, nk=1, nv=2, dk=32, dv=16, G=2, seed=11)
    L, W = 3, 6
    p["layer"] = 0
    logs = torch.stack([run_verify_kernel({**p, "layer": g}, chain_parents(L, W))[1] for g in range(2)])
    o_all = run_verify_kernel(p, chain_parents(L, W))[0]
    m = 4
    pool, pool_ref = p["pool"].clone(), p["pool"].clone()
    accepted_len = torch.tensor([m, 3, m])  # lane 1 is padding
    replay_commit(pool, logs, p["slots"], chain_parents(L, W) + 1, accepted_len)
    replay_commit_ref(pool_ref, logs, p["slots"], chain_parents(L, W) + 1, accepted_len)
    assert torch.equal(pool, pool_ref)
    rest = {**p, **{n: p[n][:, m:] for n in "qkvab"}, "pool": pool}
    o_rest = run_verify_kernel(rest, chain_parents(L, W - m))[0]
    for lane in (0, 2):
        assert torch.equal(o_rest[lane], o_all[lane, m:])


@interpreted
def test_replay_commit_kernel_tree_paths_and_every_length():
    p = make_gdn(L=4, W=5, nk=2, nv=4, dk=32, dv=48, G=3, seed=12)
    L, W = 4, 5
    parents = random_tree_parents(L, W, seed=13)
    logs = torch.stack([gdn_verify_ref(*verify_args({**p, "layer": g}, parents))[1] for g in range(3)])
    nodes, full = path_plan(parents, lambda lane: W - 1 - lane % 2)
    for cut in range(W + 1):
        accepted_len = torch.tensor([min(cut, n) for n in full])
        pool, pool_ref = p["pool"].clone(), p["pool"].clone()
        replay_commit(pool, logs, p["slots"], nodes, accepted_len)
        replay_commit_ref(pool_ref, logs, p["slots"], nodes, accepted_len)
        assert torch.equal(pool, pool_ref)


@interpreted
@pytest.mark.parametrize("L,W,C,tree,dtype", [(2, 1, 24, False, torch.float32), (3, 5, 300, True, torch.bfloat16),
                                              (4, 12, 40, True, torch.float32), (3, 5, 24, False, torch.float32)])
def test_conv_tree_step_kernel_matches_ref(L, W, C, tree, dtype):
    c = make_conv(L=L, W=W, C=C, dtype=dtype, seed=14)
    parents = random_tree_parents(L, W, seed=15) if tree else chain_parents(L, W)
    before = c["history"].clone()
    out = torch.full((L, W, C), float("nan"), dtype=dtype)
    window = torch.full((L, C, K_CONV - 1 + W), float("nan"), dtype=dtype)
    conv_tree_step(c["rows"], c["history"][:, 1], c["slots"], parents, c["weight"], out=out, window_out=window)
    out_ref, window_ref = conv_tree_step_ref(c["rows"], c["history"][:, 1], c["slots"], parents, c["weight"])
    assert torch.equal(c["history"], before)
    assert torch.equal(window, window_ref)
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(out, out_ref, **tol)


def make_extend(L, T, C, dtype, seed=0):
    """Prefill conv inputs: rows a strided column view of a wider projection; one lane of each kind
    of n_rows - none (a padding lane), fewer than K-1, some, all T."""
    gen = torch.Generator().manual_seed(seed)
    big = torch.randn(L, T, C + 8, generator=gen).to(dtype)
    n_rows = torch.tensor([0, 2, T // 2 + 1, T, 1, T][:L])
    return (big[..., 4:4 + C], torch.randn(L, C, K_CONV - 1, generator=gen).to(dtype),
            torch.randn(C, K_CONV, generator=gen).to(dtype), n_rows)


def test_conv_extend_ref_equals_the_sequential_conv_and_keeps_the_last_inputs():
    """Row t's output: silu of taps over (history, rows) ending at t; new history: the K-1 inputs
    ending at the lane's last valid row (history columns when it has fewer than K-1 rows)."""
    from deltaflash.ops.conv.extend import causal_conv_extend_ref

    rows, history, weight, n_rows = make_extend(4, 7, 12, torch.float32, seed=3)
    out, new = causal_conv_extend_ref(rows, history, weight, n_rows)
    for lane in range(4):
        seq = torch.cat([history[lane].T, rows[lane]])  # [K-1+T, C] inputs in order
        for t in range(7):
            acc = sum(weight[:, j] * seq[t + j] for j in range(K_CONV))
            torch.testing.assert_close(out[lane, t], F.silu(acc), rtol=1e-6, atol=1e-6)
        n = int(n_rows[lane])
        assert torch.equal(new[lane], seq[n:n + K_CONV - 1].T)


@interpreted
@pytest.mark.parametrize("L,T,C,dtype", [(4, 7, 24, torch.float32), (3, 40, 300, torch.float32),
                                         (6, 33, 40, torch.float16), (2, 2, 24, torch.float32),
                                         (2, 3, 24, torch.float32)])  # (rows [0, K-1): the history's own launch)
def test_conv_extend_kernel_matches_ref(L, T, C, dtype):
    from deltaflash.ops.conv.extend import causal_conv_extend, causal_conv_extend_ref

    rows, history, weight, n_rows = make_extend(L, T, C, dtype, seed=T)
    out, new = causal_conv_extend(rows, history, weight, n_rows)
    out_ref, new_ref = causal_conv_extend_ref(rows, history, weight, n_rows)
    assert torch.equal(new, new_ref)
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(out, out_ref, **tol)


def extend_pool(history: torch.Tensor, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A pool of conv histories [S = L + 3, 2 layers, C, K-1] (random rows, those of `history` [L, C, K-1]
    among layer 1's in another order) and the lanes' slots: lane 0 (make_extend's padding lane) has none
    (-1), lane l > 0 reads `history[l]` at its slot."""
    L = history.shape[0]
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(L + 3, 2, *history.shape[1:], generator=gen).to(history.dtype)
    slots = torch.randperm(L + 3, generator=gen)[:L]
    slots[0] = -1
    pool[slots[1:], 1] = history[1:]
    return pool, slots


@interpreted
@pytest.mark.parametrize("nk,nv,dk,dv,T,dtype", [(2, 4, 8, 6, 7, torch.float32), (3, 3, 16, 16, 33, torch.float32),
                                                 (1, 2, 16, 8, 12, torch.float16), (2, 4, 8, 6, 3, torch.float32)])
def test_conv_extend_heads_kernel_matches_ref(nk, nv, dk, dv, T, dtype):
    """The prefill conv split into the chunked rule's inputs: q, k normalised per key head (once each: the
    chunked rule reads a key head for its value heads), v as it is; each lane's history read from its slot
    of a pool's layer and its new history written back there in place - a lane without a slot reads zeros
    and writes nothing, every other row of the pool stays as it was; short lanes too."""
    from deltaflash.ops.conv.extend import causal_conv_extend_ref, conv_extend_heads, conv_extend_heads_ref

    L, C = 4, 2 * nk * dk + nv * dv
    rows, history, weight, n_rows = make_extend(L, T, C, dtype, seed=dk + T)
    history[0] = 0  # the padding lane reads zeros
    _, want_history = causal_conv_extend_ref(rows, history, weight, n_rows)
    outputs = []
    for conv in (conv_extend_heads, conv_extend_heads_ref):
        pool, slots = extend_pool(history, seed=dk)
        before = pool.clone()
        outputs.append(conv(rows, pool[:, 1], slots, weight, n_rows, nk, nv, dk))  # layer 1's view
        untouched = torch.ones(pool.shape[0], dtype=torch.bool)
        untouched[slots[1:]] = False
        assert torch.equal(pool[slots[1:], 1], want_history[1:])  # the raw inputs, moved
        assert torch.equal(pool[untouched], before[untouched]) and torch.equal(pool[:, 0], before[:, 0])
    got, ref = outputs
    assert got[0].shape == got[1].shape == (L, T, nk, dk) and got[2].shape == (L, T, nv, dv)
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-3, atol=2e-3)
    for name, a, b in zip(("q", "k", "v"), got, ref):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        torch.testing.assert_close(a, b, **tol, msg=name)
    for normed in got[:2]:  # every head row of q and k has unit norm (random rows are never near zero)
        norms = normed.float().norm(dim=-1)
        torch.testing.assert_close(norms, torch.ones_like(norms), rtol=0, atol=1e-2)


def conv_tilings_agree(device: str) -> None:
    """The prefill conv's launch knobs (rows a program, rows a loop step, warps) change no bit of its outputs or
    the histories it writes: an odd number of rows leaves a half step at the end of every program."""
    import deltaflash.ops.conv.extend as extend

    nk, nv, dk, T = 2, 4, 16, 37
    rows, history, weight, n_rows = (t.to(device) for t in make_extend(3, T, 2 * nk * dk + nv * dk, torch.float16,
                                                                       seed=5))
    default = extend.ROW_TILE, extend.STEP, extend.NUM_WARPS
    results = []
    try:
        for tiling in ((16, 1, 1), (16, 2, 1), (8, 2, 2), (5, 2, 1), (32, 1, 4)):
            extend.ROW_TILE, extend.STEP, extend.NUM_WARPS = tiling
            pool, slots = (t.to(device) for t in extend_pool(history.cpu(), seed=1))
            plain = extend.causal_conv_extend(rows, history, weight, n_rows)
            heads = extend.conv_extend_heads(rows, pool[:, 1], slots, weight, n_rows, nk, nv, dk)
            results.append((tiling, (*plain, *heads, pool)))
    finally:
        extend.ROW_TILE, extend.STEP, extend.NUM_WARPS = default
    (_, first), *others = results
    for tiling, got in others:
        for name, a, b in zip(("out", "history", "q", "k", "v", "pool"), got, first):
            assert torch.equal(a, b), f"{name} at rows / step / warps {tiling}"


@interpreted
def test_conv_extend_tilings_agree_bit_for_bit():
    conv_tilings_agree("cpu")


def test_conv_history_writes_without_a_slot_leave_the_pool_as_it_was():
    """write_histories (the torch route's one index_put_): lanes without a slot write nothing wherever they
    sit among the others, and with no lane holding a slot the pool is unchanged."""
    from deltaflash.ops.conv.extend import write_histories

    gen = torch.Generator().manual_seed(5)
    for slots in ([-1, 3, -1, 0], [2, -1, -1, 5], [-1, -1, -1, -1], [4, 1, 0, 2]):
        pool = torch.randn(6, 3, 2, generator=gen)
        new = torch.randn(4, 3, 2, generator=gen)
        want = pool.clone()
        for lane, slot in enumerate(slots):
            if slot >= 0:
                want[slot] = new[lane]
        with no_host_reads():  # a prefill graph captures it
            write_histories(pool, torch.tensor(slots), new)
        assert torch.equal(pool, want), slots


def test_conv_histories_are_read_and_written_without_a_host_read():
    """The torch route of the prefill conv runs inside prefill graphs on CUDA: no op of it may read a
    device value on the host (an `.item()`, or indexing by a 0-dim tensor), which voids a capture."""
    from deltaflash.ops.conv.extend import conv_extend_heads_ref

    rows, _, weight, n_rows = make_extend(3, 6, 48, torch.float32, seed=2)
    pool = torch.randn(5, 48, weight.shape[1] - 1)
    with no_host_reads():
        conv_extend_heads_ref(rows, pool, torch.tensor([2, -1, 0]), weight, n_rows, 2, 4, 8)
    with pytest.raises(AssertionError, match="host read"), no_host_reads():
        torch.arange(3)[torch.tensor(1)]  # the check sees the read the old write_histories made


def test_conv_extend_heads_refuses_channels_that_do_not_split():
    from deltaflash.ops.conv.extend import conv_extend_heads_ref

    rows, history, weight, n_rows = make_extend(2, 5, 40, torch.float32, seed=1)
    with pytest.raises(ValueError, match="40 channels"):  # v: 8 channels for 3 heads
        conv_extend_heads_ref(rows, history, torch.arange(2), weight, n_rows, 2, 3, 8)
    with pytest.raises(ValueError, match="slots must be"):
        conv_extend_heads_ref(rows, history, torch.arange(3), weight, n_rows, 2, 4, 8)


@interpreted
def test_conv_commit_kernel_equals_ref_on_tree_paths():
    c = make_conv(L=4, W=6, C=40, seed=16)
    L, W = 4, 6
    parents = random_tree_parents(L, W, seed=17)
    windows = torch.stack([conv_tree_step_ref(c["rows"], c["history"][:, g], c["slots"], parents, c["weight"])[1]
                           for g in range(2)])
    nodes, full = path_plan(parents, lambda lane: W - 1 - lane % 3)
    for cut in range(W + 1):
        accepted_len = torch.tensor([min(cut, n) for n in full])
        hist, hist_ref = c["history"].clone(), c["history"].clone()
        conv_commit(hist, windows, c["slots"], nodes, accepted_len)
        conv_commit_ref(hist_ref, windows, c["slots"], nodes, accepted_len)
        assert torch.equal(hist, hist_ref)


@interpreted
def test_state_commit_is_both_commits_in_one_launch():
    """The engine's one-launch commit writes the same recurrent state and conv history, to the bit, as the
    replay and conv commit kernels one after the other: tree paths cut at every length, a padding lane."""
    L, W, G = 4, 5, 2
    p, c = make_gdn(L=L, W=W, G=G, seed=18), make_conv(L=L, W=W, C=40, G=G, seed=19)
    parents = random_tree_parents(L, W, seed=20)
    logs = torch.stack([gdn_verify_ref(*verify_args({**p, "layer": g}, parents))[1] for g in range(G)])
    windows = torch.stack([conv_tree_step_ref(c["rows"], c["history"][:, g], c["slots"], parents, c["weight"])[1]
                           for g in range(G)])
    nodes, full = path_plan(parents, lambda lane: W - 1 - lane % 3)
    for cut in range(W + 1):
        accepted_len = torch.tensor([min(cut, n) for n in full])
        pool, hist = p["pool"].clone(), c["history"].clone()
        state_commit(pool, logs, hist, windows, p["slots"], nodes, accepted_len)
        pool_two, hist_two = p["pool"].clone(), c["history"].clone()
        replay_commit(pool_two, logs, p["slots"], nodes, accepted_len)
        conv_commit(hist_two, windows, c["slots"], nodes, accepted_len)
        assert torch.equal(pool, pool_two) and torch.equal(hist, hist_two)
        assert cut == 0 or not torch.equal(pool, p["pool"])  # something was committed


@pytest.mark.parametrize("route", ["reference", pytest.param("kernel", marks=interpreted)])
@pytest.mark.parametrize("case", sorted(REJECTED))
def test_rejected_commit_changes_nothing(case, route):
    """Every malformed plan raises before either commit (recurrent state, conv history) writes anything."""
    replay, conv = (replay_commit_ref, conv_commit_ref) if route == "reference" else (replay_commit, conv_commit)
    p, c = make_gdn(), make_conv()
    L, W = 3, 5
    spec = REJECTED[case]
    slots = torch.tensor(spec.get("slots", [4, -1, 1]))
    accepted_len = torch.tensor(spec.get("accepted_len", [5, 0, 3]))
    nodes = chain_parents(L, W) + 1
    if "nodes_row0" in spec:
        nodes[0] = torch.tensor(spec["nodes_row0"])
    logs = torch.stack([gdn_verify_ref(*verify_args({**p, "layer": g}, chain_parents(L, W)))[1] for g in range(3)])
    windows = torch.stack([conv_tree_step_ref(c["rows"], c["history"][:, g], c["slots"], chain_parents(L, W),
                                              c["weight"])[1] for g in range(2)])
    pool, hist = p["pool"].clone(), c["history"].clone()
    with pytest.raises(CommitRejectedError):
        replay(pool, logs, slots, nodes, accepted_len)
    with pytest.raises(CommitRejectedError):
        conv(hist, windows, slots, nodes, accepted_len)
    if route == "kernel":
        with pytest.raises(CommitRejectedError):
            state_commit(pool[:, :2], logs[:2], hist, windows, slots, nodes, accepted_len)  # G of the conv pool
    assert torch.equal(pool, p["pool"]) and torch.equal(hist, c["history"])
