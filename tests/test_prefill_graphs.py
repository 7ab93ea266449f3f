"""Prefill graphs (engine/runner.py, EngineConfig.prefill_graphs): a prefill step replayed from the graph of
a fixed chunk shape - every lane padded to T rows, padding lanes on the pool's state sink - gives what the eager,
packed prefill gives. On the CPU the captured function runs eagerly behind the same dispatch (no CUDA
graphs there); DELTAFLASH_TEST_DEVICE=cuda runs the same tests on the real graphs."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from triton.runtime.interpreter import InterpretedFunction

from deltaflash.cache.slots import SlotPool
from deltaflash.core.batch import ExtendBatch
from deltaflash.core.request import SamplingParams
from deltaflash.engine.graphs import (FRESH_PREFILL_MIN_ROWS, PREFILL_FINE_MIN_ROWS, PREFILL_MAX_ROWS, padded_rows_allowed,
                                      prefill_graph_buckets, prefill_graph_for, prefill_lane_buckets, prefill_shapes)
from deltaflash.ops.attention.paged import paged_attention_kernel
from deltaflash.ops.gdn.chunk import chunk_gated_delta_rule_padded, chunk_gated_delta_rule_varlen, l2_normalize
from deltaflash.server.metrics import Metrics
from tests.spec_pairs import DEVICE, engine_for, make_pair, pairs_by_kind, prompts


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    return pairs_by_kind(tmp_path_factory.mktemp("prefill-graphs"))


@pytest.fixture(scope="module")
def pair(pairs):
    return pairs["dense_gqa"]


class Replays:
    """Wraps each prefill graph's `run` (or, on the CPU, stands in for the graphs by calling the captured
    function eagerly, and tells the scheduler they are there) and records the slot ids of every replay."""

    def __init__(self, engine):
        runner = engine.runner
        self.calls: list[list[int]] = []
        self.shapes: list[int] = []  # the rows T of each replayed graph
        self.fresh: list[bool] = []  # whether each was a first chunk's graph (runner.fresh_prefill_graphs)
        if DEVICE == "cpu":
            config = runner.config
            shapes = prefill_shapes(config.round_prefill_tokens, config.max_slots, config.max_model_len,
                                    config.idle_prefill_tokens)
            runner.prefill_graphs = {T: _Eager(runner._prefill_rows, T, lanes) for T, lanes in shapes}
            engine.scheduler.config = dataclasses.replace(engine.scheduler.config, prefill_graphs=True)
            if runner.kernels.prefill_attention is not None:  # what the runner registers on CUDA
                first = functools.partial(runner._prefill_rows, starts_sequences=True)
                runner.fresh_prefill_graphs = {T: _Eager(first, T, lanes) for T, lanes in shapes
                                               if T >= FRESH_PREFILL_MIN_ROWS}
        assert runner.prefill_graphs, "the engine has no prefill graphs"
        for fresh, table in ((False, runner.prefill_graphs), (True, runner.fresh_prefill_graphs)):
            for T, graphs in table.items():
                graphs.run_host = self._recording(graphs.run_host, T, fresh)

    def _recording(self, run, T, fresh):
        def wrapped(*inputs):
            self.calls.append(inputs[1].tolist())
            self.shapes.append(T)
            self.fresh.append(fresh)
            return run(*inputs)
        return wrapped


class _Eager:
    def __init__(self, fn, T: int, lanes: int):
        self.fn, self.buckets = fn, prefill_lane_buckets(T, lanes)  # the runner's buckets on CUDA

    def run_host(self, *inputs):
        return (self.fn(*(torch.from_numpy(x).to(DEVICE) for x in inputs)),)


def second_arrives_while_first_decodes(engine, batch, params, one_step=False) -> list[list[int]]:
    """Both prompts' tokens: the first added to an idle engine and stepped once (`one_step`: it must
    emit in that step, prefilled whole), the second added then, both run to the end."""
    first = engine.add_request(batch[0], params)
    events = engine.step()
    if one_step:
        assert [ev.request_id for ev in events if ev.token_ids] == [first]  # prefilled in one step
    second = engine.add_request(batch[1], params)
    got = {first: [t for ev in events for t in ev.token_ids], second: []}
    while engine.has_work():
        for ev in engine.step():
            got[ev.request_id] += ev.token_ids
    return [got[first], got[second]]


def test_padded_chunked_rule_equals_the_packed_one():
    """Padding rows (raw gate inputs -inf: g = beta = 0) after a lane's valid rows change none of its
    outputs or its final state; a lane of padding only keeps its initial state."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(3)
    L, T, H, dk, dv = 3, 130, 2, 16, 16
    n = [7, 130, 0]
    rand = lambda *shape: torch.randn(*shape, generator=g).to(device)  # noqa: E731
    q, k = (l2_normalize(rand(L, T, H, dk)) for _ in range(2))
    v = rand(L, T, H, dv)
    a, b, A_log, dt_bias = rand(L, T, H), rand(L, T, H), rand(H) * 0.1, rand(H)
    state = rand(L, H, dk, dv) * 0.1
    rows_valid = torch.arange(T, device=device)[None] < torch.tensor(n, device=device)[:, None]
    o, final = chunk_gated_delta_rule_padded(q, k, v, a, b, A_log, dt_bias, state, rows_valid)
    live = [i for i in range(L) if n[i]]
    pack = lambda t: torch.cat([t[i, :n[i]] for i in live])  # noqa: E731
    o_ref, final_ref = chunk_gated_delta_rule_varlen(pack(q), pack(k), pack(v), pack(a), pack(b), A_log, dt_bias,
                                                     state[live], [n[i] for i in live])
    torch.testing.assert_close(pack(o), o_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(final[live], final_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(final[2], state[2], rtol=0, atol=1e-6)
    # no initial states (first chunks): the zero state's outputs
    zeros = torch.zeros_like(state)
    o0, final0 = chunk_gated_delta_rule_padded(q, k, v, a, b, A_log, dt_bias, None, rows_valid)
    o_ref, final_ref = chunk_gated_delta_rule_padded(q, k, v, a, b, A_log, dt_bias, zeros, rows_valid)
    torch.testing.assert_close(pack(o0), pack(o_ref), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final0, final_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["dense_gqa", "moe"])
def test_prefill_graphs_give_the_eager_prefill(pairs, kind):
    """Ragged prompts arriving while others decode: steps that fit a graph shape replay it (padding lanes
    among them, on a slot of a decoding sequence), the rest run eagerly; every token and its log
    probability, greedy and sampled, and the draft context equal the eager engine's. Dense and MoE."""
    target, draft = pairs[kind]
    config = dict(max_slots=10, max_num_batched_tokens=256, idle_prefill_tokens=256)
    plain = engine_for(target, draft, prefill_graphs=False, **config)
    graphed = engine_for(target, draft, **config)  # real graphs on CUDA; on the CPU Replays stands in
    replays = Replays(graphed)
    # the same plans (the scheduler cuts chunks to the graphs it knows of): replays against eager launches
    plain.scheduler.config = dataclasses.replace(plain.scheduler.config, prefill_graphs=True)
    # steps planned by the graph shapes alone (on CUDA the engine times an eager step at start, and where
    # that costs much it cuts every step to a graph: tests/test_engine.py's straddling-lengths test)
    plain.scheduler.eager_prefill_rows = graphed.scheduler.eager_prefill_rows = 0
    # together: [1, 40, 9] pads too much for a graph; [30, 40, 45] replays 4 lanes, one of them padding
    groups = [[5, 70], [3], [230], [1, 40, 9], [30, 40, 45]]
    arrivals = prompts(96, [n for group in groups for n in group], seed=2)
    greedy = SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=1)
    sampled = SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=0.9, seed=4, logprobs=1)

    metrics = Metrics(4)

    def serve(engine, on_report=None):
        tokens: dict[str, list[int]] = {}
        logprobs: dict[str, list[float]] = {}

        def step():
            for ev in engine.step(on_report):
                tokens.setdefault(ev.request_id, []).extend(ev.token_ids)
                logprobs.setdefault(ev.request_id, []).extend(lp.logprob for lp in ev.logprobs or ())
        ids, queue = [], iter(arrivals)
        for group in groups:  # a group arrives every other step
            for _ in group:
                ids.append(engine.add_request(next(queue), greedy if len(ids) % 2 else sampled))
            step()
            step()
        while engine.has_work():
            step()
        return [tokens[i] for i in ids], [logprobs[i] for i in ids]

    (want, want_lp), (got, got_lp) = serve(plain), serve(graphed, metrics.observe_step)
    assert got == want
    for a, b in zip(got_lp, want_lp):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-4, atol=1e-4)
    pages = slice(0, -1)  # the sink page takes whatever padding rows write
    for a, b in ((graphed.runner.source.context.key, plain.runner.source.context.key),
                 (graphed.runner.source.context.value, plain.runner.source.context.value)):
        torch.testing.assert_close(a[:, pages], b[:, pages], rtol=1e-4, atol=1e-4)
    assert replays.calls, "no prefill step replayed a graph"
    assert any(-1 in slots for slots in replays.calls), "no replay had a padding lane"
    pool = graphed.runner.pool  # padding lanes kept their GDN state in the sink, which stays zero
    assert not pool.state_rows[pool.state_sink].any()
    torch.testing.assert_close(pool.recurrent_state, plain.runner.pool.recurrent_state, rtol=1e-4, atol=1e-4)
    assert graphed.stats["prefill_tokens"] == plain.stats["prefill_tokens"]
    samples = [s for f in text_string_to_metric_families(metrics.render().decode()) for s in f.samples]
    steps = {s.labels["path"]: s.value for s in samples if s.name == "deltaflash_prefill_steps_total"}
    assert steps["graph"] == len(replays.calls) and steps["eager"] > 0  # /metrics tells the two apart
    rows = {s.labels["path"]: s.value for s in samples if s.name == "deltaflash_prefill_rows_total"}
    prefilled = next(s.value for s in samples if s.name == "deltaflash_prefill_tokens_per_step_sum")
    assert prefilled == graphed.stats["prefill_tokens"] < rows["graph"] + rows["eager"]  # the padding rows


