"""Paged K/V through the engine (CPU): pages smaller than a verify block and than a prefill chunk, pools
too small for every sequence at once (queueing, preemption and exact resumption), pages given back on
every way out, a pool sized by memory and max_model_len fitted to it."""

import json
import subprocess
import sys

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction

from deltaflash.cache.pages import BlockTables, PageAllocator
from deltaflash.core.request import SamplingParams
from deltaflash.errors import DeltaflashError, PagesExhaustedError, RequestError
from deltaflash.ops.attention.paged import paged_attention_kernel
from deltaflash.speculative.sources import ScriptedSource
from tests.spec_pairs import DEVICE, assert_greedy_equal, engine_for, make_pair, prompts, run_cancelling

BLOCK = 6


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("pages"), block_size=BLOCK)


def greedy(engine, batch, new=24):
    done, _ = engine.generate(batch, SamplingParams(max_new_tokens=new, ignore_eos=True))
    return [c.token_ids for c in done]


def all_free(engine) -> bool:
    pages = engine.scheduler.pages
    return pages.num_free == pages.num_pages and engine.scheduler.slots.num_free == engine.config.max_slots


def page_bytes(target, draft=None, **config) -> int:
    """Bytes of one page (target K/V, and the drafter's context with a drafter) for these settings."""
    return engine_for(target, draft, max_slots=1, max_model_len=64, **config).runner.page_plan.page_bytes


def test_allocator_takes_and_gives_back_pages():
    pages = PageAllocator(num_pages=5, page_size=4, num_slots=2)
    assert pages.missing(0, 9) == 3 and pages.grow(0, 9) == [(0, 0, 0), (0, 1, 1), (0, 2, 2)]
    assert pages.grow(0, 12) == [] and pages.missing(1, 1) == 1 and pages.num_free == 2
    with pytest.raises(PagesExhaustedError, match="needs 3 more pages"):
        pages.grow(1, 12)
    assert pages.num_free == 2 and pages.held[1] == []  # nothing taken by the refused call
    assert pages.release(0) == 3 and pages.num_free == 5
    assert [page for _, _, page in pages.grow(1, 20)] == [0, 1, 2, 3, 4]  # given-back pages first, then fresh
    assert pages.release(1) == 5 and pages.grow(0, 5) == [(0, 0, 0), (0, 1, 1)]  # the last given back first
    assert pages.grow(1, 4) == [(1, 0, 2)] and pages.num_free == 2 and pages.held == [[0, 1], [2]]


def test_block_tables_release_then_grant_in_one_update():
    tables = BlockTables(3, 16, 4, DEVICE, num_pages=12)
    sink = tables.sink_page
    tables.map([(0, 0, 5), (0, 1, 6), (1, 0, 7), (1, 3, 2)])
    # slot 0 released and granted again in the same plan (a retired sequence's slot reused): sink first
    tables.update([0, 2], [(0, 1, 9), (2, 0, 11), (2, 2, 3)])
    want = torch.full((4, 4), sink, dtype=torch.int32)
    want[0, 1], want[1, 0], want[1, 3], want[2, 0], want[2, 2] = 9, 7, 2, 11, 3
    assert torch.equal(tables.tables.cpu(), want)
    tables.update([], [])  # nothing to do: no transfer
    tables.unmap([1])
    want[1] = sink
    assert torch.equal(tables.tables.cpu(), want)
    with pytest.raises(ValueError, match="static"):
        BlockTables(2, 16, 4, DEVICE).map([(0, 0, 1)])


def test_pages_smaller_than_the_block_and_the_prefill_chunk_keep_greedy_exact(pair):
    """Pages of 4 positions: every verify block of 6 rows and every prefill chunk of 5 tokens crosses
    page boundaries; speculative and target-only greedy equal the output with pages of 64."""
    batch = prompts(96, [3, 11, 17, 8], seed=2)
    wide = greedy(engine_for(pair[0], page_size=64, max_model_len=128), batch)
    small_plain = greedy(engine_for(pair[0], page_size=4, max_num_batched_tokens=5, idle_prefill_tokens=5, max_model_len=128), batch)
    spec = engine_for(*pair, page_size=4, max_num_batched_tokens=5, idle_prefill_tokens=5, max_model_len=128)
    assert greedy(spec, batch) == small_plain == wide
    # drafts that are all right (the greedy continuation, one in four corrupted): blocks of accepted rows
    # are committed across page boundaries
    source = ScriptedSource({tuple(p): out for p, out in zip(batch, wide)}, BLOCK, 96, corrupt=0.25, seed=1)
    scripted = engine_for(pair[0], draft_source=source, page_size=4, max_num_batched_tokens=5, idle_prefill_tokens=5, max_model_len=128)
    done, _ = scripted.generate(batch, SamplingParams(max_new_tokens=24, ignore_eos=True))
    assert [c.token_ids for c in done] == wide
    accepted = [n for c in done for n in c.accepted_lengths]
    assert sum(accepted) / len(accepted) > 2
    assert all_free(spec) and all_free(scripted)


