"""CUDA graphs: captured at engine start, replay equal to eager execution, lossless end to end, no host
sync inside a round (GPU only)."""

import warnings

import pytest
import torch

from deltaflash.core.request import SamplingParams, Status
from deltaflash.engine.config import EngineConfig
from deltaflash.engine.engine import Engine
from deltaflash.engine.graphs import LaneGraphs
from deltaflash.models.loader import load_model
from deltaflash.speculative.sources import ScriptedSource
from tests.checkpoints import build_hf_model, save_checkpoint
from tests.spec_pairs import give_pages

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_checkpoint(build_hf_model("dense_gqa", seed=6), tmp_path_factory.mktemp("graphs"))


def decoding(engine, prompts, max_new_tokens=50):
    """Admit the prompts and step until every sequence is decoding."""
    for p in prompts:
        engine.add_request(p, SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True))
    while engine.scheduler.waiting or any(s.status is not Status.DECODING for s in engine.scheduler.running.values()):
        engine.step()
    return list(engine.scheduler.running.values())


def cuda_pair(tmp_path, seed: int, dtype=torch.float32):
    """A tiny target and DFlash drafter (tests.spec_pairs.make_pair) loaded on CUDA, fp32 unless `dtype` says."""
    from deltaflash.models.dflash import load_drafter
    from tests.spec_pairs import make_pair

    target_dir, draft_dir = make_pair(tmp_path, "dense_gqa", "dflash", seed=seed)
    model = load_model(target_dir, device="cuda", dtype=dtype, progress=False)
    drafter = load_drafter(draft_dir, target_hidden_size=model.cfg.hidden_size, target_vocab_size=model.cfg.vocab_size,
                           target_num_layers=model.cfg.num_layers, dtype=dtype, device="cuda")
    return model, drafter


