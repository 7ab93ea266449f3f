"""Tree speculation: trees built best-first from a DFlash block, verified in one forward, accepted along a
root path (greedy: exact; sampling: lossless), committed by replaying the accepted path."""

import itertools

import pytest
import torch
from scipy.stats import chi2_contingency

import deltaflash.engine.runner as runner_module
from deltaflash.core.request import SamplingParams
from deltaflash.errors import DeltaflashError
from deltaflash.models.loader import load_model
from deltaflash.ops.tree import naive as tree_naive
from deltaflash.speculative import tree as tree_module
from deltaflash.speculative.acceptance import Accepted
from deltaflash.speculative.draft import _select_candidates
from deltaflash.speculative.sampling import LaneSampling
from deltaflash.speculative.sources import ScriptedSource
from deltaflash.speculative.tree import DraftTree, accept_tree, build_tree, dflash2_children, dflash_children
from tests.spec_pairs import EagerGraph, engine_for, make_pair, peaked_pair, prompts

BLOCK = 6


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    root = tmp_path_factory.mktemp("trees")
    return {(kind, variant): make_pair(root, kind=kind, variant=variant, block_size=BLOCK)
            for kind, variant in (("dense_gqa", "dflash"), ("dense_gqa", "dflash2"), ("moe", "dflash"))}


def greedy(engine, batch, new=20, **params):
    done, _ = engine.generate(batch, SamplingParams(max_new_tokens=new, ignore_eos=True, **params))
    return done


def record_off_chain(monkeypatch) -> list[int]:
    """Counts, per tree round, the accepted nodes that are not their parent's best candidate."""
    seen, real = [], tree_module.accept_tree

    def recording(logits, tree, *args, **kwargs):
        acc = real(logits, tree, *args, **kwargs)
        steps = torch.arange(acc.path.shape[1], device=acc.counts.device)[None] <= acc.counts[:, None]
        seen.append(int(((tree.rank.gather(1, acc.path) > 0) & steps).sum()))
        return acc

    monkeypatch.setattr(runner_module, "accept_tree", recording)
    return seen


def kernel_device(kernel) -> str:
    """Where a Triton kernel's test runs: the CPU when it is interpreted, else CUDA (skipped without)."""
    from triton.runtime.interpreter import InterpretedFunction
    if isinstance(kernel, InterpretedFunction):
        return "cpu"
    if not torch.cuda.is_available():
        pytest.skip("a Triton kernel needs TRITON_INTERPRET=1 before import (CPU) or CUDA")
    return "cuda"


# ---- the tree builder --------------------------------------------------------------------------------
def test_tree_holds_the_best_nodes_by_path_score():
    g = torch.Generator().manual_seed(0)
    L, D, V, k = 3, 4, 11, 3
    logits = torch.randn(L, D, V, generator=g) * 2
    anchors = torch.tensor([1, 2, 3])
    log_p, tokens = logits.log_softmax(-1).topk(k, -1)
    for budget in (2, 9, 30):
        tree = build_tree(dflash_children(logits, k), anchors, D, budget, k)
        assert tree.tokens.shape == (L, budget) and (tree.tokens[:, 0] == anchors).all()
        for lane in range(L):
            scored = sorted(((sum(log_p[lane, d, r].item() for d, r in enumerate(ranks)), ranks)
                             for depth in range(1, D + 1) for ranks in itertools.product(range(k), repeat=depth)),
                            reverse=True)
            paths = set()
            for n in range(1, budget):
                assert 0 <= tree.parents[lane, n] < n and tree.depth[lane, n] == tree.depth[lane, tree.parents[lane, n]] + 1
                assert tree.tokens[lane, n] == tokens[lane, tree.depth[lane, n] - 1, tree.rank[lane, n]]
                ranks, m = [], n
                while m > 0:
                    ranks.append(int(tree.rank[lane, m]))
                    m = int(tree.parents[lane, m])
                paths.add(tuple(reversed(ranks)))
            assert paths == {ranks for _, ranks in scored[:budget - 1]}
        cuts = (1, min(4, budget), budget)
        cut = tree.cut(torch.tensor(cuts))  # a lane's best b nodes form a tree too
        for lane, b in enumerate(cuts):
            assert int(cut.valid[lane].sum()) == b
            kept = cut.valid[lane]
            assert all(kept[tree.parents[lane, n]] for n in range(1, budget) if kept[n])