def test_short_chunks_replay_a_padded_graph_where_an_eager_step_costs_more(pair):
    """Four prompts of 2-7 tokens in one step: 4 x 64 graph rows for 17 tokens pad past twice their rows, so the
    step runs eagerly - unless an eager step's launching costs more graph rows than that (the scheduler's
    eager_prefill_rows, measured at start on CUDA: a host-bound eager step, a small model's), where the padded graph
    replays.
    Outputs equal."""
    batch = prompts(96, [5, 3, 7, 2], seed=12)
    greedy = SamplingParams(max_new_tokens=4, ignore_eos=True)
    outputs, replayed = [], []
    for eager_rows in (0.0, 1000.0):
        engine = engine_for(pair[0], max_slots=4, max_num_batched_tokens=256, idle_prefill_tokens=256)
        engine.scheduler.eager_prefill_rows = eager_rows
        replays = Replays(engine)
        outputs.append([c.token_ids for c in engine.generate(batch, greedy)[0]])
        replayed.append(replays.calls)
    assert outputs[0] == outputs[1]
    assert replayed[0] == [] and [sorted(slots) for slots in replayed[1]] == [[0, 1, 2, 3]]


def test_a_prompt_at_an_idle_engine_replays_a_shape_above_the_budget(pair):
    """Nothing decoding: a 200-token prompt goes in one step of the idle budget, replayed from the
    single-lane 256-row graph; a second prompt arriving while it decodes goes in budget-sized chunks.
    Outputs equal the eager engine's."""
    config = dict(max_slots=4, max_num_batched_tokens=64, idle_prefill_tokens=256,
                  scale_prefill_budget=False)  # budget-sized chunks beside a round
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    batch = prompts(96, [200, 150], seed=8)
    plain = engine_for(pair[0], pair[1], prefill_graphs=False, **config)
    engine = engine_for(pair[0], pair[1], **config)
    replays = Replays(engine)
    assert engine.runner.prefill_graphs[256].buckets == (1,)
    assert second_arrives_while_first_decodes(engine, batch, params, one_step=True) == \
        second_arrives_while_first_decodes(plain, batch, params, one_step=True)
    assert replays.shapes[0] == 256 and replays.shapes[1:] and set(replays.shapes[1:]) <= {64}


