"""The serving core on CPU: the scheduler's decisions, one host sync per round, cancellation at every
stage, slot reuse with a drafter, mixed greedy and sampled lanes, the package's import floors."""

import ast
import dataclasses
import functools
import zlib
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from deltaflash.core.request import SamplingParams, Sequence, Status
from deltaflash.engine.config import EngineConfig
from deltaflash.engine.graphs import prefill_graph_buckets, prefill_graph_for, prefill_shapes
from deltaflash.engine.scheduler import PrefillChunk, Scheduler
from deltaflash.errors import DeltaflashError
from deltaflash.speculative.policy import RoundCosts
from deltaflash.speculative.sources import ScriptedSource
from tests.spec_pairs import EagerGraph, engine_for, make_pair, prompts

GREEDY = SamplingParams(max_new_tokens=30, ignore_eos=True)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine")
    return {"dflash": make_pair(root, "dense_gqa", "dflash", seed=1),
            "dflash2": make_pair(root, "dense_tied", "dflash2", seed=2, block_size=5),
            "moe": make_pair(root, "moe", "dflash", seed=3, block_size=4)}


def run(engine, prompt_list, params, on_step=None):
    """Generate step by step; returns token ids per request (in submission order) and finish reasons."""
    params = params if isinstance(params, list) else [params] * len(prompt_list)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompt_list, params)]
    out, reasons = {i: [] for i in ids}, {}
    while engine.has_work():
        if on_step is not None:
            on_step(engine)
        for ev in engine.step():
            out[ev.request_id] += ev.token_ids
            if ev.finish_reason:
                reasons[ev.request_id] = ev.finish_reason
    return [out[i] for i in ids], [reasons[i] for i in ids]


# ---- the scheduler (policy only) -----------------------------------------------------------------
def sequence(rid: str, prompt_len: int, max_new: int = 10) -> Sequence:
    """A sequence for the scheduler alone, its prompt its own (equal prompts would fork: engine/shares.py)."""
    first = zlib.crc32(rid.encode()) % 1000
    return Sequence(rid, list(range(first, first + prompt_len)), SamplingParams(max_new_tokens=max_new), frozenset(),
                    seed=0)


def test_prefill_chunks_of_a_resumed_sequence_join_its_prompt_and_output():
    """A preempted sequence recomputes its prompt and every generated token but the pending one; a chunk
    of them is cut without joining the two lists first."""
    resumed, fresh = sequence("r", 5), sequence("f", 4)
    resumed.output_ids = [10, 11, 12]
    joined = resumed.prompt_ids + resumed.output_ids[:-1]
    assert (resumed.prefill_len, fresh.prefill_len) == (7, 4)
    for start in range(8):
        for stop in range(start, 10):
            assert resumed.prefill_tokens(start, stop) == joined[start:stop], (start, stop)
    assert fresh.prefill_tokens(1, 3) == fresh.prompt_ids[1:3] and fresh.prefill_tokens(2, 9) == fresh.prompt_ids[2:]
    resumed.num_prefilled = 5
    assert resumed.prompt_left == 2


def test_scheduler_admits_by_slots_and_spends_the_prefill_budget_in_order():
    """Prompts get the idle budget while nothing decodes, the step budget beside a round."""
    config = EngineConfig(max_slots=2, max_num_batched_tokens=10, idle_prefill_tokens=16,
                          block_size=4).resolve(torch.device("cpu"), 4)
    scheduler = Scheduler(config, num_pages=1000)
    for rid, n in (("a", 7), ("b", 25), ("c", 3)):
        scheduler.add(sequence(rid, n))
    plan = scheduler.schedule()
    assert [s.request_id for s in plan.admitted] == ["a", "b"] and len(scheduler.waiting) == 1
    assert [(c.seq.request_id, c.start, len(c.tokens), c.last) for c in plan.prefill] == [("a", 0, 7, True),
                                                                                          ("b", 0, 9, False)]
    for chunk in plan.prefill:  # what the engine does once the runner ran the chunks
        chunk.seq.num_prefilled += len(chunk.tokens)
        chunk.seq.status = Status.DECODING if chunk.last else chunk.seq.status
    plan = scheduler.schedule()  # a's round (4 rows; a has a pending token) beside b's next 10 tokens
    a = plan.decode[0]
    assert a.request_id == "a" and plan.round_width == 4
    assert plan.admitted == () and [(c.seq.request_id, c.start, len(c.tokens)) for c in plan.prefill] == [("b", 9, 10)]


def test_scheduler_widths_follow_the_tokens_left():
    config = EngineConfig(max_slots=3, block_size=6).resolve(torch.device("cpu"), 6)
    scheduler = Scheduler(config, num_pages=1000)
    seqs = [sequence("a", 3, max_new=20), sequence("b", 3, max_new=4), sequence("c", 3, max_new=2)]
    for seq in seqs:
        scheduler.add(seq)
    scheduler.schedule()
    for seq in seqs:
        seq.status, seq.num_prefilled, seq.output_ids, seq.pending = Status.DECODING, 3, [1], 1
    plan = scheduler.schedule()
    assert plan.widths == (6, 3, 1) and plan.round_width == 6  # b has 3 tokens left, c one: plain decoding
    plain = Scheduler(EngineConfig(max_slots=1).resolve(torch.device("cpu"), None), num_pages=1000)
    assert plain.config.block_size == 1 and plain.width(seqs[0]) == 1


def two_decoding_and_a_long_prompt(prompt_len: int, costs: RoundCosts | None = None, idle_prefill_tokens: int = 100,
                                   max_num_batched_tokens: int = 20, max_slots: int = 4,
                                   **options) -> tuple[Scheduler, list[Sequence]]:
    """A scheduler (step budget 20, block 4) whose lanes a and b decode, with a `prompt_len`-token prompt waiting."""
    config = EngineConfig(max_slots=max_slots, max_num_batched_tokens=max_num_batched_tokens,
                          idle_prefill_tokens=idle_prefill_tokens, block_size=4, **options).resolve(torch.device("cpu"), 4)
    scheduler = Scheduler(config, num_pages=1000, costs=costs)
    running = [sequence(rid, 3, max_new=50) for rid in "ab"]
    for seq in running:
        scheduler.add(seq)
    scheduler.schedule()
    for seq in running:
        seq.status, seq.num_prefilled, seq.output_ids, seq.pending = Status.DECODING, 3, [1], 1
    scheduler.add(sequence("long", prompt_len))
    return scheduler, running