@pytest.mark.parametrize("speculative", [True, False], ids=["spec", "target-only"])
def test_preempted_sequences_resume_exactly(pair, speculative):
    """A pool of 26 pages of 4 positions for 4 sequences that each end at 14 pages: the newest ones are
    preempted as the others grow, recomputed when readmitted, and every output equals the output of an
    engine with room for all."""
    draft = pair[1] if speculative else None
    batch = prompts(96, [10, 7, 12, 9], seed=4)
    config = dict(max_slots=4, max_model_len=64, page_size=4)
    roomy = greedy(engine_for(pair[0], draft, **config), batch, new=40)
    tight = engine_for(pair[0], draft, kv_cache_memory=26 * page_bytes(pair[0], draft, page_size=4), **config)
    assert tight.runner.page_plan.num_pages == 26
    assert_greedy_equal(pair[0], batch, greedy(tight, batch, new=40), roomy)
    assert tight.stats["preemptions"] > 0 and all_free(tight)


def test_requests_beyond_the_pool_wait_for_pages(pair):
    """Eight sequences whose prompts alone need more pages than the pool has queue for pages (free slots
    notwithstanding) and all complete, in the same outputs as with room for all."""
    batch = prompts(96, [30] * 8, seed=6)
    config = dict(max_slots=8, max_model_len=64, page_size=8)
    tight = engine_for(pair[0], kv_cache_memory=20 * page_bytes(pair[0], page_size=8), **config)
    for prompt in batch:
        tight.add_request(prompt, SamplingParams(max_new_tokens=8, ignore_eos=True))
    tight.step()
    assert tight.num_live < 8 and len(tight.scheduler.waiting) > 0  # 4 pages per prompt: at most 5 admitted
    while tight.has_work():
        tight.step()
    assert_greedy_equal(pair[0], batch, greedy(tight, batch, new=8), greedy(engine_for(pair[0], **config), batch, new=8))
    assert all_free(tight)


def test_500_requests_retired_cancelled_or_preempted_give_every_page_back(pair):
    engine = engine_for(pair[0], max_slots=6, max_model_len=48, page_size=4,
                        kv_cache_memory=16 * page_bytes(pair[0], page_size=4))
    g = torch.Generator().manual_seed(0)
    ids = []
    for i in range(500):
        prompt = torch.randint(0, 96, (int(torch.randint(1, 20, (), generator=g)),), generator=g).tolist()
        ids.append(engine.add_request(prompt, SamplingParams(max_new_tokens=int(torch.randint(1, 24, (), generator=g)),
                                                             ignore_eos=True)))
    run_cancelling(engine, ids, every=3)
    assert engine.stats["preemptions"] > 0
    assert all_free(engine)


def test_pool_sized_by_memory_and_max_model_len_fitted_to_it(pair, caplog):
    per_page = page_bytes(pair[0])
    engine = engine_for(pair[0], max_slots=2, max_model_len=None, kv_cache_memory=10 * per_page)
    plan = engine.runner.page_plan
    assert (plan.num_pages, plan.page_size) == (10, 16)
    assert engine.config.max_model_len == 10 * 16 - 1  # the model's own lowered: 160 positions less one row
    assert "sequences fit at the full context" in plan.describe(engine.config.max_model_len, 1)
    with pytest.raises(RequestError, match="longer than the whole K/V page pool"):
        engine.add_request([1] * 161, SamplingParams(max_new_tokens=1))
    with pytest.raises(DeltaflashError, match="does not fit the K/V page pool"):
        engine_for(pair[0], max_slots=2, max_model_len=1000, kv_cache_memory=10 * per_page)
    roomy = engine_for(pair[0], max_slots=3, max_model_len=100, page_size=4)  # the 2 GiB default: capped
    assert roomy.runner.page_plan.capped and roomy.runner.page_plan.num_pages == 3 * 26  # ceil((100 + 1) / 4)