@pytest.mark.skipif(DEVICE != "cpu", reason="fp32 engines on CUDA run first chunks on pages (flash attention "
                    "takes half precision) and the GPU tests' engines are batch invariant")
def test_a_first_chunk_replays_the_graph_that_attends_over_its_own_rows(tmp_path):
    """A prompt of FRESH_PREFILL_MIN_ROWS rows or so at an idle engine replays the first-chunk graph of
    its shape, which tells the attention its shape is fixed (cuDNN's kernel on CUDA: ops/attention/dense.py);
    a prompt arriving while it decodes goes in budget-sized chunks through the plain graphs (its first
    chunk is below that shape). Outputs equal the eager engine's, whose first chunks say their shapes vary.
    (A target with an attention layer before its last, which attends for each lane's last row alone.)"""
    pair = make_pair(tmp_path, kind="dense_tied", block_size=4)
    T = FRESH_PREFILL_MIN_ROWS
    config = dict(max_slots=2, max_num_batched_tokens=64, idle_prefill_tokens=T, max_model_len=T + 64,
                  scale_prefill_budget=False)  # budget-sized chunks beside a round
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    batch = prompts(80, [T - 40, 150], seed=9)  # (dense_tied: 80 tokens)
    plain = engine_for(pair[0], pair[1], prefill_graphs=False, **config)
    engine = engine_for(pair[0], pair[1], **config)
    fixed = {id(plain): [], id(engine): []}  # each engine's prefill_attention calls: fixed_shape, rows
    for e in (plain, engine):
        attend = e.runner.kernels.prefill_attention

        def spy(q, k, v, scale, fixed_shape=False, attend=attend, calls=fixed[id(e)]):
            calls.append((fixed_shape, q.shape[1]))
            return attend(q, k, v, scale, fixed_shape=fixed_shape)
        e.runner.kernels = dataclasses.replace(e.runner.kernels, prefill_attention=spy)
    replays = Replays(engine)
    assert set(engine.runner.fresh_prefill_graphs) == {T}
    assert second_arrives_while_first_decodes(engine, batch, params) == \
        second_arrives_while_first_decodes(plain, batch, params)
    assert (replays.shapes[0], replays.fresh[0]) == (T, True)
    assert replays.shapes[1:] and not any(replays.fresh[1:])
    cfg = engine.runner.model.cfg
    layers = len([i for i in cfg.attn_layer_ids if i != cfg.num_layers - 1])
    assert layers and fixed[id(engine)] == [(True, T)] * layers  # the graph's forward, every attention layer
    assert fixed[id(plain)][:layers] == [(False, T - 40)] * layers  # the eager first chunk, its own length
    assert not any(f for f, _ in fixed[id(plain)])  # and every later eager one