def test_the_prefill_budget_is_not_drawn_on_by_the_round():
    """max_num_batched_tokens bounds the prompt chunks of a step, beside the round: a waiting prompt gets
    the whole budget however many rows the running lanes verify, and no more; with nothing decoding, the
    idle budget."""
    scheduler, running = two_decoding_and_a_long_prompt(100, idle_prefill_tokens=50)
    plan = scheduler.schedule()  # a round of 2 lanes x 4 rows beside 20 prompt tokens
    assert plan.round_width == 4 and len(plan.decode) == 2
    assert [(c.seq.request_id, len(c.tokens)) for c in plan.prefill] == [("long", 20)]
    plan.prefill[0].seq.num_prefilled += 20
    plan = scheduler.schedule()
    assert [(c.seq.request_id, c.start, len(c.tokens)) for c in plan.prefill] == [("long", 20, 20)]
    plan.prefill[0].seq.num_prefilled += 20
    for seq in running:
        scheduler.finish(seq, "length")
    plan = scheduler.schedule()
    assert plan.decode == () and [(c.seq.request_id, c.start, len(c.tokens)) for c in plan.prefill] == [("long", 40, 50)]
    assert EngineConfig(max_num_batched_tokens=600).resolve(torch.device("cpu"), None).idle_prefill_tokens == 2048
    assert EngineConfig(max_num_batched_tokens=4096).resolve(torch.device("cpu"), None).idle_prefill_tokens == 4096


def test_the_prefill_budget_beside_a_speculative_round_scales_with_its_cost():
    """With scale_prefill_budget, a waiting prompt gets the step budget times the round's cost over a plain
    round's at the lane bucket (calibrated seeds, then measured rounds), at most the idle budget; beside a
    plain round, or without costs, or with the scaling off, the step budget; the plan carries its budget."""
    costs = RoundCosts(seeds={(2, 1): 1.0, (2, 4): 2.5, (4, 1): 1.0, (4, 4): 9.0}, buckets=(1, 2, 4))
    scheduler, running = two_decoding_and_a_long_prompt(300, costs=costs)
    assert scheduler.config.scale_prefill_budget
    plan = scheduler.schedule()  # 2 lanes x 4 rows: bucket 2, 2.5x a plain round
    assert plan.round_width == 4 and plan.prefill_budget == 50
    assert [(c.seq.request_id, len(c.tokens)) for c in plan.prefill] == [("long", 50)]
    plan.prefill[0].seq.num_prefilled += 50
    costs.observe(2, 4, 4.0)  # measured 4.0 against the plain round's seed plus the overhead seen (0.1 x 1.5)
    plan = scheduler.schedule()
    assert plan.prefill_budget == int(20 * 4.0 / 1.15) and [len(c.tokens) for c in plan.prefill] == [69]
    plan.prefill[0].seq.num_prefilled += 69
    with scheduler.pinned(width=1):  # a plain round: the step budget
        assert scheduler.schedule().prefill_budget == 20
    assert scheduler.prefill_budget(0, 1) == 100  # nothing decodes: the idle budget
    assert costs.cost_ratio(3, 4) == pytest.approx(9.15 / 1.15)  # 3 lanes: bucket 4
    assert scheduler.prefill_budget(3, 4) == 100  # at most the idle budget
    costs.forget()
    assert costs.cost_ratio(2, 4) == 2.5 and costs.measured == {}
    costs.observe(2, 1, 10.0)  # a speculative round cheaper than a plain one: never below the step budget
    assert costs.cost_ratio(2, 4) < 1 and scheduler.prefill_budget(2, 4) == 20
    assert two_decoding_and_a_long_prompt(300)[0].schedule().prefill_budget == 20
    off, _ = two_decoding_and_a_long_prompt(300, costs=costs, scale_prefill_budget=False)
    assert not off.config.scale_prefill_budget and off.schedule().prefill_budget == 20
    assert not EngineConfig(scale_prefill_budget=True).resolve(torch.device("cpu"), None).scale_prefill_budget
    assert EngineConfig(scale_prefill_budget=None).resolve(torch.device("cpu"), 4).round_prefill_tokens == 2048
    assert EngineConfig().resolve(torch.device("cpu"), None).round_prefill_tokens == 512
    assert not EngineConfig(tensor_parallel_size=2).resolve(torch.device("cpu"), 4).scale_prefill_budget
    with pytest.raises(DeltaflashError, match="scale_prefill_budget"):
        EngineConfig(tensor_parallel_size=2, scale_prefill_budget=True).resolve(torch.device("cpu"), 4)


def test_max_prefill_stall_holds_the_budget_to_rounds_of_prefill():
    """With max_prefill_stall S and the measured cost of prompt tokens, the step budget beside a plain round
    of cost c is the tokens that cost S c (within the user's budget, at least 64), and a speculative round
    scales that; with no measurement yet, or S = 0, the user's budget."""
    costs = RoundCosts(seeds={(2, 1): 0.010, (2, 4): 0.025}, buckets=(1, 2, 4))
    scheduler, _ = two_decoding_and_a_long_prompt(3000, costs=costs, idle_prefill_tokens=2048,
                                                  max_num_batched_tokens=512, max_prefill_stall=2.0)
    assert scheduler.prefill_budget(2, 1) == 512 and scheduler.prefill_budget(2, 4) == 1280  # nothing measured
    costs.prefill.observe(512, 0.0512)  # 512 tokens cost 5 rounds (one size measured: b = 0.1 ms, a = 0): 200 cost 2
    assert scheduler.stall_budget(2) == 200 and scheduler.prefill_budget(2, 1) == 200
    assert scheduler.prefill_budget(2, 4) == 500  # beside a round 2.5x as dear: 2.5x the tokens
    with scheduler.pinned(width=1):
        plan = scheduler.schedule()
    assert plan.prefill_budget == 200 and [len(c.tokens) for c in plan.prefill] == [200]
    assert scheduler.prefill_budget(0, 1) == 2048  # nothing decodes: nothing to stall
    costs.forget()
    costs.prefill.observe(512, 0.512)
    assert scheduler.stall_budget(2) == 64  # (20 by the rule: a prompt still moves)
    costs.forget()
    costs.prefill.observe(512, 0.000512)
    assert scheduler.stall_budget(2) == 512  # never past the user's budget
    off, _ = two_decoding_and_a_long_prompt(3000, costs=costs, max_num_batched_tokens=512)
    assert off.config.max_prefill_stall == 0 and off.stall_budget(2) == 512
    costs.forget()
    assert costs.prefill.line() is None
    costs.prefill.observe(100, 0.02)
    costs.prefill.observe(100, -0.01)  # a step quicker than its round's mean: no negative cost
    assert costs.prefill.line() == (0.0, pytest.approx(0.9 * 0.02 / 190), False)
    costs.forget()
    costs.prefill.observe(100, -0.01)  # only such steps: nothing measured to hold the budget to
    assert costs.prefill.line() == (0.0, 0.0, False) and scheduler.stall_budget(2) == 512
    costs.forget()
    for n in (100, 300, 200, 400):  # tokens that vary: the line a + b n is fitted
        costs.prefill.observe(n, 0.003 + 1e-5 * n)
    a, b, fitted = costs.prefill.line()
    assert fitted and a == pytest.approx(0.003) and b == pytest.approx(1e-5)
    with pytest.raises(DeltaflashError, match="max_prefill_stall must be >= 0"):
        EngineConfig(max_prefill_stall=-1).resolve(torch.device("cpu"), 4)
    with pytest.raises(DeltaflashError, match="max_prefill_stall"):
        EngineConfig(tensor_parallel_size=2, max_prefill_stall=2).resolve(torch.device("cpu"), 4)