@pytest.mark.parametrize("ties", [False, True])
def test_ranked_tree_kernel_builds_the_reference_trees(ties):
    """ops/tree/build.py (one launch, a best-first search per lane) builds build_ranked_tree's trees to the
    last field: random candidates, and candidates whose log-probabilities tie (rounded to a coarse grid,
    as a scripted drafter's equal logits do), at several budgets."""
    from deltaflash.ops.tree.build import ranked_tree, ranked_tree_kernel
    device = kernel_device(ranked_tree_kernel)
    g = torch.Generator().manual_seed(5)
    L, D, V, k = 6, 7, 50, 3
    log_p, tokens = (3 * torch.randn(L, D, V, generator=g)).log_softmax(-1).topk(k, dim=-1)
    if ties:
        log_p = (log_p * 2).round() / 2
    anchors = torch.randint(V, (L,), generator=g)
    for budget in (2, 5, 16, 23):
        want = tree_naive.build_ranked_tree_ref(log_p, tokens, anchors, budget)
        got = ranked_tree(log_p.to(device), tokens.to(device), anchors.to(device), budget)
        for name, a, b in zip(("tokens", "parents", "depth", "rank", "order"), got, want):
            assert torch.equal(a.cpu(), b), f"budget {budget}: {name} differs"
    assert ties or (want[2] > 1).any()


@pytest.mark.parametrize("V, block", [(50, None), (300, 64)])
def test_vocab_top_k_kernel_gives_the_stable_sort_order(V, block, monkeypatch):
    """ops/tree/topk.py: each row's k best values and their indices, best first, equal values in index order -
    the stable descending sort's - in one launch (a row within one program) and across chunks merged by a
    second launch (a small BLOCK here; a real vocabulary at the default). Rows with heavy ties (values on a
    coarse grid) and -inf entries; k up to the row's length."""
    from deltaflash.ops.tree import topk
    device = kernel_device(topk.chunk_top_k_kernel)
    if block:
        monkeypatch.setattr(topk, "BLOCK", block)
    g = torch.Generator().manual_seed(V)
    x = torch.randn(2, 3, V, generator=g).to(device)
    tied = (x * 2).round() / 2
    tied[0, 1, ::3] = float("-inf")
    for rows in (x, tied):
        for k in (1, 4, 7, V):
            want_v, want_i = tree_naive.row_top_k(rows, k)
            got_v, got_i = topk.row_top_k(rows, k)
            assert torch.equal(got_i, want_i) and torch.equal(got_v, want_v), (k, rows is tied)
    assert (tree_naive.row_top_k(tied, 4)[0][..., 1:] == tree_naive.row_top_k(tied, 4)[0][..., :-1]).any()
    with pytest.raises(ValueError):
        topk.row_top_k(x.double(), 2)
    with pytest.raises(ValueError):
        topk.row_top_k(x, V + 1)


def test_ancestor_mask_kernel_gives_the_reference_mask():
    """ops/tree/ancestors.py equals core.batch.ancestor_mask (reachability by squaring) to the bit: random
    forests (parents of -1 below the root too), chains, a single node, widths that are not powers of two."""
    from deltaflash.core.batch import ancestor_mask as reference
    from deltaflash.ops.tree import ancestors
    device = kernel_device(ancestors.ancestor_mask_kernel)
    g = torch.Generator().manual_seed(1)
    for N in (1, 2, 5, 16, 33):
        forest = torch.stack([torch.tensor([-1] + [int(torch.randint(-1, n, (1,), generator=g)) for n in range(1, N)])
                              for _ in range(4)])
        deep = torch.stack([(torch.arange(N) - 1), torch.where(torch.arange(N) > 0, 0, -1)])  # a chain, a star
        for parents in (forest.to(device), deep.to(device)):
            got = ancestors.ancestor_mask(parents)
            assert got.dtype == torch.bool and torch.equal(got, reference(parents)), N
    assert ancestors.ancestor_mask(torch.empty(0, 4, dtype=torch.long, device=device)).shape == (0, 4, 4)