@pytest.mark.skipif(DEVICE != "cpu", reason="fp32 engines on CUDA run prefill attention on pages (flash attention "
                    "takes half precision) and the GPU tests' engines are batch invariant")
def test_a_long_prompts_later_chunk_at_an_idle_engine_runs_eagerly(pair):
    """A prompt longer than the idle budget at an idle engine: its first chunk replays the first-chunk
    graph; its next chunk, after EAGER_DENSE_MIN_CONTEXT committed keys, runs eagerly when it has
    EAGER_DENSE_MIN_ROWS rows or more (its attention gathers the context into one dense run, which no graph
    can), and replays a graph when shorter (the eager launching would cost more) - or when the eager step's
    launching costs more than its rows (the scheduler's eager_prefill_rows, measured at start on CUDA: a slow
    host), below EAGER_DENSE_ALWAYS_CONTEXT keys. Outputs equal the eager engine's."""
    from deltaflash.engine.graphs import EAGER_DENSE_MIN_CONTEXT, EAGER_DENSE_MIN_ROWS

    T, rest = EAGER_DENSE_MIN_CONTEXT, EAGER_DENSE_MIN_ROWS + 36
    config = dict(max_slots=2, max_num_batched_tokens=64, idle_prefill_tokens=T, max_model_len=T + rest + 60,
                  scale_prefill_budget=False, prefix_cache=0)  # budget-sized chunks beside a round
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    plain = engine_for(pair[0], pair[1], prefill_graphs=False, **config)
    engine = engine_for(pair[0], pair[1], **config)
    for n, shapes, fresh, host_bound in ((rest, [T], [True], False), (100, [T, 128], [True, False], False),
                                          (rest, [T, T], [True, False], True)):
        (prompt,) = prompts(96, [T + n], seed=10)
        engine.scheduler.eager_prefill_rows = 4 * T if host_bound else 0.0
        replays = Replays(engine)
        outputs = []
        for e in (plain, engine):
            (done,), _ = e.generate([prompt], params)
            outputs.append(done.token_ids)
        assert outputs[1] == outputs[0]
        assert (replays.shapes, replays.fresh) == (shapes, fresh), n  # a long rest eager, a short one replayed