def test_the_stall_budget_settles_where_the_prefill_costs_the_stall():
    """Each step measures what its n prompt tokens added (a + b n for a fixed part a): the budgets settle at
    n = (S c - a) / b, where the prefill costs S rounds; where a alone exceeds S c, at the user's budget."""
    a, b, c, stall = 2e-3, 20e-6, 6.7e-3, 2.0
    costs = RoundCosts(seeds={(2, 1): c, (2, 4): 2 * c}, buckets=(1, 2, 4))
    scheduler, _ = two_decoding_and_a_long_prompt(10, costs=costs, idle_prefill_tokens=4096,
                                                  max_num_batched_tokens=4096, max_prefill_stall=stall)
    budgets = [scheduler.stall_budget(2)]
    for _ in range(20):
        costs.prefill.observe(budgets[-1], a + b * budgets[-1])
        budgets.append(scheduler.stall_budget(2))
    settled = (stall * c - a) / b  # 570 tokens
    assert budgets[0] == 4096 and budgets[1] < 1000 and abs(budgets[-1] - settled) <= 1, budgets
    assert a + b * budgets[-1] == pytest.approx(stall * c, rel=0.01)
    # a fixed part above the time allowed: no chunk meets the stall, and the budget goes back to the user's
    costs.forget()
    budgets = [scheduler.stall_budget(2)]
    for _ in range(6):
        costs.prefill.observe(budgets[-1], 3 * stall * c + b * budgets[-1])
        budgets.append(scheduler.stall_budget(2))
    assert budgets[0] == 4096 and budgets[1] < 4096 and budgets[-3:] == [4096] * 3, budgets


def test_the_stall_budget_takes_whole_prefill_graph_chunks():
    """With prefill graphs a chunk replays the graph of the next power-of-two rows, padded, so the stall budget
    goes down to whole graph chunks: rows that cost S rounds by the line (451) make a 256-token budget, not a
    451-token one (which would run - and cost - 512 rows). A graph's rows and the user's budget stay as they
    are; without prefill graphs the line's rows are the budget."""
    c = 6.7e-3
    costs = RoundCosts(seeds={(2, 1): c, (2, 4): 2 * c}, buckets=(1, 2, 4))
    eager, _ = two_decoding_and_a_long_prompt(3000, costs=costs, idle_prefill_tokens=2048, max_num_batched_tokens=512,
                                              max_prefill_stall=2.0)
    graphed, _ = two_decoding_and_a_long_prompt(3000, costs=costs, idle_prefill_tokens=2048,
                                                max_num_batched_tokens=512, max_prefill_stall=2.0)
    graphed.config = dataclasses.replace(graphed.config, prefill_graphs=True)
    for rows_in_two_rounds, eager_budget, graphed_budget in ((451.5, 451, 256), (256.5, 256, 256), (130, 130, 128),
                                                             (700, 512, 512), (20, 64, 64)):
        costs.forget()
        costs.prefill.observe(512, 512 * 2 * c / rows_in_two_rounds)  # one size measured: a per-row cost
        assert (eager.stall_budget(2), graphed.stall_budget(2)) == (eager_budget, graphed_budget), rows_in_two_rounds
    with graphed.pinned(width=1):
        plan = graphed.schedule()
    assert [len(chunk.tokens) for chunk in plan.prefill] == [64]


@pytest.mark.parametrize("graphs", [True, False])
def test_prompts_of_straddling_lengths_are_cut_to_a_graph_where_an_eager_step_costs_more(graphs):
    """Eight prompts of 90-140 tokens at an idle engine (budget 2048; prefill graphs of 8 lanes x 64 and x 128
    rows, 4 x 256, ...): whole, they need 8 lanes of 256 rows, which no graph holds - an eager step. Where its
    launching costs what 4,000 rows of graph work do (a small model), they are cut to the graph shape that
    takes the most tokens beating that: 8 x 128 (871 tokens; 4 x 256 would take 440). Where it costs 500 rows
    (a large model, an eager step of 893 rows: 1 token a row) no cut beats it: no cut. Nor with prompts that
    fit a graph whole, a cost not measured, or no prefill graphs."""
    config = EngineConfig(max_slots=8, max_num_batched_tokens=512, idle_prefill_tokens=2048, max_model_len=4096)
    config = dataclasses.replace(config.resolve(torch.device("cpu"), None), prefill_graphs=graphs)
    shapes = dict(prefill_shapes(512, 8, 4096, 2048))
    assert (shapes[64], shapes[128], shapes[256]) == (8, 8, 4)

    def first_step(lengths, eager_rows):
        scheduler = Scheduler(config, num_pages=1000)
        scheduler.eager_prefill_rows = eager_rows
        for i, n in enumerate(lengths):
            scheduler.add(sequence(f"p{i}", n))
        return [len(c.tokens) for c in scheduler.schedule().prefill]

    straddling = [100, 140, 90, 110, 130, 120, 100, 95]
    assert first_step(straddling, 4000) == ([100, 128, 90, 110, 128, 120, 100, 95] if graphs else straddling)
    assert first_step(straddling, 500) == first_step(straddling, 0) == straddling
    assert first_step([100, 120, 90, 110], 4000) == [100, 120, 90, 110]  # 4 x 128: a graph whole


def test_a_graph_cut_is_planned_with_the_slack_the_step_takes():
    """_graph_fit scores the chunks _prefill_chunks will take, slack included. Three prompts of 100, 100 and
    25 tokens left, a 212-token budget beside a speculative round with 15 tokens of slack: cut by the budget
    alone the third takes 12 tokens, and 3 lanes x 128 rows (padded as 4) would pass twice the step's 212
    rows (and the eager step's cost, 500 rows here) - an eager step, which the scheduler would rather cut to the
    first two prompts (200 tokens, 2 x 128 rows). But the third's rest of 13 is within the slack, so the step
    takes it whole: 225 tokens, which the 128-row graph's 3-lane bucket replays within reason - no cut."""
    config = EngineConfig(max_slots=8, max_num_batched_tokens=512, max_model_len=4096)
    config = dataclasses.replace(config.resolve(torch.device("cpu"), None), prefill_graphs=True)
    scheduler = Scheduler(config, num_pages=1000)
    scheduler.eager_prefill_rows = 500.0
    for i, n in enumerate((100, 100, 25)):
        scheduler.add(sequence(f"p{i}", n))
    scheduler.schedule()  # admits all three (its chunks are not run: nothing is prefilled)
    assert [s.prompt_left for s in scheduler.running.values()] == [100, 100, 25]
    buckets = prefill_graph_buckets(512, 8, 4096, config.idle_prefill_tokens)
    assert prefill_graph_for([100, 100, 12], buckets) is None
    assert prefill_graph_for([100, 100, 25], buckets) == (128, 3)
    assert [len(c.tokens) for c in scheduler._prefill_chunks(212, slack=15)] == [100, 100, 25]
    assert [len(c.tokens) for c in scheduler._prefill_chunks(212)] == [100, 100]  # no slack: cut to a graph