def test_dflash2_tree_follows_the_selector_walk(pairs):
    """The rank-0 path of a DFlash2 tree is the selector's own greedy walk (scores given the parent token)."""
    from deltaflash.models.dflash import load_drafter

    target, draft = pairs[("dense_gqa", "dflash2")]
    cfg = load_model(target, device="cpu", progress=False).cfg
    drafter = load_drafter(draft, target_hidden_size=cfg.hidden_size, target_vocab_size=cfg.vocab_size,
                           target_num_layers=cfg.num_layers, dtype=torch.float32, device="cpu")
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, BLOCK - 1, cfg.hidden_size, generator=g)
    logits = 4 * torch.randn(2, BLOCK - 1, cfg.vocab_size, generator=g)  # peaked: the best path runs deep
    anchors = torch.tensor([5, 7])
    walk = _select_candidates(drafter, hidden, logits, anchors, LaneSampling.greedy_lanes(2, "cpu")).tokens
    with torch.no_grad():
        tree = build_tree(dflash2_children(drafter.candidate_selector, hidden, logits, 3), anchors, BLOCK - 1, 24, 3)
    for lane in range(2):
        node, chain = 0, []
        for _ in range(BLOCK - 1):
            kids = [n for n in range(24) if tree.parents[lane, n] == node and tree.rank[lane, n] == 0]
            if not kids:
                break
            node = kids[0]
            chain.append(int(tree.tokens[lane, node]))
        assert chain == walk[lane, :len(chain)].tolist() and len(chain) >= 3


# ---- acceptance --------------------------------------------------------------------------------------
def walk_greedy(tree: DraftTree, logits: torch.Tensor, lane: int, limit: int) -> list[int]:
    """Reference: from the root, step to the valid child holding the argmax while one exists."""
    node, path = 0, [0]
    while len(path) - 1 < limit:
        best = int(logits[lane, node].argmax())
        kids = [n for n in range(tree.budget) if tree.parents[lane, n] == node and tree.valid[lane, n]
                and tree.tokens[lane, n] == best]
        if not kids:
            break
        node = kids[0]
        path.append(node)
    return path


def test_greedy_acceptance_walks_to_the_argmax_child():
    g = torch.Generator().manual_seed(2)
    L, D, V, k, N = 6, 5, 7, 3, 14
    tree = build_tree(dflash_children(4 * torch.randn(L, D, V, generator=g), k), torch.zeros(L, dtype=torch.long), D, N, k)
    tree = tree.cut(torch.tensor([N, N, N, 5, N, N]))
    logits = torch.randn(L, N, V, generator=g)
    for lane in range(L):  # make some argmaxes hit children, so paths run deep
        for n in range(N):
            kids = [m for m in range(N) if tree.parents[lane, m] == n]
            if kids and (lane in (0, 3) or (lane + n) % 3):  # lanes 0 and 3: every node points at a child
                logits[lane, n, tree.tokens[lane, kids[(lane + n) % len(kids)]]] = 10.0
    limits = torch.tensor([5, 2, 0, 5, 5, 5])
    acc = accept_tree(logits, tree, limits, LaneSampling.greedy_lanes(L, "cpu"))
    depths = []
    for lane in range(L):
        path = walk_greedy(tree, logits, lane, int(limits[lane]))
        n = len(path) - 1
        assert int(acc.counts[lane]) == n and acc.path[lane, :n + 1].tolist() == path
        assert acc.tokens[lane, :n].tolist() == tree.tokens[lane, path[1:]].tolist()
        assert int(acc.tokens[lane, n]) == int(logits[lane, path[-1]].argmax())
        depths.append(n)
    assert max(depths) >= 3 and depths[2] == 0


def walk_kernel():
    """The one-launch greedy walk (ops/tree): interpreted on CPU, or on CUDA."""
    from triton.runtime.interpreter import InterpretedFunction

    from deltaflash.ops.tree.greedy_walk import greedy_walk, greedy_walk_kernel
    if not isinstance(greedy_walk_kernel, InterpretedFunction):
        pytest.skip("the walk kernel on CPU needs TRITON_INTERPRET=1 before import")
    return greedy_walk