def test_three_long_chunks_replay_three_lanes_not_four(pair):
    """Three prompts of 200 rows arriving together at an idle engine go in one step through the 256-row
    graph's 3-lane bucket (PREFILL_FINE_MIN_ROWS: no padding lane, whose rows would cost full work at this
    size); a fourth later goes alone. Outputs equal the eager engine's. Three shorter ones (400 rows) run
    eagerly: the finer buckets pad less but never turn an eager step into a replay."""
    assert prefill_lane_buckets(256, 4) == (1, 2, 3, 4) and prefill_lane_buckets(64, 4) == (1, 2, 4)
    assert prefill_lane_buckets(PREFILL_FINE_MIN_ROWS, 64) == (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
    assert prefill_lane_buckets(512, 5) == (1, 2, 3, 4, 6, 8)  # up to the first power of two >= the lanes
    config = dict(max_slots=4, max_num_batched_tokens=768, idle_prefill_tokens=768, scale_prefill_budget=False)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    batch = prompts(96, [200, 200, 190, 170], seed=11)
    outputs, engines = [], (engine_for(pair[0], pair[1], prefill_graphs=False, **config),
                            engine_for(pair[0], pair[1], **config))
    replays = Replays(engines[1])
    reports = []
    for engine in engines:
        ids = [engine.add_request(p, params) for p in batch[:3]]
        first = engine.step(on_report=reports.append)
        ids.append(engine.add_request(batch[3], params))
        got = {i: [t for ev in first if ev.request_id == i for t in ev.token_ids] for i in ids}
        assert all(got[i] for i in ids[:3])  # the three prefilled in that one step
        while engine.has_work():
            for ev in engine.step():
                got[ev.request_id] += ev.token_ids
        outputs.append([got[i] for i in ids])
    assert outputs[1] == outputs[0]
    assert replays.shapes[0] == 256 and len(replays.calls[0]) == 3 and -1 not in replays.calls[0]
    assert [(r.prefill_tokens, r.prefill_rows, r.prefill_graphed) for r in reports] == [(590, 590, False),
                                                                                         (590, 768, True)]
    # 400 rows in three chunks: 3 x 256 would be allowed (padded_rows_allowed), 4 x 256 is not, and the
    # power-of-two bucket decides graph or eager - the runner runs such a step eagerly, as before the finer
    # buckets; a scheduler told that an eager step costs more (eager_prefill_rows, measured on CUDA at start)
    # cuts the three to 128 rows each and the step replays 3 x 128
    assert 3 * 256 <= padded_rows_allowed(400) < 4 * 256
    for cuts in (False, True):
        engine = engine_for(pair[0], pair[1], **config)
        replays = Replays(engine)
        engine.scheduler.eager_prefill_rows = 1000.0 if cuts else 0.0  # (CUDA: measured)
        for p in prompts(96, [140, 130, 130], seed=12):
            engine.add_request(p, params)
        reports = []
        engine.step(on_report=reports.append)
        assert (replays.shapes, reports[0].prefill_tokens, reports[0].prefill_rows, reports[0].prefill_graphed) == \
            (([128], 384, 384, True) if cuts else ([], 400, 400, False))


def test_prefill_shapes_cover_the_step_budget():
    """Shapes up to the budget's rows, each with the lanes that pad a full step at most twice over."""
    assert prefill_shapes(512, 64, 4096) == ((64, 16), (128, 8), (256, 4), (512, 2))
    assert prefill_shapes(512, 8, 4096) == ((64, 8), (128, 8), (256, 4), (512, 2))
    assert prefill_shapes(100, 8, 4096) == ((64, 4), (128, 2))  # a 65..100-row chunk needs 128 rows
    assert prefill_shapes(8192, 2, 1000) == ((64, 2), (128, 2), (256, 2), (512, 2), (1024, 2))
    # above the budget, single-lane shapes up to the idle budget (one prompt arriving at an idle engine)
    assert prefill_shapes(512, 8, 4096, 2048) == ((64, 8), (128, 8), (256, 4), (512, 2), (1024, 1), (2048, 1))
    assert prefill_shapes(100, 8, 600, 2048) == ((64, 4), (128, 2), (256, 1), (512, 1), (1024, 1))
    assert prefill_shapes(512, 8, 4096, 256) == prefill_shapes(512, 8, 4096)
    # a budget between two powers of two is a shape of its own (its chunks beside a round do not pad to the next)
    assert prefill_shapes(384, 8, 4096) == ((64, 8), (128, 4), (256, 2), (384, 2))
    assert prefill_shapes(384, 8, 4096, 2048) == ((64, 8), (128, 4), (256, 2), (384, 2), (512, 1), (1024, 1),
                                                  (2048, 1))
    assert prefill_shapes(400, 8, 300, 2048) == ((64, 8), (128, 4), (256, 2), (448, 1))  # 400 rows: 7 x 64
    assert prefill_graph_for([384, 384], prefill_graph_buckets(384, 8, 4096, 2048)) == (384, 2)
    for budget in (100, 384, 512, 8192):  # a full step of the widest chunks fits the widest shape's lanes
        shapes = prefill_shapes(budget, 64, 100_000)
        T, lanes = shapes[-1]
        assert T >= min(budget, PREFILL_MAX_ROWS) and lanes * T <= padded_rows_allowed(budget)


def test_a_step_replays_the_smallest_graph_that_holds_it_within_reason():
    """prefill_graph_for, the rule the runner replays by and the scheduler plans by: the smallest shape
    holding the longest chunk, its smallest lane bucket holding them all (3 x 2^k from 128 rows on), and no
    graph where none holds the step or its padding would pass twice its rows."""
    buckets = prefill_graph_buckets(512, 8, 4096)
    assert buckets == {64: (1, 2, 4, 8), 128: (1, 2, 3, 4, 6, 8), 256: (1, 2, 3, 4), 512: (1, 2)}
    assert prefill_graph_for([200], buckets) == (256, 1)
    assert prefill_graph_for([100, 90, 80], buckets) == (128, 3)
    assert prefill_graph_for([60] * 5, buckets) == (64, 8)
    assert prefill_graph_for([5, 70], buckets) is None  # 2 x 128 rows for 75
    # ... unless an eager step's launching costs more graph rows than that (a host-bound eager step)
    assert prefill_graph_for([5, 70], buckets, eager_rows=300) == (128, 2)
    assert prefill_graph_for([5, 3, 7, 2], buckets) is None and prefill_graph_for([5, 3, 7, 2], buckets, 256) == (64, 4)
    assert prefill_graph_for([5, 3, 7, 2], buckets, 255) is None
    assert prefill_graph_for([60] * 9, buckets) is None  # more lanes than the shape's buckets
    assert prefill_graph_for([600], buckets) is None  # longer than every shape


def test_preempted_sequences_resume_exactly_through_prefill_graphs(pair):
    """A page pool too small for four sequences: the newest are preempted and recomputed from prompt and
    generated tokens, their prefills replayed from the graphs (padding lanes included); every output
    equals that of the same engine prefilling eagerly, and every page comes back. On the CPU both also
    equal an engine with room for all; on a GPU the recomputation runs fla-core's chunked kernels (TF32
    dots) where the unpreempted sequence ran verify rounds, so a near-tie of a random model may resolve
    differently there - exact resumption against the unpreempted run is tests/test_pages.py's subject."""
    from tests.test_pages import page_bytes

    batch = prompts(96, [10, 7, 12, 9], seed=4)
    config = dict(max_slots=4, max_model_len=64, page_size=4, max_num_batched_tokens=64, idle_prefill_tokens=64,
                  kv_cache_memory=26 * page_bytes(pair[0], pair[1], page_size=4))
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    eager_engine = engine_for(pair[0], pair[1], prefill_graphs=False, **config)
    eager, _ = eager_engine.generate(batch, params)
    tight = engine_for(pair[0], pair[1], **config)
    replays = Replays(tight)
    done, _ = tight.generate(batch, params)
    assert [c.token_ids for c in done] == [c.token_ids for c in eager]
    # the first step's four prompts run eagerly (the 64-row shape holds two lanes at this budget); the
    # resumed sequences' recomputations replay it
    assert tight.stats["preemptions"] == eager_engine.stats["preemptions"] > 0 and replays.calls
    assert tight.scheduler.pages.num_free == tight.scheduler.pages.num_pages
    if DEVICE == "cpu":
        roomy_config = {k: v for k, v in config.items() if k != "kv_cache_memory"}
        roomy, _ = engine_for(pair[0], pair[1], prefill_graphs=False, **roomy_config).generate(batch, params)
        assert [c.token_ids for c in done] == [c.token_ids for c in roomy]


@pytest.mark.skipif(DEVICE == "cpu" and not isinstance(paged_attention_kernel, InterpretedFunction),
                    reason="the Triton route on CPU needs TRITON_INTERPRET=1 before import")
def test_only_the_rows_that_sample_a_token_are_projected_to_logits(pair):
    """A prefill step projects to logits (lm_head: the whole vocabulary's weights) only the last rows of the chunks
    that end their prompt, eagerly or from a prefill graph: a 150-token prompt and a 20-token one (first come, first
    served) in steps of 64 tokens project nothing in the first two steps and two rows in the third, where both end.
    The forward's last hidden rows give the logits it gave itself."""
    config = dict(max_slots=2, max_num_batched_tokens=64, idle_prefill_tokens=64, scale_prefill_budget=False)
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    batch = prompts(96, [150, 20], seed=13)
    outputs = []
    for graphs in (False, True):
        engine = engine_for(pair[0], pair[1], **config, **({} if graphs else {"prefill_graphs": False}))
        if graphs:
            Replays(engine)
        model, projected = engine.runner.model, []
        project = model.logits

        def counting(hidden, *args, **kwargs):
            projected.append(hidden.shape[0])
            return project(hidden, *args, **kwargs)

        model.logits = counting
        try:
            ids = [engine.add_request(p, params) for p in batch]
            rows, tokens = [], {i: [] for i in ids}
            while engine.has_work():
                projected.clear()
                reports = []
                for ev in engine.step(on_report=reports.append):
                    tokens[ev.request_id] += ev.token_ids
                if reports[0].prefill_tokens:
                    rows.append((reports[0].prefill_tokens, sum(projected)))
        finally:
            del model.logits
        outputs.append([tokens[i] for i in ids])
        assert rows == [(64, 0), (64, 0), (22 + 20, 2)], (graphs, rows)
    assert outputs[0] == outputs[1]
    model, kernels = engine.runner.model, engine.runner.kernels
    weight = model.embed_tokens.weight
    out = []
    with torch.inference_mode():
        for last_hidden in (True, False):  # each on a pool of its own (its slots' own pages)
            pool = SlotPool(model.cfg, 2, 64, weight.dtype, weight.device)
            lanes = ExtendBatch.build([(0, 0, list(batch[1])), (1, 0, list(batch[0][:30]))], weight.device)
            out.append(model.extend(lanes, pool, kernels, last_hidden=last_hidden)[0])
        hidden, logits = out
        assert hidden.shape == (2, model.cfg.hidden_size) and torch.equal(model.logits(hidden, kernels), logits)


def test_prefill_graphs_on_the_fused_kernels(pair):
    """The fused kernel set (what the graphs capture on a GPU; interpreted on the CPU) over padded lanes and
    rows: the paged attention kernel reads no further than each lane's rows, padding lanes (slot -1)
    touch nothing; the output and log probabilities equal the eager prefill's."""
    batch = prompts(96, [40, 35, 30], seed=6)  # together: 4 lanes x 64 rows, one a padding lane
    config = dict(max_slots=4, max_model_len=96, page_size=4, kernels="triton")
    params = SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=1)
    plain, _ = engine_for(pair[0], pair[1], prefill_graphs=False, **config).generate(batch, params)
    engine = engine_for(pair[0], pair[1], **config)
    replays = Replays(engine)
    done, _ = engine.generate(batch, params)
    assert replays.calls and any(-1 in slots for slots in replays.calls)
    assert [c.token_ids for c in done] == [c.token_ids for c in plain]
    for got, want in zip(done, plain):
        torch.testing.assert_close(torch.tensor([lp.logprob for lp in got.logprobs]),
                                   torch.tensor([lp.logprob for lp in want.logprobs]), rtol=1e-4, atol=1e-4)