def test_a_cut_fills_its_graph_rows_where_the_step_replays_padded():
    """A scaled budget's cut (fill) grows to its graph's rows where the step replays a graph: two prompts' rests of
    2 and 3 tokens and a 10-token cut of a long prompt pad 4 lanes x 64 rows, past twice their rows - an eager step
    that takes the cut as is - but where the eager step's launching costs 300 graph rows the step replays that
    graph padded (prefill_graph_for), and the cut then takes its 64 rows in place of padding."""
    config = EngineConfig(max_slots=8, max_num_batched_tokens=512, max_model_len=4096)
    config = dataclasses.replace(config.resolve(torch.device("cpu"), None), prefill_graphs=True, prefix_cache=0)
    buckets = prefill_graph_buckets(512, 8, 4096, config.idle_prefill_tokens)
    for eager_rows, lens in ((0.0, [2, 3, 10]), (300.0, [2, 3, 64])):
        scheduler = Scheduler(config, num_pages=1000)
        scheduler.eager_prefill_rows = eager_rows
        for i, n in enumerate((2, 3, 500)):
            scheduler.add(sequence(f"p{i}", n))
        scheduler.schedule()  # admits all three (its chunks are not run: nothing is prefilled)
        waiting = list(scheduler.running.values())
        assert scheduler._chunk_lens(waiting, 15, 15, 3, slack=0, fill=True) == lens
        assert prefill_graph_for(lens, buckets, eager_rows) == (None if eager_rows == 0 else (64, 4))


def test_the_plan_names_the_graph_that_replays_its_prefill():
    """The scheduler decides graph or eager for each step's prefill and the plan carries it (StepPlan.prefill_graph):
    the smallest graph holding the chunks that score no prompt (a scored prompt runs an eager forward of its own);
    None without prefill graphs. A long prompt's 1,100-row chunk after 2,048 keys at an idle engine runs eagerly
    where the runner attends over a gathered context (dense_prefill) - unless the eager step's launching costs more
    than its rows (eager_prefill_rows), below 16,384 keys - and replays its graph beside a round."""
    config = EngineConfig(max_slots=8, max_num_batched_tokens=512, idle_prefill_tokens=2048, max_model_len=40_000)
    config = dataclasses.replace(config.resolve(torch.device("cpu"), None), prefill_graphs=True, prefix_cache=0)
    for scored in (False, True):
        scheduler = Scheduler(config, num_pages=4000)
        for i, n in enumerate((100, 90, 80)):
            seq = sequence(f"p{i}", n)
            if scored and i == 2:
                seq.params = dataclasses.replace(seq.params, prompt_logprobs=1)
            scheduler.add(seq)
        plan = scheduler.schedule()
        assert [len(c.tokens) for c in plan.prefill] == [100, 90, 80]
        assert plan.prefill_graph == ((128, 2) if scored else (128, 3))
    plain = Scheduler(dataclasses.replace(config, prefill_graphs=False), num_pages=4000)
    plain.add(sequence("p", 100))
    assert plain.schedule().prefill_graph is None

    long = sequence("long", 20_000)
    for dense, eager_rows, start, alone, graph in ((True, 0.0, 2048, True, None), (True, 0.0, 2048, False, (2048, 1)),
                                                   (False, 0.0, 2048, True, (2048, 1)),
                                                   (True, 8192.0, 2048, True, (2048, 1)),
                                                   (True, 8192.0, 16_384, True, None)):
        scheduler = Scheduler(config, num_pages=4000, dense_prefill=dense)
        scheduler.eager_prefill_rows = eager_rows
        chunk = PrefillChunk(long, start, long.prefill_array(start, start + 1100), last=False)
        assert scheduler.prefill_graph([chunk], alone) == graph, (dense, eager_rows, start, alone)


def test_an_engine_measures_the_prefill_beside_its_rounds_and_holds_the_budget(pairs):
    """A target-only engine with max_prefill_stall calibrates round costs, records what each step that
    prefills beside a round added (its rows: eagerly, its tokens), and budgets those steps by the rule (the costs frozen here:
    the CPU's timings decide nothing); outputs equal each prompt's solo output."""
    target_dir, _ = pairs["dflash"]
    plist = prompts(96, [5, 8, 200], seed=9)
    solo = [c.token_ids for p in plist for c in engine_for(target_dir, max_slots=1).generate([p], GREEDY)[0]]
    engine = engine_for(target_dir, max_slots=3, max_num_batched_tokens=128, idle_prefill_tokens=256,
                        max_prefill_stall=1.0, prefill_graphs=False)  # (graphs snap budgets to their tiles)
    costs = engine.scheduler.costs
    assert costs is not None and engine.config.max_prefill_stall == 1.0
    observed = []
    costs.cost = lambda bucket, width: 0.01
    costs.prefill.observe(100, 100 * 0.01 / 80)  # one round's cost buys 80 prompt tokens
    costs.prefill.observe = lambda tokens, seconds: observed.append(tokens)
    ids = [engine.add_request(p, GREEDY) for p in plist[:2]]
    out, reports = defaultdict(list), []
    while any(len(out[i]) < 3 for i in ids):
        for ev in engine.step():
            out[ev.request_id] += ev.token_ids
    ids.append(engine.add_request(plist[2], GREEDY))
    while engine.has_work():
        for ev in engine.step(on_report=reports.append):
            out[ev.request_id] += ev.token_ids
    beside = [r for r in reports if r.prefill_tokens and r.decode_lanes]
    assert len(beside) >= 2 and all(r.prefill_budget == 80 and r.prefill_tokens <= 80 for r in beside)
    assert observed == [r.prefill_rows for r in beside] == [r.prefill_tokens for r in beside]
    assert [out[i] for i in ids] == solo


@pytest.mark.parametrize("prompt_len,taken", [(55, [55]), (57, [50, 7])])
def test_a_scaled_budget_finishes_a_prompt_a_few_tokens_short_of_its_end(prompt_len, taken):
    """Beside a speculative round (budget 20 scaled to 50), a prompt whose rest after the budget's chunk
    would be at most an eighth of it (6 tokens) goes in whole, and the plan says so; a longer rest waits
    for the next step. A step budget not scaled is exact."""
    costs = RoundCosts(seeds={(2, 1): 1.0, (2, 4): 2.5}, buckets=(1, 2, 4))
    scheduler, _ = two_decoding_and_a_long_prompt(prompt_len, costs=costs)
    assert scheduler.prefill_slack(50, 2, 4) == 6 and scheduler.prefill_slack(20, 2, 1) == 0
    got = []
    for _ in taken:
        plan = scheduler.schedule()
        got += [len(c.tokens) for c in plan.prefill]
        assert plan.prefill_budget >= got[-1]
        plan.prefill[0].seq.num_prefilled += got[-1]
    assert got == taken and plan.prefill[0].last
    exact, _ = two_decoding_and_a_long_prompt(23, costs=costs, scale_prefill_budget=False)
    assert [len(c.tokens) for c in exact.schedule().prefill] == [20]  # (3 left: still the next step's)