def lanes_of(seqs):
    """(slot ids, pending tokens, positions) [L] of decoding sequences, on CUDA: a draft call's lanes."""
    return tuple(torch.tensor([getattr(s, name) for s in seqs], device="cuda") for name in ("slot", "pending", "position"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_graph_replay_equals_eager(folder, dtype):
    model = load_model(folder, device="cuda", dtype=dtype, progress=False)
    source = ScriptedSource({}, 5, 96)
    engine = Engine(model, config=EngineConfig(max_slots=6, max_model_len=128), draft_source=source)
    seqs = decoding(engine, [[5, 6, 7], list(range(1, 30)), list(range(40, 51))])[::-1]  # permuted lanes
    runner, W = engine.runner, 5
    for s in seqs:  # pages for the rows verified here, as the scheduler grants them for a round
        give_pages(engine, s.slot, s.position + W)
    ids = torch.randint(0, 96, (3, W), generator=torch.Generator().manual_seed(0)).cuda()
    slot_ids = torch.tensor([s.slot for s in seqs], device="cuda")
    start = torch.tensor([s.position for s in seqs], device="cuda")
    before = [t.clone() for t in (runner.pool.recurrent_state, runner.pool.conv_history)]
    with torch.inference_mode():
        graphed = runner.verify(ids, slot_ids, start, kmax=max(s.position for s in seqs) + W)  # bucket 4: 1 padding lane
        graphed = [t.clone() for t in (graphed.logits, graphed.conv_windows, graphed.replay_log)]
        eager = runner._verify_rows(torch.cat([ids, ids[:1]]), torch.cat([slot_ids, slot_ids.new_full((1,), -1)]),
                                    torch.cat([start, start[:1] * 0]))  # the same 4 lanes, eagerly
    assert torch.equal(graphed[0], eager[0][:3])
    assert torch.equal(graphed[1], eager[2].movedim(0, 1)[:, :3])
    assert torch.equal(graphed[2], eager[3].movedim(0, 1)[:, :3])
    assert torch.equal(before[0], runner.pool.recurrent_state) and torch.equal(before[1], runner.pool.conv_history)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_graph_commits_as_eager_verify_and_commit(tmp_path, dtype):
    """A width-1 round's graph also commits its rows and appends them as draft context: the logits, the
    state, the conv history, the draft context and the lengths equal an eager verify of the same
    (padded) lanes followed by the commit transaction and the append of the same lanes, to the bit."""
    from deltaflash.cache.commit import commit
    from deltaflash.core.batch import CommitPlan, VerifyOutput

    model, drafter = cuda_pair(tmp_path, seed=4, dtype=dtype)
    engine = Engine(model, None, drafter, EngineConfig(max_slots=6, max_model_len=128))
    runner, pool = engine.runner, engine.runner.pool
    assert runner.decode_graphs is not None
    seqs = decoding(engine, [[5, 6, 7], list(range(1, 30)), list(range(40, 51))])[::-1]  # permuted lanes
    for s in seqs:
        give_pages(engine, s.slot, s.position + 1)
    slots, starts = [s.slot for s in seqs], [s.position for s in seqs]
    anchors = torch.tensor([[s.pending] for s in seqs], device="cuda")
    slot_ids, start = torch.tensor(slots, device="cuda"), torch.tensor(starts, device="cuda")
    context = runner.source.context
    pools = lambda: [pool.recurrent_state, pool.conv_history, pool.key_cache, pool.value_cache, context.key, context.value]
    before = [t.clone() for t in pools()]
    with torch.inference_mode():
        graphed = runner.decode(anchors, slot_ids, start, slots, starts)  # bucket 4: one padding lane
        graphed_logits, after = graphed.logits.clone(), [t.clone() for t in pools()]
        lengths = [pool.lengths[s] for s in slots]
        for t, b in zip(pools(), before):  # back to the state before the round
            t.copy_(b)
        for s, p in zip(slots, starts):
            pool.lengths[s] = p
        pad = lambda x, v: torch.cat([x, x.new_full((1, *x.shape[1:]), v)])
        logits, taps, windows, log = runner._verify_rows(pad(anchors, 0), pad(slot_ids, -1), pad(start, 0))
        out = VerifyOutput(logits[:3], taps[:3], windows.movedim(0, 1)[:, :3], log.movedim(0, 1)[:, :3])
        plan = CommitPlan.chain(slot_ids, torch.ones_like(slot_ids), 1, slot_ids_host=slots,
                                accepted_len_host=(1,) * 3, start_host=starts)
        commit(pool, plan, out, runner.kernels)
        # the graph appends its bucket's 4 lanes eagerly (the drafter's projection GEMM sees 4 rows)
        runner.source.append(pad(slot_ids, -1)[:, None], pad(start, 0)[:, None], taps, graphs=False)
    assert torch.equal(graphed_logits, out.logits)
    names = ("recurrent state", "conv history", "keys", "values", "draft context keys", "draft context values")
    assert [n for n, a, b in zip(names, after, pools()) if not torch.equal(a, b)] == []
    assert not torch.equal(after[0], before[0]) and lengths == [p + 1 for p in starts]


def test_every_graph_is_captured_at_start_and_none_inside_requests(folder, monkeypatch):
    model = load_model(folder, device="cuda", dtype=torch.float32, progress=False)
    engine = Engine(model, config=EngineConfig(max_slots=5, max_model_len=128),
                    draft_source=ScriptedSource({}, 4, 96))
    graphs = engine.runner.graphs
    assert graphs.buckets == (1, 2, 4, 8) and engine.config.widths == (1, 4)  # speculation "auto": fixed on CUDA
    assert {g.name for g in graphs.functions} == {"decode W=1 (verify + commit)", "verify W=4", "prefill of 64 rows",
                                                  "prefill of 128 rows"}
    assert all(set(g.graphs) == set(g.buckets) for g in graphs.functions)
    assert engine.runner.prefill_graphs[128].buckets == (1, 2, 3, 4, 6, 8)  # five slots' chunks of 128 rows fit
    assert engine.startup_s > 0

    def no_capture(self, bucket):
        raise AssertionError(f"{self.name} captured inside a request (bucket {bucket})")

    monkeypatch.setattr(LaneGraphs, "capture", no_capture)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (4, 19, 33, 8, 60)]
    engine.generate(prompts, SamplingParams(max_new_tokens=12, ignore_eos=True))


def test_no_kernel_is_compiled_or_loaded_inside_requests(tmp_path):
    """After start-up (capture and warm requests) a real drafter's engine serves prompts of every kind of
    length - one token, multiples of 16, neither; alone and prefilled together; greedy and sampled -
    without loading a single Triton kernel (each load is a compile or a disk read inside a request)."""
    from deltaflash.ops.compiles import kernel_loads

    model, drafter = cuda_pair(tmp_path, seed=2)
    engine = Engine(model, None, drafter, EngineConfig(max_slots=4, max_model_len=256))
    g = torch.Generator().manual_seed(5)
    sampled = SamplingParams(max_new_tokens=20, temperature=0.8, top_p=0.95, seed=1, ignore_eos=True)
    with kernel_loads() as loads:
        for lengths in ((2,), (16,), (17,), (32, 5), (48, 64, 1, 23)):
            prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in lengths]
            engine.generate(prompts, SamplingParams(max_new_tokens=20, ignore_eos=True))
            engine.generate(prompts, sampled)
    assert loads == [], f"kernels loaded inside requests: {sorted({name for name, _ in loads})}"


