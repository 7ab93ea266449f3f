"""The logit rules (penalties, logit_bias, min_tokens) against a row-by-row reference, and the penalties'
token histories kept on the device across rounds (PenaltyHistory) against building them afresh: unit
level, and through the engine with slot reuse and preemption."""

import pytest
import torch

import deltaflash.speculative.logit_rules as logit_rules
from deltaflash.core.request import SamplingParams, Sequence
from deltaflash.speculative.logit_rules import LogitRules, PenaltyHistory
from deltaflash.speculative.tree import DraftTree
from tests.spec_pairs import engine_for, make_pair, prompts
from tests.test_pages import page_bytes

V = 40


def seq(rid: str, prompt: list[int], output: list[int], slot: int, **params) -> Sequence:
    s = Sequence(rid, prompt, SamplingParams(max_new_tokens=64, **params), frozenset({3, 5}), seed=0)
    s.output_ids, s.slot = list(output), slot
    return s


def reference_row(logits_row: torch.Tensor, s: Sequence, history: list[int]) -> torch.Tensor:
    """One row's rules as the module's docstring states them, token by token. history: the output
    tokens before the row (the request's output, then the drafts on the row's own path)."""
    p, x = s.params, logits_row.clone()
    for t in range(V):
        count = history.count(t)
        if p.repetition_penalty != 1 and (count > 0 or t in s.prompt_ids):
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        x[t] = x[t] - p.frequency_penalty * count - p.presence_penalty * (count > 0)
    for t, b in p.logit_bias:
        x[t] += b
    if len(history) < p.min_tokens:
        for t in s.stop_ids:
            x[t] = float("-inf")
    return x


LANES = [  # (prompt, output, params): every rule alone, together, and none
    ([1, 2, 2, 9], [4, 4, 7], dict(repetition_penalty=1.5)),
    ([6, 7], [7, 8, 8, 8], dict(presence_penalty=0.5, frequency_penalty=0.75)),
    ([11], [12], dict(logit_bias=((12, 4.0), (13, -9.0)), min_tokens=4)),
    ([2, 3], [], dict()),
    ([5, 9, 9], [9, 1], dict(repetition_penalty=0.8, frequency_penalty=-0.5, min_tokens=3, logit_bias=((9, 1.5),))),
]


def test_rules_follow_each_rows_own_history_in_chains_and_trees():
    g = torch.Generator().manual_seed(0)
    seqs = [seq(f"r{i}", prompt, out, slot=i, **p) for i, (prompt, out, p) in enumerate(LANES)]
    L, W = len(seqs), 4
    logits = torch.randn(L, W, V, generator=g) * 3
    drafts = torch.randint(0, V, (L, W - 1), generator=g)
    rules = LogitRules.build(seqs, V, "cpu", history=PenaltyHistory(8, V, "cpu"))
    got = rules.apply(logits, drafts)
    for i, s in enumerate(seqs):
        for n in range(W):
            want = reference_row(logits[i, n], s, s.output_ids + drafts[i, :n].tolist())
            torch.testing.assert_close(got[i, n], want, rtol=0, atol=1e-6, msg=f"chain lane {i} row {n}")

    # a tree: node 0 the anchor, 1 and 2 its children, 3 under 1, 4 under 2, 5 under 3
    parents = torch.tensor([[-1, 0, 0, 1, 2, 3]]).expand(L, -1).contiguous()
    depth = torch.tensor([[0, 1, 1, 2, 2, 3]]).expand(L, -1).contiguous()
    tokens = torch.randint(0, V, (L, 6), generator=g)
    tokens[:, 1], tokens[:, 2] = 8, 7  # tokens the histories hold, so counts pass 1 on some paths
    tree = DraftTree(tokens, parents, depth, torch.zeros_like(depth), torch.arange(6).expand(L, -1),
                     torch.ones(L, 6, dtype=torch.bool), max_depth=3, top_k=2)
    logits = torch.randn(L, 6, V, generator=g) * 3
    got = rules.apply(logits, None, tree)
    for i, s in enumerate(seqs):
        for n in range(6):
            path, m = [], n
            while m > 0:  # the drafts on node n's path, the anchor (already output) left out
                path.insert(0, int(tokens[i, m]))
                m = int(parents[i, m])
            want = reference_row(logits[i, n], s, s.output_ids + path)
            torch.testing.assert_close(got[i, n], want, rtol=0, atol=1e-6, msg=f"tree lane {i} node {n}")