@pytest.mark.parametrize("walk", ["torch", "kernel"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_acceptance_equals_the_walk_on_random_trees(seed, walk):
    """accept_tree's greedy acceptance - the loop-free torch route, or the one-launch kernel - against the
    step-by-step walk: random trees, budgets cut per lane, depth limits, and target argmaxes that follow a
    random child at most nodes."""
    walk = walk_kernel() if walk == "kernel" else None
    g = torch.Generator().manual_seed(seed)
    L, D, V, k, N = 40, 6, 9, 3, 20
    tree = build_tree(dflash_children(3 * torch.randn(L, D, V, generator=g), k), torch.zeros(L, dtype=torch.long), D, N, k)
    tree = tree.cut(torch.randint(1, N + 1, (L,), generator=g))
    logits = torch.randn(L, N, V, generator=g)
    for lane in range(L):
        for n in range(N):
            kids = [m for m in range(N) if tree.parents[lane, m] == n]
            if kids and torch.rand((), generator=g) < 0.8:
                logits[lane, n, tree.tokens[lane, kids[int(torch.randint(len(kids), (), generator=g))]]] = 10.0
    limits = torch.randint(0, D + 1, (L,), generator=g)
    acc = accept_tree(logits, tree, limits, LaneSampling.greedy_lanes(L, "cpu"), walk=walk)
    for lane in range(L):
        path = walk_greedy(tree, logits, lane, int(limits[lane]))
        n = len(path) - 1
        assert int(acc.counts[lane]) == n and acc.path[lane, :n + 1].tolist() == path
        assert int(acc.tokens[lane, n]) == int(logits[lane, path[-1]].argmax())
    assert int(acc.counts.max()) >= 4


def test_greedy_walks_take_the_lower_ranked_of_equal_siblings():
    """Siblings holding the same token (DFlash2 candidates may repeat): both walks take the lower rank."""
    tokens = torch.tensor([[5, 7, 7, 3, 3]])  # nodes 1 (rank 1) and 2 (rank 0) under the root hold 7
    tree = DraftTree(tokens=tokens, parents=torch.tensor([[-1, 0, 0, 1, 2]]), depth=torch.tensor([[0, 1, 1, 2, 2]]),
                     rank=torch.tensor([[0, 1, 0, 0, 0]]), order=torch.arange(5)[None],
                     valid=torch.ones(1, 5, dtype=torch.bool), max_depth=2, top_k=2)
    greedy_next = torch.tensor([[7, 3, 3, 0, 0]])
    for walk in (tree_naive.greedy_walk, walk_kernel()):
        path, last = walk(tree, greedy_next, torch.tensor([2]))
        assert path.tolist() == [[2, 4]] and last.tolist() == [4]


def test_sampled_acceptance_draws_the_first_token_from_p():
    """Whatever the tree, the first emitted token is distributed as p at the root."""
    g = torch.Generator().manual_seed(3)
    V, N, k, draws = 6, 7, 3, 6000
    tree = build_tree(dflash_children(torch.randn(1, 3, V, generator=g) * 3, k), torch.zeros(1, dtype=torch.long), 3, N, k)
    logits = torch.randn(1, N, V, generator=g) * 1.5
    params = SamplingParams(temperature=1.0)
    lanes = 2000
    big = DraftTree(*(t.expand(lanes, -1) for t in (tree.tokens, tree.parents, tree.depth, tree.rank, tree.order,
                                                     tree.valid)), tree.max_depth, tree.top_k)
    firsts = []
    for batch in range(draws // lanes):
        sampling = LaneSampling.build([params] * lanes, [batch] * lanes, list(range(lanes)), "cpu")
        acc = accept_tree(logits.expand(lanes, -1, -1), big, torch.full((lanes,), 3), sampling)
        firsts.append(acc.tokens[:, 0])
    seen = torch.bincount(torch.cat(firsts), minlength=V).float()
    expected = logits[0, 0].softmax(-1) * draws
    assert (expected[seen == 0] < 1).all()
    chi2 = ((seen - expected) ** 2 / expected.clamp(min=1e-9)).sum()
    assert chi2 < 25  # 5 degrees of freedom: p < 1e-4 beyond this


# ---- the engine ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind,variant", [("dense_gqa", "dflash"), ("dense_gqa", "dflash2"), ("moe", "dflash")])
@pytest.mark.parametrize("lanes", [1, 8])
def test_greedy_tree_speculation_equals_target_only(pairs, kind, variant, lanes):
    target, draft = pairs[(kind, variant)]
    batch = prompts(96, [3, 11, 17, 8, 5, 2, 9, 13][:lanes], seed=lanes)
    plain = [c.token_ids for c in greedy(engine_for(target, max_model_len=64, page_size=4), batch)]
    for budget in (5, 16):
        tree = engine_for(target, draft, tree_budget=budget, tree_top_k=3, tree_max_lanes=0, max_model_len=64,
                          page_size=4)
        assert [c.token_ids for c in greedy(tree, batch)] == plain


def test_scripted_trees_accept_off_the_top1_chain_and_stay_exact(pairs, monkeypatch):
    """Trees whose best candidate is sometimes wrong and the right token second: the accepted paths leave
    the top-1 chain, acceptance beats the chain's, and the output is still target-only greedy's
    (penalties on too)."""
    target, _ = pairs[("dense_gqa", "dflash")]
    batch = prompts(96, [4, 9, 6, 12], seed=5)
    for rules in ({}, {"presence_penalty": 0.4, "repetition_penalty": 1.3}):
        plain = [c.token_ids for c in greedy(engine_for(target, max_model_len=64, page_size=4), batch, **rules)]
        scripts = {tuple(p): out for p, out in zip(batch, plain)}
        mean = {}
        for budget in (0, 16):
            off_chain = record_off_chain(monkeypatch)
            source = ScriptedSource(scripts, BLOCK, 96, corrupt=0.3, seed=7)
            engine = engine_for(target, draft_source=source, tree_budget=budget, tree_max_lanes=0, max_model_len=64,
                                page_size=4)
            done = greedy(engine, batch, **rules)
            assert [c.token_ids for c in done] == plain
            accepted = [n for c in done for n in c.accepted_lengths]
            mean[budget] = sum(accepted) / len(accepted)
            if budget:
                assert sum(off_chain) > 0
        assert mean[16] > mean[0]


def test_per_request_budgets_in_a_tree_round(pairs):
    """A request may ask for a smaller tree (1: no speculation); all stay exact beside full trees."""
    target, _ = pairs[("dense_gqa", "dflash")]
    batch = prompts(96, [4, 9, 6], seed=6)
    plain = [c.token_ids for c in greedy(engine_for(target, max_model_len=64), batch)]
    source = ScriptedSource({tuple(p): out for p, out in zip(batch, plain)}, BLOCK, 96, corrupt=0.2, seed=3)
    engine = engine_for(target, draft_source=source, tree_budget=12, tree_max_lanes=0, max_model_len=64)
    budgets = [None, 1, 4]
    done, _ = engine.generate(batch, [SamplingParams(max_new_tokens=20, ignore_eos=True, tree_budget=b) for b in budgets])
    assert [c.token_ids for c in done] == plain
    assert set(done[1].accepted_lengths) == {1} and max(done[0].accepted_lengths) > 2


VOCAB, DRAWS, TOKENS = 12, 1200, 3
PROMPT = [3, 1, 4, 1, 5]


@pytest.fixture(scope="module")
def peaked(tmp_path_factory):
    target, drafts = peaked_pair(tmp_path_factory.mktemp("tree-sampling"), VOCAB)
    return target, drafts["dflash"]


def sampled(engine, base):
    params = [SamplingParams(max_new_tokens=TOKENS, temperature=1.0, seed=base + i, ignore_eos=True) for i in range(DRAWS)]
    done, _ = engine.generate([PROMPT] * DRAWS, params)
    return torch.tensor([c.token_ids for c in done])


def p_values(a, b) -> list[float]:
    """Homogeneity of each position's token distribution, and of the (t1, t2) pair, between two samples."""
    out = []
    for x, y in zip([a[:, i] for i in range(TOKENS)] + [a[:, 0] * VOCAB + a[:, 1]],
                    [b[:, i] for i in range(TOKENS)] + [b[:, 0] * VOCAB + b[:, 1]]):
        cells = sorted(set(x.tolist()) | set(y.tolist()))
        table = torch.tensor([[int((x == c).sum()), int((y == c).sum())] for c in cells])
        rare = table.sum(1) < 10
        table = torch.cat([table[~rare], table[rare].sum(0, keepdim=True)]) if rare.any() else table
        out.append(chi2_contingency(table.numpy())[1])
    return out


def accept_first_child(logits, tree, depth_limit, sampling, top_logprobs=None, raw=None, walk=None):
    """A broken rule: always accept the best child (no rejection), down to the depth limit."""
    L, device = logits.shape[0], logits.device
    path, node = [torch.zeros(L, dtype=torch.long, device=device)], torch.zeros(L, dtype=torch.long, device=device)
    for _ in range(int(depth_limit.max())):
        node = tree_module.children_by_rank(tree)[torch.arange(L, device=device), node, 0].clamp(min=0)
        path.append(node)
    path = torch.stack(path, 1)
    counts = torch.minimum(depth_limit, torch.full_like(depth_limit, path.shape[1] - 1))
    tokens = torch.cat([tree.tokens.gather(1, path[:, 1:]), logits[:, 0].argmax(-1, keepdim=True)], 1)
    full = torch.zeros(L, tree.max_depth + 1, dtype=torch.long, device=device)
    full[:, :path.shape[1]] = path
    toks = torch.zeros(L, tree.max_depth + 1, dtype=torch.long, device=device)
    toks[:, :tokens.shape[1]] = tokens
    return Accepted(counts=counts, tokens=toks, path=full)


def test_sampled_tree_speculation_keeps_the_target_distribution(peaked, monkeypatch):
    target, draft = peaked
    plain = sampled(engine_for(target, max_slots=64), 0)
    off_chain = record_off_chain(monkeypatch)
    # (sampled rounds never replay a greedy round graph; its capture would meet the patched acceptance's reads)
    config = dict(max_slots=64, tree_budget=8, tree_top_k=3, tree_max_lanes=0, round_graphs=False)
    trees = sampled(engine_for(target, draft, **config), 100_000)
    assert min(p_values(plain, trees)) > 1e-3
    assert sum(off_chain) > 0  # sampled walks accepted candidates other than the best
    monkeypatch.setattr(runner_module, "accept_tree", accept_first_child)
    broken = sampled(engine_for(target, draft, **config), 200_000)
    assert min(p_values(plain, broken)) < 1e-4


def test_rounds_of_more_lanes_than_tree_max_lanes_verify_chains(pairs, monkeypatch):
    """With tree_max_lanes 1, a round of two lanes verifies top-1 chains of the block and a round of one
    lane a tree; the outputs are target-only greedy's either way."""
    target, draft = pairs[("dense_gqa", "dflash")]
    batch = prompts(96, [3, 11], seed=5)
    plain = [c.token_ids for c in greedy(engine_for(target, max_model_len=64, page_size=4), batch)]
    engine = engine_for(target, draft, tree_budget=8, tree_top_k=3, tree_max_lanes=1, max_model_len=64, page_size=4)
    assert engine.scheduler.tree_choice is None and engine.runner.widths == (1, BLOCK)
    rounds, real_round = [], engine.runner._round
    monkeypatch.setattr(engine.runner, "_round", lambda plan: (rounds.append((len(plan.decode), plan.tree_budget,
                                                                             plan.round_width)), real_round(plan))[1])
    done = engine.generate(batch, [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (8, 20)])[0]
    speculative = [r for r in rounds if r[2] > 1]
    assert {r for r in speculative if r[0] == 2} and all(r[1:] == (0, BLOCK) for r in speculative if r[0] == 2)
    assert {r for r in speculative if r[0] == 1} and all(r[1:] == (8, 8) for r in speculative if r[0] == 1)
    assert [c.token_ids for c in done] == [plain[0][:8], plain[1]]


def test_trees_or_chains_by_measured_tokens_per_second(pairs, monkeypatch):
    """By default (tree_max_lanes None) a tree engine's rounds take trees or chains by what each has measured
    at the round's lane bucket (TreeChoice): at a bucket without figures the first round verifies a tree and
    the next a chain; with chains made to look faster at two lanes and trees at one, two-lane rounds verify
    chains and one-lane rounds trees. The outputs are target-only greedy's throughout, and step reports
    say which rounds were trees."""
    target, draft = pairs[("dense_gqa", "dflash")]
    batch = prompts(96, [3, 11], seed=5)
    plain = [c.token_ids for c in greedy(engine_for(target, max_model_len=64, page_size=4), batch, new=40)]
    engine = engine_for(target, draft, tree_budget=8, tree_top_k=3, max_model_len=64, page_size=4)
    choice = engine.scheduler.tree_choice
    assert engine.config.costed_trees and choice is not None and engine.runner.widths == (1, BLOCK)
    rounds, real_round = [], engine.runner._round
    monkeypatch.setattr(engine.runner, "_round", lambda plan: (rounds.append((len(plan.decode), plan.tree_budget,
                                                                             plan.round_width)), real_round(plan))[1])
    # what a round "took" by lanes and mode, whatever the CPU's timing says: 8x apart, more than tokens per
    # lane can differ (1 to BLOCK), so the choice follows the cost
    seconds = {(1, True): 0.125, (1, False): 1.0, (2, True): 1.0, (2, False): 0.125}
    observe = choice.observe
    monkeypatch.setattr(choice, "observe", lambda lanes, trees, s, tokens, clean=True: observe(
        lanes, trees, seconds[(lanes, trees)], tokens, clean))
    reports = []
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (12, 40)]
    ids = [engine.add_request(p, q) for p, q in zip(batch, params)]
    out = {i: [] for i in ids}
    while engine.has_work():
        for event in engine.step(reports.append):
            out[event.request_id] += event.token_ids
    two = [r[1] for r in rounds if r[0] == 2 and r[2] > 1]
    one = [r[1] for r in rounds if r[0] == 1 and r[2] > 1]
    assert two[:2] == [8, 0] and two[2:] and set(two[2:]) <= {0, 8} and two[2:].count(0) > two[2:].count(8)
    assert one[:2] == [8, 0] and one[2:] and one[2:].count(8) > one[2:].count(0)
    assert [r.tree_budget for r in reports if any(w > 1 for w in r.widths)] == [r[1] for r in rounds if r[2] > 1]
    assert [out[i] for i in ids] == [plain[0][:12], plain[1]]


def test_the_warm_requests_run_trees_and_chains(pairs, monkeypatch):
    """Start-up's warm requests (run on CUDA before the first client) take a tree engine that may also
    verify chains through both kinds of round - seeded sampled lanes included, which alone would always
    verify trees - and leave the choice free afterwards; an engine of trees at every load runs trees only."""
    target, draft = pairs[("dense_gqa", "dflash")]
    for max_lanes, want in ((None, {0, 8}), (0, {8})):
        engine = engine_for(target, draft, tree_budget=8, tree_top_k=3, tree_max_lanes=max_lanes, max_model_len=64)
        kinds, execute = [], engine.runner.execute

        def recording(plan, *args, **kwargs):
            if plan.round_width > 1:
                kinds.append((plan.tree_budget, any(s.params.seed is not None for s in plan.decode)))
            return execute(plan, *args, **kwargs)

        monkeypatch.setattr(engine.runner, "execute", recording)
        engine._warm_requests()
        assert {budget for budget, _ in kinds} == want
        if 0 in want:  # chains with the seeded sampled lane in them too
            assert (0, True) in kinds
        assert engine.scheduler.pin.trees is None and not engine.has_work()


def test_a_seeded_sampled_request_verifies_trees_at_any_load(pairs):
    """A seeded sampled request must not draw differently as the load changes: every round holding one
    verifies trees, whatever tree_max_lanes says for its lanes (here: chains above one lane)."""
    target, draft = pairs[("dense_gqa", "dflash")]
    batch = prompts(96, [3, 11], seed=5)
    seeded = SamplingParams(max_new_tokens=16, temperature=0.8, seed=3, ignore_eos=True)
    alone = engine_for(target, draft, tree_budget=8, tree_top_k=3, tree_max_lanes=1, max_model_len=64,
                       page_size=4).generate([batch[0]], [seeded])[0][0].token_ids
    engine = engine_for(target, draft, tree_budget=8, tree_top_k=3, tree_max_lanes=1, max_model_len=64, page_size=4)
    reports = []
    first = engine.add_request(batch[0], seeded)
    engine.add_request(batch[1], SamplingParams(max_new_tokens=16, ignore_eos=True))
    out = []
    while engine.has_work():
        out += [t for e in engine.step(reports.append) if e.request_id == first for t in e.token_ids]
    assert {r.tree_budget for r in reports if r.decode_lanes == 2 and any(w > 1 for w in r.widths)} == {8}
    assert out == alone


def test_tree_options_are_checked(pairs):
    target, draft = pairs[("dense_gqa", "dflash")]
    with pytest.raises(DeltaflashError, match="needs a drafter"):
        engine_for(target, tree_budget=8)
    with pytest.raises(DeltaflashError, match="does not fit"):
        engine_for(target, draft, tree_budget=40, tree_top_k=1)
    with pytest.raises(DeltaflashError, match=r"in \[2, 64\]"):
        engine_for(target, draft, tree_budget=65)


@pytest.mark.parametrize("route,budget", [("reference", 16), ("fused", 16), ("fused", 5), ("round graph", 16)])
def test_tree_commits_leave_the_state_of_plain_decoding(pairs, monkeypatch, route, budget):
    """After rounds that accepted paths off the top-1 chain, every committed position's K/V (moved there
    from its node's row) and the GDN state equal those of target-only decoding of the same tokens. The
    reference kernels commit after the step's read, from the paths read; the fused kernels on the device
    before it (commit_unread_tree); a greedy tree round's graph (round_graphs: the function it captures,
    run eagerly in its place) inside the round - and then no commit happens anywhere else. A budget below
    the block bounds how deep a lane may accept by the tree's nodes, not by the block."""
    target, _ = pairs[("dense_gqa", "dflash")]
    prompt = prompts(96, [7], seed=12)[0]
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    plain = engine_for(target, max_model_len=64, max_slots=1)
    expected = plain.generate([prompt], params)[0][0].token_ids
    off_chain = record_off_chain(monkeypatch)
    source = ScriptedSource({tuple(prompt): expected}, BLOCK, 96, corrupt=0.4, seed=2)
    kernels = "reference" if route == "reference" else "triton"
    tree = engine_for(target, draft_source=source, tree_budget=budget, tree_max_lanes=0, max_model_len=64,
                      max_slots=1, kernels=kernels, round_graphs=False)  # (the round graph route: stood in below)
    runner, commits = tree.runner, []
    real_unread, real_late = runner_module.commit_unread_tree, runner._commit
    monkeypatch.setattr(runner_module, "commit_unread_tree", lambda *a: (commits.append("unread"), real_unread(*a)))
    monkeypatch.setattr(runner, "_commit", lambda *a: (commits.append("late"), real_late(*a)))
    if route == "round graph":  # the scripted trees stand in for the drafter's block (a host lookup: not capturable)
        graph = EagerGraph(runner._greedy_tree_round)
        monkeypatch.setattr(runner, "round_graphs", {("tree", 16): graph})
        seq_of = lambda slot_ids: [s for i in slot_ids.tolist() for s in tree.scheduler.running.values()  # noqa: E731
                                   if s.slot == i]
        monkeypatch.setattr(source, "greedy_tree", lambda slot_ids, anchors, start: source.draft_tree(
            seq_of(slot_ids), slot_ids, anchors, start, 16, tree.config.tree_top_k), raising=False)
    done = tree.generate([prompt], params)[0][0]
    # (a budget of 5 nodes under a block of 6 builds the top-1 chain: these trees score it above any branch)
    assert done.token_ids == expected and (sum(off_chain) > 0 or budget < BLOCK)
    rounds = len(done.accepted_lengths)  # the tree rounds (a width-1 round commits in its decode)
    want = {"reference": ["late"] * rounds, "fused": ["unread"] * rounds, "round graph": []}[route]
    assert rounds >= 3 and commits == want and (route != "round graph" or graph.calls == rounds)
    n = min(plain.pool.lengths[0], tree.pool.lengths[0])
    assert n >= len(prompt) + 20
    for a, b in zip(tree.pool.kv_of(0, n), plain.pool.kv_of(0, n)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    if plain.pool.lengths[0] == tree.pool.lengths[0]:
        torch.testing.assert_close(tree.pool.recurrent_state[0], plain.pool.recurrent_state[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(tree.pool.conv_history[0], plain.pool.conv_history[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("variant,kernels", [("dflash", None), ("dflash2", None), ("dflash", "triton")])
def test_the_tree_graphs_function_builds_the_trees_drafting_builds(pairs, variant, kernels):
    """What the drafter's tree graph captures on CUDA (the block forward over whole tables, then
    build_tree, returned as tensors) gives the trees eager drafting builds; with the Triton kernel set
    (interpreted on CPU), DFlash trees come from ops/tree/build.py's kernel: the torch reference's trees."""
    from deltaflash.core.request import Status

    if kernels == "triton" and not torch.cuda.is_available():
        walk_kernel()  # (skips unless the kernels are interpreted)
    target, draft = pairs[("dense_gqa", variant)]
    engine = engine_for(target, draft, tree_budget=8, tree_top_k=3, **({"kernels": kernels} if kernels else {}))
    source = engine.runner.source
    assert source.tree == (8, 3)
    assert (source.tree_graphs is None) == (engine.device.type == "cpu")  # graphs on CUDA only
    for p in prompts(96, [5, 11, 3], seed=4):
        engine.add_request(p, SamplingParams(max_new_tokens=30, ignore_eos=True))
    while any(s.status is not Status.DECODING for s in engine.scheduler.running.values()) or engine.scheduler.waiting:
        engine.step()
    engine.step()
    seqs = list(engine.scheduler.running.values())
    lane = lambda values: torch.tensor(values, device=engine.device)  # noqa: E731
    slot_ids, anchors = lane([s.slot for s in seqs]), lane([s.pending for s in seqs])
    start = lane([s.position for s in seqs])
    with torch.inference_mode():
        eager = source._build(*source._block(seqs, slot_ids, anchors, start), slot_ids, anchors, 8, 3)  # no graph
        graphed = source.greedy_tree(slot_ids, anchors, start)  # what the tree graph and tree round graphs hold
    for name in ("tokens", "parents", "depth", "rank", "order", "valid"):
        assert torch.equal(getattr(graphed, name), getattr(eager, name)), name
    assert (graphed.max_depth, graphed.top_k) == (eager.max_depth, eager.top_k)
    if kernels == "triton":
        assert source.kernels.build_ranked_tree is not tree_naive.build_ranked_tree_ref
        assert source.kernels.vocab_top_k is not tree_naive.row_top_k
        logits = source._block(seqs, slot_ids, anchors, start)[1]
        reference = tree_naive.build_ranked_tree_ref(*tree_module.dflash_candidates(logits, 3), anchors, 8)
        for name, want in zip(("tokens", "parents", "depth", "rank", "order"), reference):
            assert torch.equal(getattr(eager, name), want), name