def test_a_scaled_cut_fills_the_padding_of_its_prefill_graph():
    """With prefill graphs, a chunk a scaled budget cuts (50 tokens beside a speculative round) grows to the rows
    of the graph it replays (64): prompt tokens instead of padding. Not past the prompt's end or the graphs'
    reach (config.round_prefill_tokens), not without graphs, and never for a budget the user set (the step
    budget beside a plain round is exact)."""
    costs = RoundCosts(seeds={(2, 1): 1.0, (2, 4): 2.5}, buckets=(1, 2, 4))

    def first_chunks(prompt_len, graphs=True, **options):
        scheduler, _ = two_decoding_and_a_long_prompt(prompt_len, costs=costs, **options)
        scheduler.config = dataclasses.replace(scheduler.config, prefill_graphs=graphs)
        plan = scheduler.schedule()
        with scheduler.pinned(width=1):
            plain = scheduler.schedule()
        return plan.round_width, [len(c.tokens) for c in plan.prefill], plan.prefill_budget, \
            [len(c.tokens) for c in plain.prefill]

    assert first_chunks(300) == (4, [64], 64, [20])
    assert first_chunks(60) == (4, [60], 60, [20])  # the prompt's end first
    assert first_chunks(300, graphs=False) == (4, [50], 50, [20])
    assert first_chunks(300, idle_prefill_tokens=60)[1] == [50]  # no 64-row graph within the reach of 60

    def behind_short_prompts(*short):
        scheduler, _ = two_decoding_and_a_long_prompt(short[0], costs=costs, max_slots=8)
        for i, n in enumerate([*short[1:], 300]):
            scheduler.add(sequence(f"p{i}", n))
        scheduler.config = dataclasses.replace(scheduler.config, prefill_graphs=True)
        return [len(c.tokens) for c in scheduler.schedule().prefill]

    assert behind_short_prompts(5) == [5, 64]  # 2 lanes x 64 rows for 50 replay a graph: the cut fills it
    assert behind_short_prompts(5, 5) == [5, 5, 40]  # 4 x 64 rows for 50 pad too much (an eager step): no fill


def test_a_long_prompt_arriving_never_costs_the_running_streams_a_round(pairs):
    """Two streams decode (with a drafter, and plainly) while a 150-token prompt arrives under a 24-token
    step budget (scaled by the speculative rounds' cost up to 48): it is prefilled in chunks within each
    step's budget over several steps, every running stream gets its round in every one of them, and all
    outputs equal each prompt's solo output. The rounds' costs learn only from steps without prefill (a
    step's prefill runs on the device before its round, inside the round's measured time)."""
    target_dir, draft_dir = pairs["dflash"]
    plist = prompts(96, [5, 8, 150], seed=9)
    solo = [c.token_ids for p in plist for c in engine_for(target_dir, max_slots=1).generate([p], GREEDY)[0]]
    for draft in (draft_dir, None):
        engine = engine_for(target_dir, draft, max_slots=3, max_num_batched_tokens=24, idle_prefill_tokens=48)
        assert engine.config.scale_prefill_budget == (draft is not None)
        budgets, observed = [], []
        if draft is not None:
            costs, observe = engine.scheduler.costs, engine.scheduler.costs.observe
            costs.observe = lambda *args: (observed.append(args), observe(*args))
        ids = [engine.add_request(p, GREEDY) for p in plist[:2]]
        out = defaultdict(list)
        while any(len(out[i]) < 3 for i in ids):  # both streams past prefill and decoding
            for ev in engine.step():
                out[ev.request_id] += ev.token_ids
        ids.append(engine.add_request(plist[2], GREEDY))
        chunks = 0
        while engine.has_work():
            live = [i for i in ids[:2] if engine.scheduler.running.get(i) is not None]
            long_prefilling = any(s.request_id == ids[2] and s.status is not Status.DECODING
                                  for s in [*engine.scheduler.waiting, *engine.scheduler.running.values()])
            before, reports = len(observed), []
            events = engine.step(on_report=reports.append)
            for r in reports:
                budgets.append((r.prefill_tokens, r.prefill_budget, r.decode_lanes))
                assert (len(observed) > before) == (draft is not None and r.decode_lanes > 0 and not r.prefill_tokens)
            for ev in events:
                out[ev.request_id] += ev.token_ids
            if long_prefilling:
                chunks += 1
                got = {ev.request_id for ev in events if ev.token_ids}
                assert set(live) <= got, f"a running stream got no round while the long prompt prefilled: {got}"
        assert chunks >= 150 // 48 and (draft is None or observed)
        for tokens, budget, lanes in budgets:
            assert tokens <= budget and (24 <= budget <= 48 if lanes else budget == 48)
        assert [out[i] for i in ids] == solo


def test_config_is_resolved_once_with_the_environment():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert EngineConfig().resolve(cpu, None, env={}).kernels == "reference"
    assert EngineConfig().resolve(cuda, None, env={}).kernels == "triton"
    resolved = EngineConfig().resolve(cuda, 8, env={"DELTAFLASH_NO_FUSED_KERNELS": "1",
                                                    "DELTAFLASH_NO_CUDA_GRAPHS": "1"})
    assert (resolved.kernels, resolved.cuda_graphs, resolved.block_size) == ("reference", False, 8)
    assert EngineConfig().resolve(cuda, 8, env={}).cuda_graphs is True
    assert EngineConfig().resolve(cuda, 8, env={}).prefill_graphs is True  # with the rounds' graphs
    assert EngineConfig().resolve(cpu, 8, env={}).prefill_graphs is False
    assert resolved.prefill_graphs is False  # no graphs at all
    alone = EngineConfig().resolve(cuda, 8, env={"DELTAFLASH_NO_PREFILL_GRAPHS": "1"})
    assert (alone.cuda_graphs, alone.prefill_graphs) == (True, False)
    with pytest.raises(DeltaflashError, match="prefill_graphs needs cuda_graphs"):
        EngineConfig(cuda_graphs=False, prefill_graphs=True).resolve(cuda, 8)
    # greedy rounds as one graph: with the graphs and the fused kernels, unless switched off
    assert EngineConfig().resolve(cuda, 8, env={}).round_graphs is True
    assert EngineConfig().resolve(cpu, 8, env={}).round_graphs is False
    assert resolved.round_graphs is False  # reference kernels, no graphs
    assert EngineConfig().resolve(cuda, 8, env={"DELTAFLASH_NO_FUSED_KERNELS": "1"}).round_graphs is False
    assert EngineConfig().resolve(cuda, 8, env={"DELTAFLASH_NO_ROUND_GRAPHS": "1"}).round_graphs is False
    assert EngineConfig(round_graphs=False).resolve(cuda, 8, env={}).round_graphs is False
    with pytest.raises(DeltaflashError, match="round_graphs needs cuda_graphs and the fused kernels"):
        EngineConfig(round_graphs=True).resolve(cpu, 8)
    # trees or chains: by their measured costs, unless a fixed rule is given or ranks would part
    assert EngineConfig(tree_budget=8).resolve(cuda, 8, env={}).costed_trees
    assert not EngineConfig(tree_budget=8, tree_max_lanes=1).resolve(cuda, 8, env={}).costed_trees
    sharded = EngineConfig(tree_budget=8, tensor_parallel_size=2).resolve(cuda, 8, env={})
    assert (sharded.tree_max_lanes, sharded.costed_trees, sharded.widths) == (1, False, (1, 8))
    with pytest.raises(DeltaflashError, match="needs a drafter"):
        EngineConfig(block_size=4).resolve(cpu, None)
    with pytest.raises(DeltaflashError, match="max_slots"):
        EngineConfig(max_slots=0).resolve(cpu, None)