def test_a_scaled_budget_cut_takes_the_rows_of_the_graph_it_replays(pair):
    """Beside a speculative round the step budget (40) is scaled by the round's cost over a plain one's (1.5,
    frozen here: the CPU's timings decide nothing) to 60 tokens; with prefill graphs each cut of the arriving
    prompt takes the 64 rows of the graph it replays instead of 60 and 4 padding rows. Outputs equal those of
    the eager engine, which cuts 60."""
    config = dict(max_slots=4, max_num_batched_tokens=40, idle_prefill_tokens=256)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    batch = prompts(96, [20, 200], seed=11)
    chunks = {}
    outputs = {}
    for graphs in (False, True):
        engine = engine_for(pair[0], pair[1], **config, **({} if graphs else {"prefill_graphs": False}))
        if graphs:
            Replays(engine)
        engine.scheduler.costs.cost = lambda bucket, width: 0.01 * (1.5 if width > 1 else 1.0)
        first = engine.add_request(batch[0], params)
        got, reports = {first: [ev for ev in engine.step()]}, []
        second = engine.add_request(batch[1], params)
        while engine.has_work():
            for ev in engine.step(on_report=reports.append):
                got.setdefault(ev.request_id, []).append(ev)
        outputs[graphs] = [[t for ev in got[rid] for t in ev.token_ids] for rid in (first, second)]
        chunks[graphs] = [r.prefill_tokens for r in reports if r.prefill_tokens]
        assert all(r.decode_lanes == 1 for r in reports if r.prefill_tokens)  # each beside the first's round
    assert chunks == {False: [60, 60, 60, 20], True: [64, 64, 64, 8]}
    assert outputs[True] == outputs[False]