def test_fused_route_with_graphs_is_lossless(folder):
    model = load_model(folder, device="cuda", dtype=torch.float32, progress=False)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (4, 19, 33, 8, 60)]
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    plain = Engine(model, config=EngineConfig(max_slots=8, max_model_len=256))
    expected = [c.token_ids for c in plain.generate(prompts, params)[0]]
    scripts = {tuple(p): e for p, e in zip(prompts[:3], expected[:3])}
    engine = Engine(model, config=EngineConfig(max_slots=8, max_model_len=256),
                    draft_source=ScriptedSource(scripts, 8, 96, corrupt=0.1, seed=1))
    assert engine.runner.graphs is not None and engine.runner.kernels.name == "triton"
    done = engine.generate(prompts, params)[0]
    assert [c.token_ids for c in done] == expected
    assert max(n for c in done[:3] for n in c.accepted_lengths) == 8


def test_more_lanes_than_the_largest_bucket(folder, monkeypatch):
    """70 lanes: rounds past the largest bucket (64) run eagerly, with the same output."""
    model = load_model(folder, device="cuda", dtype=torch.float32, progress=False)
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, 96, (int(n),), generator=g).tolist() for n in torch.randint(2, 30, (70,), generator=g)]
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    config = EngineConfig(max_slots=70, max_model_len=64, max_num_batched_tokens=4096)
    expected = [c.token_ids for c in Engine(model, config=config).generate(prompts, params)[0]]
    scripts = {tuple(p): e for p, e in zip(prompts, expected)}
    engine = Engine(model, config=config, draft_source=ScriptedSource(scripts, 4, 96, corrupt=0.2, seed=2))
    assert engine.runner.graphs.buckets[-1] == 64
    eager_rounds = []
    real = engine.runner._verify_rows

    def count(*args, **kwargs):
        eager_rounds.append(args[0].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "_verify_rows", count)
    assert [c.token_ids for c in engine.generate(prompts, params)[0]] == expected
    assert eager_rounds and min(eager_rounds) > 64  # only rounds of more than 64 lanes ran eagerly


@pytest.mark.parametrize("kind", ["dense_gqa", "moe"])
def test_a_round_syncs_with_the_host_once(tmp_path, kind):
    """torch's sync debug mode reports every synchronizing call: a decode round (drafting, verify,
    acceptance with greedy and sampled lanes, commit) makes exactly one, the read of its results."""
    model = load_model(save_checkpoint(build_hf_model(kind, seed=9), tmp_path / kind), device="cuda",
                       dtype=torch.float32, progress=False)
    engine = Engine(model, config=EngineConfig(max_slots=4, max_model_len=128), draft_source=ScriptedSource({}, 4, 96))
    decoding(engine, [[1, 2, 3], [4, 5, 6, 7]])
    for params in (SamplingParams(max_new_tokens=20, temperature=0.8, top_p=0.9, seed=1),
                   SamplingParams(max_new_tokens=20)):
        engine.add_request([9, 8, 7], params)
    while engine.scheduler.waiting or any(s.status is not Status.DECODING for s in engine.scheduler.running.values()):
        engine.step()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            engine.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in caught if "called a synchronizing CUDA operation" in str(w.message)]
    assert len(syncs) == 1, syncs