# ---- one host sync per round ---------------------------------------------------------------------
def speculative_rounds(engine, counter, out: dict, calls: list[str]) -> list[tuple[int, ...]]:
    """Step until the engine is idle, adding each request's tokens to out[request id]; every step whose
    round speculates (a lane wider than 1) makes exactly `calls` of the counter's calls. Returns the lane
    widths of those rounds."""
    widths = []
    while engine.has_work():
        counter.calls.clear()
        report = []
        for ev in engine.step(report.append):
            out[ev.request_id] += ev.token_ids
        if max(report[0].widths, default=1) > 1:
            widths.append(report[0].widths)
            assert counter.calls == calls
    return widths


class SyncCounter:
    """Counts calls that read a tensor's value on the host (each a device sync on a GPU)."""

    NAMES = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero")

    def __init__(self, monkeypatch):
        self.calls = []
        for name in self.NAMES:
            real = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._counting(name, real))

    def _counting(self, name, real):
        def counted(tensor, *args, **kwargs):
            self.calls.append(name)
            return real(tensor, *args, **kwargs)
        return counted


@pytest.mark.parametrize("name,tree_budget", [("dflash", 0), ("dflash2", 0), ("moe", 0), ("dflash", 12),
                                               ("dflash2", 12)])
def test_a_round_reads_the_device_once(pairs, name, tree_budget, monkeypatch):
    """Drafting (a chain or a tree), verify, acceptance of greedy and sampled lanes (top-k / top-p
    included), commit and the new draft context: one read of the results, whatever the lanes want."""
    target_dir, draft_dir = pairs[name]
    engine = engine_for(target_dir, draft_dir, tree_budget=tree_budget, tree_max_lanes=0)
    vocab = engine.cfg.vocab_size
    params = [GREEDY, SamplingParams(max_new_tokens=30, temperature=0.9, top_p=0.8, top_k=9, seed=3, ignore_eos=True),
              SamplingParams(max_new_tokens=30, temperature=1.2, seed=4, ignore_eos=True)]
    for p, sp in zip(prompts(vocab, [5, 9, 13], seed=1), params):
        engine.add_request(p, sp)
    while any(s.status is not Status.DECODING for s in engine.scheduler.running.values()) or engine.scheduler.waiting:
        engine.step()
    for _ in range(3):
        counter = SyncCounter(monkeypatch)
        events = engine.step()
        monkeypatch.undo()
        assert len(events) == 3 and counter.calls == ["tolist"]


def test_a_width_one_round_commits_with_its_verify_and_refuses_a_stale_lane_first(pairs, monkeypatch):
    """Plain decoding: a width-1 round commits inside its verify (ModelRunner.decode; the decode graph on
    CUDA), so the step reads the device once and commits nothing after the read; a lane whose slot does
    not hold the positions the round verifies from is refused before anything is written - state, conv
    history, K/V rows and lengths."""
    from deltaflash.errors import CommitRejectedError

    engine = engine_for(pairs["dflash"][0])
    runner, pool = engine.runner, engine.runner.pool
    for p in prompts(engine.cfg.vocab_size, [5, 9], seed=2):
        engine.add_request(p, GREEDY)
    while any(s.status is not Status.DECODING for s in engine.scheduler.running.values()) or engine.scheduler.waiting:
        engine.step()
    late = []
    monkeypatch.setattr(runner, "_commit", lambda *args, **kwargs: late.append(args))
    counter = SyncCounter(monkeypatch)
    events = engine.step()
    monkeypatch.undo()
    assert len(events) == 2 and counter.calls == ["tolist"] and late == []
    seqs = list(engine.scheduler.running.values())
    slots, stale = [s.slot for s in seqs], [s.position - 1 for s in seqs]  # one position behind the slots
    device = pool.recurrent_state.device
    before = [t.clone() for t in (pool.recurrent_state, pool.conv_history, pool.key_cache, pool.value_cache)]
    lengths = [pool.lengths[s] for s in slots]
    with pytest.raises(CommitRejectedError, match="committed positions"), torch.inference_mode():
        runner.decode(torch.tensor([[s.pending] for s in seqs], device=device), torch.tensor(slots, device=device),
                      torch.tensor(stale, device=device), slots, stale)
    after = (pool.recurrent_state, pool.conv_history, pool.key_cache, pool.value_cache)
    assert all(torch.equal(a, b) for a, b in zip(before, after)) and [pool.lengths[s] for s in slots] == lengths


def test_a_chain_round_commits_before_its_read_and_refuses_a_stale_lane_first(pairs, monkeypatch):
    """With the fused kernels, a speculative chain round launches its commit (state, conv history, draft
    context) behind the acceptance, before the step's one read, and records the lengths after it: nothing
    is launched after the read, and the tokens are target-only's. Lanes one position behind their slots
    are refused before the draft and verify write anything."""
    import deltaflash.engine.runner as runner_module
    from deltaflash.errors import CommitRejectedError

    target_dir, draft_dir = pairs["dflash"]
    plist, params = prompts(96, [5, 9], seed=4), SamplingParams(max_new_tokens=14, ignore_eos=True)
    expected = [c.token_ids for c in engine_for(target_dir).generate(plist, params)[0]]
    # (the reference commit needs the counts read; a round graph commits inside its one launch: its own test)
    engine = engine_for(target_dir, draft_dir, kernels="triton", round_graphs=False)
    runner, pool = engine.runner, engine.runner.pool
    ids = [engine.add_request(p, params) for p in plist]
    out = {i: [] for i in ids}
    counter = SyncCounter(monkeypatch)
    real_commit = runner_module.commit_unread_chains
    monkeypatch.setattr(runner_module, "commit_unread_chains",
                        lambda *a, **k: (counter.calls.append("commit"), real_commit(*a, **k))[1])
    monkeypatch.setattr(runner, "_commit", lambda *a, **k: counter.calls.append("late commit"))
    chain_rounds = len(speculative_rounds(engine, counter, out, ["commit", "tolist"]))
    monkeypatch.undo()
    assert chain_rounds >= 3 and [out[i] for i in ids] == expected  # committed before the read, yet the same tokens

    for p in plist:
        engine.add_request(p, params)
    while any(s.status is not Status.DECODING for s in engine.scheduler.running.values()) or engine.scheduler.waiting:
        engine.step()
    plan = engine.scheduler.schedule()
    assert plan.decode and plan.round_width > 1
    for seq in plan.decode:
        pool.lengths[seq.slot] += 1  # the lanes are one position behind their slots
    before = [t.clone() for t in (pool.recurrent_state, pool.conv_history, pool.key_cache, pool.value_cache)]
    lengths = list(pool.lengths)
    with pytest.raises(CommitRejectedError, match="committed positions"):
        runner.execute(plan)
    after = (pool.recurrent_state, pool.conv_history, pool.key_cache, pool.value_cache)
    assert all(torch.equal(a, b) for a, b in zip(before, after)) and list(pool.lengths) == lengths


