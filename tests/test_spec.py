"""Lossless speculative decoding through the replay-log verify route (CPU, fp32)."""

import json
import subprocess
import sys

import pytest
import torch

from deltaflash.bundled import BUNDLED
from deltaflash.cache.commit import commit
from deltaflash.core.batch import CommitPlan, ExtendBatch, VerifyBatch
from deltaflash.core.request import SamplingParams
from deltaflash.errors import CommitRejectedError
from deltaflash.ops.kernels import reference_kernels, triton_kernels
from deltaflash.speculative.sources import ScriptedSource, pad_rows
from tests.spec_pairs import DEVICE, engine_for, give_pages, make_pair, prompts

GREEDY = SamplingParams(max_new_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pairs")
    return {
        "dflash": make_pair(root, "dense_gqa", "dflash", seed=1),
        "dflash2": make_pair(root, "dense_tied", "dflash2", seed=2, block_size=5),
        "moe": make_pair(root, "moe", "dflash", seed=3, block_size=8),
    }


def kernels():
    """The kernel set the engine uses on DEVICE (the fused kernels on CUDA)."""
    return reference_kernels() if DEVICE == "cpu" else triton_kernels()


def on_device(batch):
    """A VerifyBatch / CommitPlan built on the host, moved to DEVICE."""
    return type(batch)(*(t.to(DEVICE) if isinstance(t, torch.Tensor) else t for t in vars(batch).values()))


def target_only(target_dir, prompt_list, params=GREEDY):
    return [c.token_ids for c in engine_for(target_dir).generate(prompt_list, params)[0]]


def speculative_rounds_add_up(completion) -> bool:
    """Every token after the first came from a round: speculating rounds emit their accepted
    lengths, and only a last row-or-so (fewer tokens left than a block) may come from width-1 rounds."""
    return 0 <= len(completion.token_ids) - 1 - sum(completion.accepted_lengths) <= 1


@pytest.mark.parametrize("name", ["dflash", "dflash2", "moe"])
@pytest.mark.parametrize("concurrency", [1, 3, 8])
def test_greedy_spec_equals_target_only(pairs, name, concurrency):
    """The random drafters of these pairs accept little (exact equality is the check); the scripted
    source replaying the target's own continuation makes the same engine accept long runs."""
    target_dir, draft_dir = pairs[name]
    vocab = 96 if name != "dflash2" else 80
    plist = prompts(vocab, [3 + 7 * i for i in range(concurrency)], seed=concurrency)
    expected = target_only(target_dir, plist)
    done, _ = engine_for(target_dir, draft_dir).generate(plist, GREEDY)
    assert [c.token_ids for c in done] == expected
    assert all(c.accepted_lengths and speculative_rounds_add_up(c) for c in done)
    scripts = {tuple(p): e for p, e in zip(plist, expected)}
    source = ScriptedSource(scripts, 6, vocab, corrupt=0.05, seed=concurrency)
    done, _ = engine_for(target_dir, draft_source=source).generate(plist, GREEDY)
    assert [c.token_ids for c in done] == expected
    accepted = [n for c in done for n in c.accepted_lengths]
    assert sum(accepted) / len(accepted) > 3 and max(accepted) == 6  # drafts really were accepted


@pytest.mark.parametrize("name", ["dflash", "moe"])
@pytest.mark.parametrize("block_size", [2, 4, 9])
def test_copying_and_random_drafts_side_by_side(pairs, name, block_size):
    """Lanes with a script propose the target's own continuation (8% corrupted): long runs get
    accepted; lanes without one get random drafts: rejections at every depth."""
    target_dir, _ = pairs[name]
    plist = prompts(96, [4, 9, 15, 22, 30, 6, 12, 17], seed=block_size)
    params = SamplingParams(max_new_tokens=60, ignore_eos=True)
    expected = target_only(target_dir, plist, params)
    scripts = {tuple(p): e for p, e in list(zip(plist, expected))[:6]}
    source = ScriptedSource(scripts, block_size, 96, corrupt=0.08, seed=block_size)
    done, _ = engine_for(target_dir, draft_source=source).generate(plist, params)
    assert [c.token_ids for c in done] == expected
    seen = {n for c in done for n in c.accepted_lengths}
    # rejections at (nearly) every depth: which depths a seeded corruption hits depends on the target's
    # own continuation, which rounding makes device-dependent, so one depth of a long block may be missed
    assert {1, block_size} <= seen and len(seen) >= block_size - 1, f"accepted lengths seen: {sorted(seen)}"


def test_scripted_drafts_follow_the_script_with_the_asked_corruption():
    """The scripted source drafts each lane's next W-1 script tokens (random past the script's end, zeros on
    padding lanes); with corruption p, each token is replaced independently with probability p (drawn as
    the gaps between replaced tokens): the replaced fraction over many rounds is p, and p = 1 replaces all."""
    from deltaflash.core.request import Sequence

    seqs = [Sequence(str(i), [i] * 5, SamplingParams(max_new_tokens=64), frozenset(), 0) for i in range(3)]
    scripts = {(i,) * 5: list(range(100 * i, 100 * i + 40)) for i in range(2)}  # lane 2 has no script
    for seq, done in zip(seqs, (3, 35, 3)):
        seq.output_ids = [7] * done
    source = ScriptedSource(scripts, 8, 50_000, corrupt=0.0, seed=3)
    rows = source._script_rows(seqs, 4, corrupt=0.0)
    assert rows[0] == list(range(3, 10)) and rows[1][:5] == list(range(135, 140)) and rows[3] == [0] * 7
    assert len(rows[1]) == len(rows[2]) == 7
    for p in (0.1, 0.5, 1.0):
        replaced = sum(a != b for _ in range(400) for a, b in zip(source._script_rows(seqs[:1], 2, corrupt=p)[0],
                                                                  range(3, 10)))
        assert abs(replaced / (400 * 7) - p) < 0.03, (p, replaced)


def test_block_size_override_with_real_drafter(pairs):
    target_dir, draft_dir = pairs["dflash"]
    plist = prompts(96, [5, 12], seed=9)
    engine = engine_for(target_dir, draft_dir, block_size=3)
    assert engine.config.block_size == 3
    done, _ = engine.generate(plist, GREEDY)
    assert [c.token_ids for c in done] == target_only(target_dir, plist)
    assert all(c.accepted_lengths and speculative_rounds_add_up(c) for c in done)


def test_stop_token_and_max_tokens_cut_inside_accepted_run(pairs):
    target_dir, _ = pairs["dflash"]
    plist = prompts(96, [11, 7], seed=4)
    long = target_only(target_dir, plist, SamplingParams(max_new_tokens=30, ignore_eos=True))
    stop = long[0][12]  # a token the perfect draft will propose mid-run
    scripts = {tuple(p): e for p, e in zip(plist, long)}
    params = [SamplingParams(max_new_tokens=30, stop_token_ids=(stop,), ignore_eos=True),
              SamplingParams(max_new_tokens=5, ignore_eos=True)]
    engine = engine_for(target_dir, draft_source=ScriptedSource(scripts, 8, 96, corrupt=0.0))
    done, _ = engine.generate(plist, params)
    assert done[0].token_ids == long[0][: long[0].index(stop) + 1] and done[0].finish_reason == "stop"
    assert done[1].token_ids == long[1][:5] and done[1].finish_reason == "length"
    assert max(done[0].accepted_lengths) == 8  # the stop landed inside a fully accepted block
    assert done[1].accepted_lengths == [4]  # 4 tokens left after prefill: one round of width 4
    assert engine.num_live == 0


def test_mixed_widths_in_one_round(pairs, monkeypatch):
    """Lanes of one round verify different numbers of rows (1 = plain decoding, up to the block)."""
    target_dir, _ = pairs["dflash"]
    plist = prompts(96, [3, 14, 8, 21], seed=12)
    expected = target_only(target_dir, plist)
    scripts = {tuple(p): e for p, e in zip(plist, expected)}
    engine = engine_for(target_dir, draft_source=ScriptedSource(scripts, 6, 96, corrupt=0.3, seed=2))
    real_width, calls = engine.scheduler.width, []

    def mixed(seq):  # lane-dependent widths that change every round
        calls.append(seq)
        return max(1, min(real_width(seq), (len(calls) * 5 + len(seq.prompt_ids)) % 7))

    monkeypatch.setattr(engine.scheduler, "width", mixed)
    ids = [engine.add_request(p, GREEDY) for p in plist]
    outputs, reports = {i: [] for i in ids}, []
    while engine.has_work():
        for event in engine.step(reports.append):
            outputs[event.request_id] += event.token_ids
    assert [outputs[i] for i in ids] == expected
    assert {w for r in reports for w in r.widths} == {1, 2, 3, 4, 5, 6}
    assert any(len(set(r.widths)) >= 3 for r in reports)


def _verify_chain(engine, slot, tokens, start):
    W = len(tokens)
    chain = torch.arange(W)
    batch = VerifyBatch(input_ids=torch.tensor([tokens]), parents=(chain - 1)[None], positions=(start + chain)[None],
                        slot_ids=torch.tensor([slot]), start=torch.tensor([start]), slot_ids_host=(slot,),
                        start_host=(start,))
    return engine.model.verify(on_device(batch), engine.pool, kernels())


def _state(pool, slot):
    n = pool.lengths[slot]
    keys, values = pool.kv_of(slot, n)
    return pool.recurrent_state[slot].clone(), pool.conv_history[slot].clone(), keys, values, n


def test_commit_of_every_prefix_equals_sequential_decode(pairs):
    target_dir, _ = pairs["dflash"]
    engine, W = engine_for(target_dir, max_slots=2), 6
    prompt, tokens = prompts(96, [9, W], seed=21)
    for slot in (0, 1):
        give_pages(engine, slot, len(prompt) + W)
    for accepted in range(W + 1):
        for slot in (0, 1):
            engine.pool.reset(slot)
            engine.model.extend(ExtendBatch.build([(slot, 0, prompt)], DEVICE), engine.pool, kernels())
        before = _state(engine.pool, 0)
        out = _verify_chain(engine, 0, tokens, len(prompt))
        for a, b in zip(before, _state(engine.pool, 0)):  # verify alone changes nothing
            assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
        plan = CommitPlan(torch.tensor([0]), torch.arange(W)[None], torch.tensor([accepted]), (0,), (accepted,),
                          (len(prompt),), chain_host=True)
        commit(engine.pool, on_device(plan), out, kernels())
        for t in range(accepted):  # slot 1: the same tokens, one plain decode row at a time
            engine.model.extend(ExtendBatch.build([(1, len(prompt) + t, [tokens[t]])], DEVICE), engine.pool, kernels())
        got, want = _state(engine.pool, 0), _state(engine.pool, 1)
        assert got[4] == want[4] == len(prompt) + accepted
        # fp32; the verify rows were projected as one [W, H] matmul, the decode rows one by one
        for a, b in zip(got[:4], want[:4]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


BAD_COMMITS = {  # (slot ids, accepted lengths, starts, accepted node paths or None for chains)
    "duplicate": ((0, 0), (2, 2), (7, 7), None),
    "out_of_range": ((0, 7), (2, 2), (7, 7), None),
    "too_many": ((0, 1), (2, 4 + 1), (7, 7), None),
    "stale_start": ((0, 1), (2, 2), (7, 6), None),  # lane 1 verified from a position the slot is not at
    "past_max_len": ((0, 1), (2, 2), (7, 7), None),  # the pool's capacity shrunk below start + accepted
    "not_a_root_path": ((0, 1), (3, 2), (7, 7), ((0, 2, 3, 0), (0, 1, 2, 3))),
}


@pytest.mark.parametrize("bad", sorted(BAD_COMMITS))
def test_rejected_commit_changes_nothing(pairs, bad):
    target_dir, _ = pairs["dflash"]
    engine, W = engine_for(target_dir, max_slots=3), 4
    prompt, tokens = prompts(96, [7, W], seed=5)
    for slot in (0, 1):
        give_pages(engine, slot, len(prompt) + W)
        engine.pool.reset(slot)
        engine.model.extend(ExtendBatch.build([(slot, 0, prompt)], DEVICE), engine.pool, kernels())
    out = _verify_chain(engine, 0, tokens, len(prompt))
    two = lambda t: torch.cat([t, t])  # noqa: E731 -- a second lane with the same verify rows
    out = type(out)(logits=two(out.logits), taps=None, conv_windows=torch.cat([out.conv_windows] * 2, 1),
                    replay_log=torch.cat([out.replay_log] * 2, 1))
    slots, acc, starts, paths = BAD_COMMITS[bad]
    if bad == "past_max_len":
        engine.pool.max_len = len(prompt) + 1
    nodes = torch.arange(W).expand(2, W) if paths is None else torch.tensor(paths)
    parents = None if paths is None else ((-1, 0, 1, 2),) * 2
    plan = CommitPlan(torch.tensor(slots), nodes, torch.tensor(acc), slots, acc, starts, chain_host=paths is None,
                      accepted_nodes_host=paths, parents_host=parents)
    snapshot = [t.clone() for t in (engine.pool.recurrent_state, engine.pool.conv_history, engine.pool.key_cache)]
    lengths = list(engine.pool.lengths)
    with pytest.raises(CommitRejectedError):
        commit(engine.pool, on_device(plan), out, kernels())
    for a, b in zip(snapshot, (engine.pool.recurrent_state, engine.pool.conv_history, engine.pool.key_cache)):
        assert torch.equal(a, b)
    assert engine.pool.lengths == lengths


def test_tree_verify_nodes_equal_their_root_paths(pairs):
    """A tree's node sees exactly its ancestors: its logits equal those of its root path verified as a chain,
    and committing a path of the tree equals committing that chain."""
    target_dir, _ = pairs["dflash"]
    engine = engine_for(target_dir, max_slots=2)
    prompt = prompts(96, [10], seed=8)[0]
    tree_tokens = [5, 9, 13, 17, 21, 25]
    parents = [-1, 0, 0, 1, 2, 4]  # node 5's path: 0 -> 2 -> 4 -> 5
    depth = [0, 1, 1, 2, 2, 3]
    for slot in (0, 1):
        give_pages(engine, slot, len(prompt) + len(tree_tokens))
        engine.pool.reset(slot)
        engine.model.extend(ExtendBatch.build([(slot, 0, prompt)], DEVICE), engine.pool, kernels())
    start = len(prompt)
    batch = VerifyBatch(input_ids=torch.tensor([tree_tokens]), parents=torch.tensor([parents]),
                        positions=torch.tensor([[start + d for d in depth]]), slot_ids=torch.tensor([0]),
                        start=torch.tensor([start]), slot_ids_host=(0,), start_host=(start,))
    tree = engine.model.verify(on_device(batch), engine.pool, kernels())
    path = [0, 2, 4, 5]
    chain = _verify_chain(engine, 1, [tree_tokens[n] for n in path], start)
    torch.testing.assert_close(tree.logits[0, path], chain.logits[0], rtol=1e-5, atol=1e-5)
    nodes = torch.tensor([path + [0, 0]])
    commit(engine.pool, on_device(CommitPlan(torch.tensor([0]), nodes, torch.tensor([4]), (0,), (4,), (start,),
                                             accepted_nodes_host=(tuple(path),), parents_host=(tuple(parents),))),
           tree, kernels())
    commit(engine.pool, on_device(CommitPlan(torch.tensor([1]), torch.arange(4)[None], torch.tensor([4]), (1,), (4,),
                                             (start,), chain_host=True)), chain, kernels())
    for a, b in zip(_state(engine.pool, 0), _state(engine.pool, 1)):
        if isinstance(a, torch.Tensor):  # the tree and the chain were projected as different matmul shapes
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        else:
            assert a == b


def test_padded_context_rows_land_nowhere(pairs):
    """A round narrower than the block appends its rows padded to the block (so the block's CUDA graph
    replays): the padding rows change no page but the sink's."""
    target, draft = pairs["dflash"]
    engine = engine_for(target, draft)
    source, slot = engine.runner.source, 2
    for s in (0, slot):  # slot 0 too: where padding rows would land with slot 0 instead of -1
        give_pages(engine, s, 16)
    H = source.drafter.config.hidden_size * len(source.tap_layer_ids)
    taps = torch.randn(1, 3, H, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    slot_ids, positions = torch.full((1, 3), slot, device=DEVICE), torch.arange(5, 8, device=DEVICE)[None]
    source.context.key.normal_(), source.context.value.normal_()  # so that rows written anywhere show
    before = source.context.key.clone(), source.context.value.clone()
    source._append_rows(slot_ids, positions, taps)
    plain = source.context.key.clone(), source.context.value.clone()
    source.context.key.copy_(before[0]), source.context.value.copy_(before[1])
    source._append_rows(*pad_rows(slot_ids, positions, taps, source.block_size))
    real = torch.ones(source.context.key.shape[1], dtype=torch.bool)
    real[engine.pool.tables.sink_page] = False
    for got, want, old in zip((source.context.key, source.context.value), plain, before):
        got, want, old = got[:, real], want[:, real], old[:, real]
        assert (want != old).any()  # the rows were written
        assert torch.equal(got != old, want != old)  # ... there and nowhere else (the batch's rounding aside)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_cli_generate_with_draft_reports_acceptance():
    """The bundled demo pair through the CLI: the drafter's tokens are accepted (about 3 per round on
    held-out text) and the output equals target-only greedy decoding."""
    args = ["--prompt", "def parse_args(argv):\n    parser = argparse.ArgumentParser(", "--max-new-tokens", "40",
            "--device", "cpu", "--json", "--ignore-eos"]
    target = str(BUNDLED / "target")
    plain = subprocess.run([sys.executable, "-m", "deltaflash", "generate", "--model", target, *args],
                           capture_output=True, text=True)
    spec = subprocess.run([sys.executable, "-m", "deltaflash", "generate", *args, "--block-size", "6",
                           "--speculation", "fixed"],
                          capture_output=True, text=True)  # no --model: the bundled pair, drafter included
    assert plain.returncode == 0 and spec.returncode == 0, plain.stderr + spec.stderr
    plain, spec = json.loads(plain.stdout), json.loads(spec.stdout)
    assert spec["token_ids"] == plain["token_ids"] and len(spec["token_ids"]) == 40
    stats = spec["stats"]
    assert stats["block_size"] == 6 and "block_size" not in plain["stats"]
    assert stats["mean_accepted_length"] > 1.5  # drafts accepted, not only bonus tokens
    assert 0 <= 40 - 1 - sum(stats["accepted_lengths"]) <= 1
    assert stats["mean_accepted_length"] == pytest.approx(sum(stats["accepted_lengths"]) / len(stats["accepted_lengths"]), abs=1e-3)
    assert stats["tokens_per_second"] > 0