@pytest.mark.skipif(DEVICE != "cuda", reason="timed on CUDA at engine start (0 on the CPU: no prefill graphs)")
def test_the_eager_step_cost_is_measured_at_start_and_leaves_slot_zero_clean(pair):
    """An engine with prefill graphs times an eager prefill and a graph replay at start (on slot 0 and padding
    lanes): what an eager step's launching costs in graph rows is positive, and the first request - on slot 0
    - decodes as an engine's without prefill graphs (which measures nothing)."""
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    prompt = prompts(96, [40], seed=13)
    graphed, plain = engine_for(pair[0], pair[1]), engine_for(pair[0], pair[1], prefill_graphs=False)
    assert graphed.scheduler.eager_prefill_rows > 0 and plain.scheduler.eager_prefill_rows == 0
    assert [d.token_ids for d in graphed.generate(prompt, params)[0]] == \
        [d.token_ids for d in plain.generate(prompt, params)[0]]


def test_run_host_fills_each_input_section_of_the_flat_buffer(monkeypatch):
    """LaneGraphs.run_host (one transfer into the flat static buffer) hands each bucket's graph the host
    arrays' lanes, input by input, padded to the bucket, whatever the lanes past the bucket hold; inputs
    of mixed dtypes keep a buffer each and cannot take it. (A stand-in capture on the CPU: the 'graph' runs the function on the
    static views it was captured on, as a replay reads them.)"""
    import numpy as np

    from deltaflash.engine import graphs as graphs_module

    class Replay:
        def __init__(self, fn):
            self.fn, self.out = fn, None

        def replay(self):
            self.out.copy_(self.fn())

    def stand_in(fn, pool=None):
        graph = Replay(fn)
        graph.out = fn().clone()
        return graph, graph.out

    monkeypatch.setattr(graphs_module, "capture", stand_in)
    # ids [lanes, 3] and a per-lane value: the function reads the ids plus 10 x the value, lane by lane
    graphs = graphs_module.LaneGraphs("t", lambda ids, v: ids + 10 * v[:, None], [((3,), torch.long, 0),
                                      ((), torch.long, -1)], (1, 2, 4), "cpu", None)
    for bucket in (1, 2, 4):
        graphs.capture(bucket)
    (out,) = graphs.run_host(np.arange(12).reshape(4, 3), np.array([1, 2, 3, 4]))
    assert out.tolist() == [[10, 11, 12], [23, 24, 25], [36, 37, 38], [49, 50, 51]]
    (out,) = graphs.run_host(np.array([[7, 8, 9], [1, 1, 1]]), np.array([0, 5]))  # lanes 2, 3 keep stale values
    assert out.tolist() == [[7, 8, 9], [51, 51, 51]]
    (out,) = graphs.run_host(np.array([[1, 2, 3]] * 3), np.array([1, 2, 3]))  # bucket 4, lane 3 padded
    assert out.tolist() == [[11, 12, 13], [21, 22, 23], [31, 32, 33]]
    assert graphs.static[0][3].tolist() == [0, 0, 0] and graphs.static[1][3].item() == -1
    assert graphs.run_host(np.zeros((5, 3), dtype=np.int64), np.zeros(5, dtype=np.int64)) is None  # no bucket
    mixed = graphs_module.LaneGraphs("m", lambda a, b: a, [((), torch.long, 0), ((), torch.float32, 0.0)], (1,),
                                     "cpu", None)
    assert mixed.flat is None
    with pytest.raises(ValueError, match="one dtype"):
        mixed.run_host(np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.float32))


def test_bench_host_path_replays_its_stand_in_graphs():
    """bench/host_path.py times the engine's own path: every prompt it sends replays a stand-in prefill
    graph (the script refuses to print a figure otherwise)."""
    from tests import bench_scripts

    p50 = bench_scripts.load("host_path").main(["--tokens", "64", "300", "--requests", "3"])
    assert set(p50) == {64, 300} and all(t > 0 for t in p50.values())