@pytest.mark.parametrize("variant", ["dflash", "dflash2"])
def test_a_greedy_round_graph_drafts_verifies_accepts_and_commits_before_the_read(pairs, variant, monkeypatch):
    """round_graphs: the function a greedy round's graph captures (engine/runner.py: _greedy_round: the
    drafter's block, the verify, acceptance, the commit and the draft context), run eagerly in the graphs'
    place on the CPU, serves every speculative round of greedy lanes with one read and nothing launched
    after it, and gives target-only's tokens, with each lane's drafts capped by its width (a request's
    last tokens). A lane asking for logprobs takes the ordinary path."""
    import deltaflash.engine.runner as runner_module

    target_dir, draft_dir = pairs[variant]
    target_only = engine_for(target_dir)
    plist = prompts(target_only.cfg.vocab_size, [5, 9, 3], seed=6)
    # lengths of their own: lanes are capped to different widths near their ends whatever the drafts' acceptance
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (14, 11, 8)]
    expected = [c.token_ids for c in target_only.generate(plist, params)[0]]
    ordinary = [c.accepted_lengths for c in engine_for(target_dir, draft_dir, kernels="triton").generate(plist, params)[0]]
    engine = engine_for(target_dir, draft_dir, kernels="triton")
    runner = engine.runner
    graphs = {w: EagerGraph(functools.partial(runner._greedy_round, width=w)) for w in runner.widths[1:]}
    monkeypatch.setattr(runner, "round_graphs", graphs)
    ids = [engine.add_request(p, sp) for p, sp in zip(plist, params)]
    seqs = {s.request_id: s for s in engine.scheduler.waiting}
    out = {i: [] for i in ids}
    counter = SyncCounter(monkeypatch)
    monkeypatch.setattr(runner, "_commit", lambda *a, **k: counter.calls.append("late commit"))
    monkeypatch.setattr(runner_module, "commit_unread_chains", lambda *a, **k: counter.calls.append("eager commit"))
    widths = speculative_rounds(engine, counter, out, ["tolist"])
    rounds = len(widths)
    monkeypatch.undo()
    assert rounds >= 3 and sum(g.calls for g in graphs.values()) == rounds
    assert any(len(set(w)) > 1 for w in widths)  # lanes of one round capped to different widths
    assert [out[i] for i in ids] == expected
    # the drafts saw the same context as on the ordinary path (the round's draft context was appended)
    assert [seqs[i].accepted_lengths for i in ids] == ordinary

    engine.add_request(plist[0], SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=1))
    calls = sum(g.calls for g in graphs.values())
    while engine.has_work():
        engine.step()
    assert sum(g.calls for g in graphs.values()) == calls


def test_overlap_work_runs_between_the_launch_and_the_read(pairs, monkeypatch):
    """`step(overlap=...)` runs the caller's host work once per step while the device computes: after
    the step's device work is launched (the round's results exist on the device) and before their one
    read (nothing of the step applied yet). A request added there joins from the next step on; a step
    that runs nothing on the device runs it too; outputs are those of plain steps."""
    target_dir, draft_dir = pairs["dflash"]
    plist = prompts(96, [5, 9, 13], seed=2)
    expected = [c.token_ids for c in engine_for(target_dir, draft_dir).generate(plist, GREEDY)[0]]
    engine = engine_for(target_dir, draft_dir)
    ids = [engine.add_request(p, GREEDY) for p in plist[:2]]
    out = {i: [] for i in ids}
    seen = []  # per step: (reads of the device before the overlap, tokens generated so far, the engine's rounds)

    def overlap():
        seen.append((list(counter.calls), engine.stats["generated_tokens"], engine.stats["decode_rounds"]))
        if len(seen) == 3:  # mid-stream: the third request arrives
            ids.append(engine.add_request(plist[2], GREEDY))
            out[ids[-1]] = []

    steps = 0
    while engine.has_work():
        before = (engine.stats["generated_tokens"], engine.stats["decode_rounds"])
        counter = SyncCounter(monkeypatch)
        for ev in engine.step(overlap=overlap):
            out[ev.request_id] += ev.token_ids
        monkeypatch.undo()
        steps += 1
        assert len(seen) == steps  # once per step
        reads, generated, rounds = seen[-1]
        assert reads == [] and (generated, rounds) == before  # launched, not read, nothing applied
        if steps == 3:  # the request added in this step's overlap was not in its plan: it waits
            assert [s.request_id for s in engine.scheduler.waiting] == [ids[-1]]
    assert [out[i] for i in ids] == expected
    # a step that runs nothing on the device (only a cancellation) runs the overlap too
    rid = engine.add_request(plist[0], GREEDY)
    engine.abort(rid)
    calls = []
    events = engine.step(overlap=lambda: calls.append(1))
    assert calls == [1] and [(e.request_id, e.finish_reason) for e in events] == [(rid, "cancelled")]


# ---- cancellation at every stage ------------------------------------------------------------------
@pytest.mark.parametrize("stage", ["waiting", "prefilling", "speculating"])
def test_abort_at_every_stage_frees_everything_and_spares_the_others(pairs, stage):
    target_dir, _ = pairs["dflash"]
    plist = prompts(96, [6, 40, 9], seed=7)
    expected = [c.token_ids for c in engine_for(target_dir).generate(plist, GREEDY)[0]]
    scripts = {tuple(p): e for p, e in zip(plist, expected)}
    max_slots = 2 if stage == "waiting" else 3
    engine = engine_for(target_dir, draft_source=ScriptedSource(scripts, 5, 96, corrupt=0.1), max_slots=max_slots,
                        max_num_batched_tokens=8, idle_prefill_tokens=8)
    victim = {"waiting": 2, "prefilling": 1, "speculating": 0}[stage]
    ids = [engine.add_request(p, GREEDY) for p in plist]
    seen = {i: [] for i in ids}
    reasons = {}
    aborted = False
    while engine.has_work():
        seq = next((s for s in [*engine.scheduler.waiting, *engine.scheduler.running.values()]
                    if s.request_id == ids[victim]), None)
        ready = seq is not None and {"waiting": seq.status is Status.WAITING,
                                     "prefilling": seq.status is Status.PREFILLING and seq.num_prefilled > 0,
                                     "speculating": len(seq.accepted_lengths) >= 2}[stage]
        if ready and not aborted:
            engine.abort(ids[victim])
            aborted = True
        for ev in engine.step():
            seen[ev.request_id] += ev.token_ids
            if ev.finish_reason:
                reasons[ev.request_id] = ev.finish_reason
    assert aborted and reasons[ids[victim]] == "cancelled"
    for i, rid in enumerate(ids):
        if i != victim:
            assert seen[rid] == expected[i] and reasons[rid] == "length"
    assert engine.num_live == 0 and engine.scheduler.slots.num_free == max_slots