def test_histories_kept_across_rounds_equal_histories_built_afresh(monkeypatch):
    """Rounds that commit tokens, a retired request's slot taken by another, a request resumed in
    another slot and back in its first, a lane without penalties beside them: the kept rows always equal
    rows built from the whole prompts and outputs, and a round sends the device only its new tokens."""
    g = torch.Generator().manual_seed(1)
    sent = []

    def counting_to_device(values, device, dtype=torch.long):
        sent.append(len(values))
        return to_device(values, device, dtype)

    to_device = logit_rules.to_device
    monkeypatch.setattr(logit_rules, "to_device", counting_to_device)
    long_prompt = torch.randint(0, V, (500,), generator=g).tolist()
    a = seq("a", long_prompt, [1], slot=0, repetition_penalty=1.3)
    b = seq("b", [4, 5, 6], [], slot=1, presence_penalty=0.4)
    c = seq("c", [7], [8], slot=2)  # no penalty
    history = PenaltyHistory(4, V, "cpu")

    def check(seqs):
        kept = LogitRules.build(seqs, V, "cpu", history=history)
        sent.clear()  # (what the afresh build sends is not the point)
        fresh = LogitRules.build(seqs, V, "cpu")
        sent.clear()
        assert torch.equal(kept.counts, fresh.counts) and torch.equal(kept.seen, fresh.seen)

    def commit(*seqs):
        for s in seqs:
            s.output_ids += torch.randint(0, V, (int(torch.randint(1, 4, (), generator=g)),), generator=g).tolist()

    check([a, b, c])
    for _ in range(4):
        commit(a, b, c)
        sent.clear()
        LogitRules.build([a, b, c], V, "cpu", history=history)
        assert sum(sent) < 40, sent  # the new tokens, the lanes' rows and penalties: not the 500-token prompt
        check([a, b, c])
    # a retires; d takes its slot with more output than a had (resumed after a preemption)
    d = seq("d", [9, 9, 1], torch.randint(0, V, (len(a.output_ids) + 5,), generator=g).tolist(), slot=0,
            frequency_penalty=0.3, repetition_penalty=1.1)
    e = seq("e", [3, 3], [2], slot=3, presence_penalty=0.2)
    check([d, b, c, e])
    b.slot = 3  # e retires; b, preempted, resumes in e's slot
    commit(b, d)
    check([d, c, b])
    b.slot = 1  # and back in its first slot, whose row still holds its older history
    commit(b)
    check([b, d])
    d.output_ids = d.output_ids[:1]  # an output rolled back: the row starts again
    check([d, b])


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("rules"), "dense_gqa", "dflash", seed=5, block_size=4)


@pytest.mark.parametrize("speculative", [True, False], ids=["spec", "target-only"])
def test_penalized_greedy_outputs_equal_with_kept_and_fresh_histories(pair, speculative):
    """Six penalized and plain requests through four slots and a pool so small that sequences are
    preempted and resumed: outputs equal those of an engine with room for all that builds every
    round's histories afresh."""
    draft = pair[1] if speculative else None
    batch = prompts(96, [10, 7, 12, 9, 6, 11], seed=8)
    params = [SamplingParams(max_new_tokens=40, ignore_eos=True, **p) for p in (
        dict(repetition_penalty=1.4), dict(presence_penalty=0.6, frequency_penalty=0.4), dict(),
        dict(repetition_penalty=1.2, frequency_penalty=0.3), dict(presence_penalty=1.0), dict(repetition_penalty=2.0))]
    config = dict(max_slots=4, max_model_len=64, page_size=4)

    def outputs(engine, params=params):
        ids = [engine.add_request(p, sp) for p, sp in zip(batch, params)]
        out = {i: [] for i in ids}
        while engine.has_work():
            for ev in engine.step():
                out[ev.request_id] += ev.token_ids
        return [out[i] for i in ids]

    roomy = engine_for(pair[0], draft, **(config | dict(max_slots=6)))
    roomy.runner.penalty_history = None  # every round builds its histories from the whole prompts and outputs
    tight = engine_for(pair[0], draft, kv_cache_memory=26 * page_bytes(pair[0], draft, page_size=4), **config)
    want, got = outputs(roomy), outputs(tight)
    assert tight.stats["preemptions"] > 0 and got == want
    unruled = outputs(engine_for(pair[0], draft, **config), [SamplingParams(max_new_tokens=40, ignore_eos=True)] * 6)
    assert sum(a != b for a, b in zip(unruled, want)) >= 4  # the penalties changed most outputs