def test_drafter_graphs_are_lossless_and_match_eager_drafting(tmp_path):
    """A DFlash drafter on CUDA drafts from graphs (block forward, context append); output stays lossless,
    and a graph-replayed block equals the eager block over the same context up to fp32 rounding."""

    model, drafter = cuda_pair(tmp_path, seed=1)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (5, 23, 40)]
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    config = EngineConfig(max_slots=4, max_model_len=256)
    expected = [c.token_ids for c in Engine(model, config=config).generate(prompts, params)[0]]
    spec = Engine(model, None, drafter, config)
    source = spec.runner.source
    assert source.block_graphs is not None and source.append_graphs is not None
    assert [c.token_ids for c in spec.generate(prompts, params)[0]] == expected

    seqs = decoding(spec, prompts, 8)  # fresh sequences past prefill, then one block both ways
    slot_ids, anchors, start = lanes_of(seqs)
    with torch.inference_mode():  # as the engine drafts (the graphs' static buffers are inference tensors)
        graphed = [t.clone() for t in source.block_graphs.run(slot_ids, anchors, start)]
        eager = source._block_logits(slot_ids, anchors, start, max(s.position for s in seqs))
    for a, b in zip(graphed, eager):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_drafter_tree_graphs_are_lossless_and_build_the_eager_trees(tmp_path):
    """With trees, the drafter's block forward and the tree built from it replay as one graph per lane
    bucket: output stays target-only greedy, and a replayed tree is the one eager drafting builds."""

    model, drafter = cuda_pair(tmp_path, seed=1)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (5, 23, 40)]
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    expected = [c.token_ids for c in Engine(model, config=EngineConfig(max_slots=4, max_model_len=256)).generate(
        prompts, params)[0]]
    spec = Engine(model, None, drafter, EngineConfig(max_slots=4, max_model_len=256, tree_budget=8, tree_top_k=3,
                                                     tree_max_lanes=0))
    source = spec.runner.source
    assert source.tree_graphs is not None and "drafter tree of 8" in {f.name for f in spec.runner.graphs.functions}
    assert [c.token_ids for c in spec.generate(prompts, params)[0]] == expected

    seqs = decoding(spec, prompts, 8)
    slot_ids, anchors, start = lanes_of(seqs)
    with torch.inference_mode():
        graphed = source._as_tree(tuple(t.clone() for t in source.tree_graphs.run(slot_ids, anchors, start)))
        hidden, logits = source._block_logits(slot_ids, anchors, start, max(s.position for s in seqs))
        eager = source._build(hidden, logits, slot_ids, anchors, 8, 3)
    for name in ("tokens", "parents", "depth", "rank", "order"):
        assert torch.equal(getattr(graphed, name), getattr(eager, name)), name


def test_the_devices_wait_for_the_host_is_measured_between_busy_steps(folder):
    """IdleClock: each step that follows a busy one reports how long the device waited for the host
    (a host pause between two steps shows in full); the first step after the engine ran dry reports none."""
    import time

    model = load_model(folder, device="cuda", dtype=torch.float32, progress=False)
    engine = Engine(model, config=EngineConfig(max_slots=2, max_model_len=128))
    reports = []
    engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=8, ignore_eos=True))
    while engine.has_work():
        engine.step(reports.append)
    assert reports[0].device_idle_s is None and len(reports) > 2
    assert all(r.device_idle_s is not None and r.device_idle_s >= 0 for r in reports[1:])
    engine.add_request([4, 5, 6], SamplingParams(max_new_tokens=8, ignore_eos=True))
    engine.step(reports.append)
    assert reports[-1].device_idle_s is None  # the engine had nothing to do before it
    engine.step(reports.append)
    time.sleep(0.05)
    engine.step(reports.append)
    assert reports[-1].device_idle_s >= 0.04