def test_reused_slots_start_clean_with_a_drafter(pairs):
    """A sequence admitted into a slot another sequence used gets the same tokens AND the same accepted
    lengths as on a fresh engine: a stale draft context would leave output unchanged but lower acceptance."""
    target_dir, draft_dir = pairs["dflash"]
    first, second = prompts(96, [30, 8], seed=11)
    fresh = engine_for(target_dir, draft_dir, max_slots=1).generate([second], GREEDY)[0][0]
    engine = engine_for(target_dir, draft_dir, max_slots=1)
    engine.generate([first], GREEDY)
    reused = engine.generate([second], GREEDY)[0][0]
    assert reused.token_ids == fresh.token_ids and reused.accepted_lengths == fresh.accepted_lengths
    scripted = ScriptedSource({tuple(second): fresh.token_ids}, 6, 96)
    engine = engine_for(target_dir, draft_source=scripted, max_slots=1)
    engine.generate([first], GREEDY)
    assert engine.generate([second], GREEDY)[0][0].accepted_lengths[0] == 6


def test_mixed_greedy_and_sampled_lanes_in_one_round(pairs):
    """Greedy lanes equal target-only greedy; a seeded sampled lane draws the same tokens whatever shares
    its rounds (its noise depends on its seed and step only)."""
    target_dir, draft_dir = pairs["dflash"]
    plist = prompts(96, [4, 11, 7, 15], seed=13)
    sampled = [SamplingParams(max_new_tokens=30, temperature=1.0, seed=21, ignore_eos=True),
               SamplingParams(max_new_tokens=30, temperature=0.7, top_k=12, seed=22, ignore_eos=True)]
    expected_greedy = [c.token_ids for c in engine_for(target_dir).generate(plist[:2], GREEDY)[0]]
    mixed, _ = run(engine_for(target_dir, draft_dir), plist, [GREEDY, GREEDY, *sampled])
    assert mixed[:2] == expected_greedy
    alone = [run(engine_for(target_dir, draft_dir), [p], sp)[0][0] for p, sp in zip(plist[2:], sampled)]
    assert mixed[2:] == alone
    assert mixed[2] != run(engine_for(target_dir, draft_dir), [plist[2]],
                           SamplingParams(max_new_tokens=30, temperature=1.0, seed=99, ignore_eos=True))[0][0]


def test_prompt_too_long_for_the_context_is_a_clear_error(pairs):
    from deltaflash.errors import RequestError

    engine = engine_for(pairs["dflash"][0], max_model_len=32)
    with pytest.raises(RequestError, match="exceeds the context length 32"):
        engine.add_request(list(range(30)), SamplingParams(max_new_tokens=5))


def test_prompt_tokens_are_checked_against_the_vocabulary(pairs):
    """An empty prompt, a token id outside 0..V-1 (either end) and ids that are not a flat list of integers
    are clear errors (the id named); ids of any integer type (numpy, a tensor's) are taken as Python ints."""
    import warnings

    import numpy as np

    from deltaflash.errors import RequestError

    engine = engine_for(pairs["dflash"][0], max_model_len=64)
    vocab = engine.cfg.vocab_size
    with pytest.raises(RequestError, match="at least one token"):
        engine.add_request([], SamplingParams(max_new_tokens=2))
    for bad in (vocab, -1):
        with pytest.raises(RequestError, match=f"prompt token id {bad} outside the vocabulary 0..{vocab - 1}"):
            engine.add_request([3, bad, 5], SamplingParams(max_new_tokens=2))
    assert not engine.has_work()
    ids = np.array([1, vocab - 1, 2])
    rid = engine.add_request(ids, SamplingParams(max_new_tokens=2))
    ids[0] = 7  # the caller's array is its own: the request keeps what it was given
    assert engine.scheduler.waiting[0].prompt_array.tolist() == [1, vocab - 1, 2]
    assert engine.scheduler.waiting[0].request_id == rid
    assert engine.scheduler.waiting[0].prompt_ids == [1, vocab - 1, 2]
    assert all(type(t) is int for t in engine.scheduler.waiting[0].prompt_ids)
    for ids in (torch.tensor([4, 5]), [np.int32(4), np.int64(5)]):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # (numpy 2 warns of a tensor's __array__, and will refuse it)
            engine.add_request(ids, SamplingParams(max_new_tokens=2))
        assert engine.scheduler.waiting[-1].prompt_ids == [4, 5]
    for bad in ([1.5, 2], ["3"], [[1, 2], [3]], [[1, 2]], [True, False], torch.tensor([1.5])):  # nothing queued
        with pytest.raises(RequestError, match="token ids"):
            engine.add_request(bad, SamplingParams(max_new_tokens=2))
    assert len(engine.scheduler.waiting) == 3


def test_a_target_without_attention_layers_serves():
    """Every layer Gated DeltaNet (a two-layer toy shape): no K/V bytes per page, so the page pool plans all
    its pages (the plan divided by zero) and stores nothing; greedy output alone equals output in a batch."""
    from deltaflash.engine.engine import Engine
    from deltaflash.models.random_init import random_model, toy_config

    model = random_model(toy_config(2), torch.float32, "cpu")
    assert not model.cfg.attn_layer_ids and len(model.cfg.gdn_layer_ids) == 2
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    engine = Engine(model, None, None, EngineConfig(max_slots=2, max_model_len=64, kernels="reference"))
    batched = [c.token_ids for c in engine.generate([[1, 2, 3], [4, 5]], params)[0]]
    alone = [engine.generate([p], params)[0][0].token_ids for p in ([1, 2, 3], [4, 5])]
    assert batched == alone and all(len(t) == 6 for t in batched)


# ---- the package's floors -------------------------------------------------------------------------
def import_graph() -> dict[str, set[str]]:
    """Module -> deltaflash modules it imports (anywhere in the module, function-level imports too)."""
    root = Path(__file__).parent.parent / "deltaflash"
    modules = {}
    for f in root.rglob("*.py"):
        name = ".".join(f.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__")
        modules[name] = f
    graph = defaultdict(set)
    for name, f in modules.items():
        for node in ast.walk(ast.parse(f.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def test_no_import_circles_and_low_floors_never_import_high_ones():
    graph = import_graph()
    state = {}

    def visit(module, path):
        state[module] = "open"
        for dep in graph[module]:
            assert state.get(dep) != "open", f"import circle: {' -> '.join(path + [dep])}"
            if dep not in state:
                visit(dep, path + [dep])
        state[module] = "done"

    for module in list(graph):
        if module not in state:
            visit(module, [module])
    high = ("deltaflash.engine", "deltaflash.speculative", "deltaflash.server", "deltaflash.bench",
            "deltaflash.cli", "deltaflash.train")
    for module, deps in graph.items():
        if module.startswith(("deltaflash.core", "deltaflash.ops", "deltaflash.cache", "deltaflash.models")):
            bad = [d for d in deps if d.startswith(high)]
            assert not bad, f"{module} imports {bad}"
        if module.startswith(("deltaflash.ops", "deltaflash.cache")):
            assert not [d for d in deps if d.startswith("deltaflash.models")], module
        if module.startswith("deltaflash.core"):
            assert all(d.startswith(("deltaflash.core", "deltaflash.errors")) for d in deps), module