def test_cli_reports_a_pool_too_small_in_one_line(pair):
    cmd = [sys.executable, "-m", "deltaflash", "generate", "--model", str(pair[0]), "--prompt-ids", "1,2,3",
           "--device", "cpu", "--max-model-len", "5000", "--kv-cache-memory", "64KiB", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "does not fit the K/V page pool" in out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    bad = subprocess.run(cmd[:-5] + ["--kv-cache-memory", "lots"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "is not a size" in bad.stderr
    ok = subprocess.run(cmd[:-5] + ["--max-new-tokens", "4", "--page-size", "4", "--kv-cache-memory", "1MiB",
                                    "--json"], capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr
    assert len(json.loads(ok.stdout)["token_ids"]) == 4


@pytest.mark.slow
@pytest.mark.skipif(DEVICE == "cpu" and not isinstance(paged_attention_kernel, InterpretedFunction),
                    reason="the Triton route on CPU needs TRITON_INTERPRET=1 before import")
def test_triton_route_through_the_engine_equals_the_reference(pair):
    """The fused kernel set (paged attention, verify route, commits, norms; interpreted on CPU) drives the
    engine over pages of 4 positions: a prefill of ragged prompts in one forward, speculative rounds with
    accepted drafts and target-only decoding give the reference route's greedy output, and the log
    probabilities of every token agree to rounding (greedy tokens alone let a wrong kernel pass: a
    perturbed distribution usually keeps its argmax)."""
    batch = prompts(96, [5, 9, 3], seed=1)
    config = dict(max_slots=3, max_model_len=48, page_size=4)
    params = SamplingParams(max_new_tokens=10, ignore_eos=True, logprobs=2)
    reference, _ = engine_for(pair[0], kernels="reference", **config).generate(batch, params)
    want = [c.token_ids for c in reference]
    source = ScriptedSource({tuple(p): out for p, out in zip(batch, want)}, BLOCK, 96, corrupt=0.2, seed=3)
    for draft_source in (None, source):
        engine = engine_for(pair[0], kernels="triton", draft_source=draft_source, **config)
        done, _ = engine.generate(batch, params)
        assert [c.token_ids for c in done] == want
        for got, ref in zip(done, reference):
            for a, b in zip(got.logprobs, ref.logprobs):
                assert [t for t, _ in a.top] == [t for t, _ in b.top]
                assert max(abs(x - y) for (_, x), (_, y) in zip(a.top, b.top)) < 1e-4
        if draft_source is not None:
            assert max(n for c in done for n in c.accepted_lengths) > 2


def test_every_row_a_round_writes_lands_in_its_own_pages(pair):
    """Two slots reused by six sequences of different lengths, rounds where some lanes verify fewer rows
    than the block: whenever the runner executes a plan, each slot's table maps exactly the pages it holds
    (the rest point at the sink, so a stale entry of a reused slot reaches nobody's page) and those pages
    cover every position the round writes for its lanes; outputs equal solo runs."""
    batch = prompts(96, [4, 9, 2, 7, 5, 3], seed=8)
    news = [3, 17, 5, 11, 2, 9]
    solo = [greedy(engine_for(pair[0], max_slots=1, max_model_len=64, page_size=2), [p], new=n)[0]
            for p, n in zip(batch, news)]
    source = ScriptedSource({tuple(p): out for p, out in zip(batch, solo)}, BLOCK, 96, corrupt=0.1, seed=2)
    engine = engine_for(pair[0], draft_source=source, max_slots=2, max_model_len=64, page_size=2)
    execute, checked = engine.runner.execute, []

    def checking(plan, *args, **kwargs):
        engine.runner.map_pages(plan)
        tables, pages = engine.pool.tables.tables.cpu(), engine.scheduler.pages
        for slot in range(engine.config.max_slots):
            held = pages.held[slot]
            assert tables[slot, :len(held)].tolist() == held
            assert (tables[slot, len(held):] == engine.pool.tables.sink_page).all()
        reach = engine.scheduler.reach(plan.round_width) if plan.decode else 0
        for seq in plan.decode:
            assert len(pages.held[seq.slot]) * 2 >= seq.position + reach
        checked.append(len(plan.decode))
        return execute(plan, *args, **kwargs)

    engine.runner.execute = checking
    done, _ = engine.generate(batch, [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in news])
    assert [c.token_ids for c in done] == solo
    assert max(checked) == 2 and all_free(engine)


def test_metrics_count_preemptions_and_page_usage(pair):
    """A server's /metrics: preemptions of a tight pool counted, page usage reported (the worker's metrics)."""
    from prometheus_client.parser import text_string_to_metric_families

    from deltaflash.server.metrics import Metrics

    metrics = Metrics(BLOCK)
    engine = engine_for(pair[0], max_slots=4, max_model_len=64, page_size=4,
                        kv_cache_memory=26 * page_bytes(pair[0], page_size=4))
    usage = []
    for prompt in prompts(96, [10, 7, 12, 9], seed=4):
        engine.add_request(prompt, SamplingParams(max_new_tokens=40, ignore_eos=True))
    while engine.has_work():
        engine.step(on_report=lambda report: (metrics.observe_step(report), usage.append(report.pages_used)))
    values = {s.name: s.value for f in text_string_to_metric_families(metrics.render().decode()) for s in f.samples}
    assert values["deltaflash_preemptions_total"] == engine.stats["preemptions"] > 0
    assert max(usage) > 20 and values["deltaflash_kv_cache_usage_ratio"] == usage[-1] / 26  # the last step's
    assert values["deltaflash_prefill_tokens_per_step_sum"] == engine.stats["prefill_tokens"]
    assert values["deltaflash_prefill_budget_tokens_count"] == values["deltaflash_prefill_tokens_per_step_count"] > 0
    assert values["deltaflash_prefill_budget_tokens_sum"] >= engine.stats["prefill_tokens"]