def test_pinned_staging_keeps_queued_copies_intact_as_it_wraps():
    """Host lists staged through the pinned ring (core/batch.py) reach the device intact while the device
    is still busy with earlier work and the ring goes round both halves several times: a half is written
    again only after the copies queued from it have run."""
    from deltaflash.core.batch import PinnedStaging, to_device

    rows = 40 * 97 * 8  # bytes per call
    calls = 6 * 2 * PinnedStaging.HALF_BYTES // rows
    torch.cuda._sleep(50_000_000)  # the copies below queue behind this
    want = [[[i * 1000 + j for j in range(97)] for _ in range(40)] for i in range(calls)]
    got = [to_device(values, "cuda") for values in want]
    floats = to_device([0.5, -2.25], "cuda", torch.float32)
    flags = to_device([True, False, True], "cuda", torch.bool)
    assert [g.tolist() for g in got] == want
    assert floats.tolist() == [0.5, -2.25] and flags.tolist() == [True, False, True]


def test_greedy_round_graphs_are_lossless_and_replace_the_round_s_launches(tmp_path, monkeypatch):
    """round_graphs on CUDA: every greedy chain round replays one captured graph (drafter block, verify,
    acceptance, commit, draft context) with no launch after the step's read; the tokens are target-only's
    and the accepted lengths those of the ordinary rounds (three graphs and the eager launches)."""
    model, drafter = cuda_pair(tmp_path, seed=3)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (5, 23, 40)]
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    config = EngineConfig(max_slots=4, max_model_len=256, speculation="fixed")
    expected = [c.token_ids for c in Engine(model, config=config).generate(prompts, params)[0]]
    ordinary = Engine(model, None, drafter, config).generate(prompts, params)[0]
    engine = Engine(model, None, drafter, EngineConfig(max_slots=4, max_model_len=256, speculation="fixed",
                                                       round_graphs=True))
    runner = engine.runner
    assert set(runner.round_graphs) == set(runner.widths[1:]) and runner.round_graphs
    replays = []
    for graphs in runner.round_graphs.values():
        real = graphs.run_host
        monkeypatch.setattr(graphs, "run_host", lambda *a, _real=real: (replays.append(1), _real(*a))[1])
    monkeypatch.setattr(runner, "_commit", lambda *a, **k: pytest.fail("a round committed after its read"))
    got = engine.generate(prompts, params)[0]
    assert [c.token_ids for c in got] == expected and replays
    assert [c.accepted_lengths for c in got] == [c.accepted_lengths for c in ordinary]


def test_greedy_tree_round_graphs_are_lossless_and_replace_the_round_s_launches(tmp_path, monkeypatch):
    """round_graphs with trees on CUDA: every greedy tree round replays one captured graph (the drafter's
    block and trees, verify, acceptance, the commit with its K/V moves, draft context) with no commit after
    the step's read; the tokens are target-only's and the accepted lengths those of the ordinary tree rounds."""
    model, drafter = cuda_pair(tmp_path, seed=3)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (5, 23, 40)]
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    config = dict(max_slots=4, max_model_len=256, speculation="fixed", tree_budget=8, tree_top_k=3, tree_max_lanes=0)
    expected = [c.token_ids for c in Engine(model, config=EngineConfig(max_slots=4, max_model_len=256)).generate(
        prompts, params)[0]]
    ordinary = Engine(model, None, drafter, EngineConfig(**config)).generate(prompts, params)[0]
    engine = Engine(model, None, drafter, EngineConfig(**config, round_graphs=True))
    runner = engine.runner
    assert set(runner.round_graphs) == {("tree", 8)}
    replays, graphs = [], runner.round_graphs[("tree", 8)]
    real = graphs.run_host
    monkeypatch.setattr(graphs, "run_host", lambda *a: (replays.append(1), real(*a))[1])
    monkeypatch.setattr(runner, "_commit", lambda *a, **k: pytest.fail("a round committed after its read"))
    got = engine.generate(prompts, params)[0]
    assert [c.token_ids for c in got] == expected and replays
    assert [c.accepted_lengths for c in got] == [c.accepted_lengths for c in ordinary]
