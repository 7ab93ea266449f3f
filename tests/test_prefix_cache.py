"""The prefix cache (engine/prefix_cache.py), on the CPU: a prompt that begins with a kept prompt starts from its
saved state and prefills only the rest, with the outputs of an engine without the cache (greedy and seeded
sampling, speculative and target-only, kept prompts ending inside a page); least recently used entries go
first, for a row or for pages; scored prompts do not use it; prompts sharing a long beginning meet at a branch
point kept on the way; preemption and cancellation leave no page held but the cache's, and clearing it gives every
page back."""

import numpy as np
import pytest
import torch

from deltaflash.cache.pages import PageAllocator
from deltaflash.core.request import SamplingParams
from deltaflash.engine import prefix_cache
from deltaflash.engine.config import EngineConfig
from deltaflash.engine.engine import Engine
from deltaflash.engine.prefix_cache import PrefixCache
from deltaflash.errors import DeltaflashError
from deltaflash.speculative.sources import ScriptedSource
from tests.spec_pairs import engine_for, make_pair, prompts, run_cancelling
from tests.test_pages import page_bytes

VOCAB = 96


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("prefix"), block_size=6)


def params(i: int, new: int = 12, **extra) -> SamplingParams:
    """Greedy for odd i, else seeded sampling."""
    return SamplingParams(max_new_tokens=new, ignore_eos=True, temperature=0.0 if i % 2 else 1.0, seed=i, **extra)


def one_by_one(engine, batch, new: int = 12, **extra):
    """Each prompt run to completion before the next (so later ones find the earlier ones kept)."""
    return [engine.generate([p], params(i, new, **extra))[0][0] for i, p in enumerate(batch)]


def drained(engine) -> bool:
    """No page held by anybody once the prefix cache is cleared (and no sequence held one before)."""
    assert engine.page_usage[0] == 0  # (pages only the cache holds are not in use)
    engine.scheduler.clear_prefix_cache()
    s = engine.scheduler
    return not s._saves and s.pages.num_free == s.pages.num_pages and not s.pages._extra.any() and not s.pages._kept.any() \
        and s.pages.num_kept_only == 0 and s.slots.num_free == engine.config.max_slots


def check_pages_in_use(engine) -> None:
    """The pages in use (Engine.page_usage) are those the slots hold; the others taken are the kept prompts'."""
    pages = engine.scheduler.pages
    by_slots = set().union(*pages.held)
    kept = set().union(*(e.pages for e in engine.scheduler.prefix.entries))
    assert engine.page_usage[0] == len(by_slots) and pages.num_used == len(by_slots | kept)


@pytest.mark.parametrize("speculative", [True, False], ids=["spec", "target-only"])
def test_prompts_that_begin_with_a_kept_prompt_prefill_only_the_rest(pair, speculative):
    draft = pair[1] if speculative else None
    a, b, c = prompts(VOCAB, [100, 37, 20], seed=3)
    turns = [a, a + b, a + b + c, a + c, a]  # the last: a kept prompt again, nothing after it (prefilled again)
    config = dict(page_size=16, max_num_batched_tokens=48, idle_prefill_tokens=48)
    cached = engine_for(pair[0], draft, **config)
    got = [x.token_ids for x in one_by_one(cached, turns)]
    want = [x.token_ids for x in one_by_one(engine_for(pair[0], draft, prefix_cache=0, **config), turns)]
    assert got == want
    assert cached.stats["cached_prompt_tokens"] == 100 + 137 + 100
    assert cached.stats["prefill_tokens"] == 100 + 37 + 20 + 20 + 100
    assert kept_lengths(cached, turns) == [100, 120, 137, 157] and drained(cached)  # a, a+c, a+b, a+b+c


@pytest.mark.parametrize("drafts, stop", [("scripted", None), ("scripted", "last"), ("scripted", "inside"),
                                          ("target-only", "inside"), ("dflash", None)],
                         ids=["rounds-end-on-the-answer", "stop-on-the-last-draft", "stop-inside-a-round",
                              "target-only", "dflash"])
def test_a_next_turn_sending_the_answer_back_starts_after_it(pair, drafts, stop):
    """Turns that carry the previous answer back (prompt, answer, a new message), one by one: a finished sequence's
    state is kept, so the next turn prefills only its new message. The scripted drafts are the target's own greedy
    text, accepted whole: rounds of 6 tokens (5 drafts, the bonus token) after the first token, so 19 new tokens
    end on a round (the state holds the answer but its last token, never fed). A stop token at index `stop` cuts
    the third round (indices 13-18): on its last draft (17) only the bonus token is dropped and the state holds the
    whole answer, its stop token too; inside it (13-16), the state went on past the answer - not kept, the next turn
    starts from the previous prompt. The slot is taken again at once (the state is saved before its reset).
    Outputs equal target-only without the cache. (The random drafter accepts nothing: that the drafter's context of
    the answer comes with the kept state is the demo pair's test below.)"""
    a, b, c = prompts(VOCAB, [100, 30, 20], seed=5)
    plain = engine_for(pair[0], max_model_len=512, prefix_cache=0)
    turns, scripts, sampling = [a], {}, []
    for message in (b, c, None):
        script = plain.generate([turns[-1]], SamplingParams(max_new_tokens=27, ignore_eos=True, temperature=0.0))
        scripts[tuple(turns[-1])] = script = script[0][0].token_ids
        first = [i for i in range(13, 18) if script[i] not in script[:i]]  # where a stop token would first be met
        end = {None: 19, "last": 18, "inside": first[0] + 1}[stop]
        assert (stop != "last" or 17 in first) and first[0] < 17  # (the seed's)
        sampling.append(SamplingParams(max_new_tokens=19, ignore_eos=True, temperature=0.0,
                                       stop_token_ids=() if stop is None else (script[end - 1],)))
        if message is not None:
            turns.append(turns[-1] + script[:end] + message)
    source = ScriptedSource(scripts, 6, VOCAB) if drafts == "scripted" else None
    draft = pair[1] if drafts == "dflash" else None
    engine = engine_for(pair[0], draft, draft_source=source, max_model_len=512)
    got = [engine.generate([t], s)[0][0] for t, s in zip(turns, sampling)]
    assert [g.token_ids for g in got] == [plain.generate([t], s)[0][0].token_ids for t, s in zip(turns, sampling)]
    if source is not None:
        assert all(g.accepted_lengths[:2] == [6, 6] for g in got)
    held = {None: -1, "last": 0, "inside": None}[stop] if source is not None else -1  # answer tokens it misses
    starts = [len(t) + (len(g.token_ids) + held if held is not None else 0) for t, g in zip(turns, got)][:2]
    assert engine.stats["cached_prompt_tokens"] == sum(starts)
    assert engine.stats["prefill_tokens"] == sum(len(t) for t in turns) - sum(starts)
    assert drained(engine)


def test_the_demo_drafter_drafts_after_a_kept_answer_as_after_a_prefill():
    """The bundled demo pair (its drafter accepts): a second turn that sends the first's answer back starts from the
    answer's kept state, with the drafter's context of the answer from the rounds that made it - and drafts as an
    engine that prefilled the whole turn does: the same tokens and the same accepted lengths."""
    from deltaflash.bundled import BUNDLED
    from deltaflash.tokenizer import encode_prompt
    from deltaflash.train.corpus import heldout_prompts, load_split

    first, message = heldout_prompts(load_split(), 2, num_lines=8)
    engines = [Engine.from_pretrained(BUNDLED / "target", BUNDLED / "draft", device="cpu", progress=False,
                                      speculation="fixed", prefix_cache=rows) for rows in (None, 0)]
    greedy = SamplingParams(max_new_tokens=48)
    turn = encode_prompt(engines[0].tokenizer, first)
    answer = engines[0].generate([turn], greedy)[0][0].token_ids
    second = turn + answer + encode_prompt(engines[0].tokenizer, message)
    got, want = (e.generate([second], greedy)[0][0] for e in engines)
    assert engines[0].stats["cached_prompt_tokens"] == len(turn) + len(answer) - 1
    assert max(want.accepted_lengths) > 1 and got.token_ids == want.token_ids
    assert got.accepted_lengths == want.accepted_lengths


def kept_lengths(engine, answered=(), new: int = 12) -> list[int]:
    """The lengths of the kept entries but the finished states of the `answered` prompts (each prompt and its
    `new` tokens but the last: kept too, where a next turn could send the answer back)."""
    answers = {len(p) + new - 1 for p in answered}
    return sorted(len(e.tokens) for e in engine.scheduler.prefix.entries if len(e.tokens) not in answers)


@pytest.mark.parametrize("speculative", [True, False], ids=["spec", "target-only"])
def test_prompts_sharing_a_beginning_meet_at_its_branch_point(pair, speculative):
    """Questions after one 300-token system prompt, one by one: the first is kept whole; the second shares 300
    tokens with it, so its prefill stops at 256 (a multiple of BRANCH_ALIGN) and the state there is kept; the
    next ones start from it. A 400-token prompt sent again branches short of its last token (at 384), and a
    third time starts there. Outputs equal an engine without the cache."""
    assert (prefix_cache.BRANCH_MIN_TOKENS, prefix_cache.BRANCH_ALIGN) == (256, 64)  # (the counts below)
    draft = pair[1] if speculative else None
    system, *rest = prompts(VOCAB, [300, 20, 30, 25, 400], seed=13)
    turns = [system + q for q in rest[:3]] + [rest[3]] * 3
    config = dict(max_model_len=512, max_num_batched_tokens=512, idle_prefill_tokens=512)
    cached = engine_for(pair[0], draft, prefix_cache=16, **config)
    got = [x.token_ids for x in one_by_one(cached, turns)]
    want = [x.token_ids for x in one_by_one(engine_for(pair[0], draft, prefix_cache=0, **config), turns)]
    assert got == want
    assert kept_lengths(cached, turns) == [256, 320, 325, 330, 384, 400]
    assert cached.stats["cached_prompt_tokens"] == 256 + 384
    assert cached.stats["prefill_tokens"] == 320 + 330 + (325 - 256) + 400 + 400 + (400 - 384)
    assert drained(cached)


@pytest.mark.parametrize("speculative", [True, False], ids=["spec", "target-only"])
def test_a_burst_of_prompts_sharing_a_beginning_prefills_it_once(pair, speculative):
    """Four questions after one 300-token system prompt added at once, nothing kept yet: the first prompt's prefill
    stops at 256 for the others, which wait for that state and start from it (in one step together). A fifth, on
    another beginning, does not wait with them: it starts in the first step. Outputs equal an engine without the
    cache."""
    draft = pair[1] if speculative else None
    system, *rest = prompts(VOCAB, [300, 20, 30, 25, 40, 290], seed=16)
    batch = [system + q for q in rest[:4]] + [rest[4]]
    config = dict(max_model_len=512, max_num_batched_tokens=512, idle_prefill_tokens=512)
    cached, plain = engine_for(pair[0], draft, prefix_cache=16, **config), engine_for(pair[0], draft, prefix_cache=0,
                                                                                     **config)
    sampling = [params(i) for i in range(len(batch))]
    assert [c.token_ids for c in cached.generate(batch, sampling)[0]] == \
        [c.token_ids for c in plain.generate(batch, sampling)[0]]
    assert cached.stats["cached_prompt_tokens"] == 3 * 256
    assert cached.stats["prefill_tokens"] == sum(len(p) for p in batch) - 3 * 256
    assert kept_lengths(cached, batch) == sorted([256, 290] + [len(p) for p in batch[:4]]) and drained(cached)


def test_requests_behind_a_burst_do_not_wait_for_its_branch_point(pair):
    """Three questions after one system prompt, then another prompt twice (its samples) and a third prompt, added
    at once: the second and third questions wait for the first's prefill to reach the branch point; the requests
    behind them start in the first step, and the other prompt's second request forks from the first when its
    prefill is done, though the questions are ahead of it in the queue. Outputs equal an engine without the cache."""
    system, *rest = prompts(VOCAB, [300, 20, 30, 25, 60, 100], seed=23)
    batch = [system + q for q in rest[:3]] + [rest[3], rest[3], rest[4]]
    config = dict(max_model_len=512, max_num_batched_tokens=512, idle_prefill_tokens=512)
    cached, plain = engine_for(pair[0], **config), engine_for(pair[0], prefix_cache=0, **config)
    sampling = [params(i) for i in range(len(batch))]
    ids = [cached.add_request(p, s) for p, s in zip(batch, sampling)]
    got, step = {i: [] for i in ids}, 0
    while cached.has_work():
        for event in cached.step():
            got[event.request_id].extend(event.token_ids)
        step += 1
        if step == 1:
            running, waiting = cached.scheduler.running, [s.request_id for s in cached.scheduler.waiting]
            assert ids[0] in running and waiting == ids[1:3] and all(i in running for i in ids[3:])
    assert [got[i] for i in ids] == [c.token_ids for c in plain.generate(batch, sampling)[0]]
    assert cached.stats["prefill_tokens"] == sum(len(p) for p in batch) - 2 * 256 - 60  # (two restored, a fork)
    assert drained(cached)


def test_a_branch_point_is_made_once_and_only_where_it_pays():
    """The cache's lookups by block keys (blocks of 64 tokens) and its branch points."""
    cache = PrefixCache(rows=4)
    a = np.arange(300, dtype=np.int64)
    cache.add(a, [])
    b = np.concatenate([a[:290], np.full(20, 999)])
    kept, shared = cache.match(b)
    assert kept is None and shared == 256 and cache.branch_point(shared, 0, len(b)) == 256  # 4 whole blocks shared
    cache.add(b[:256], [])
    kept, shared = cache.match(b)
    assert len(kept.tokens) == 256 and shared == 256 and cache.branch_point(shared, 256, len(b)) == 0
    assert cache.match(a)[0] is kept and cache.match(a[:256])[0] is None  # (not past it: one token is left to prefill)
    assert cache.match(np.concatenate([a[:200], np.full(100, 555)])) == (None, 192)
    assert cache.match(a[:63]) == (None, 0) and cache.match(a[1:]) == (None, 0)
    assert cache.branch_point(255, 0, 400) == 0 and cache.branch_point(256, 0, 400) == 256  # too few tokens skipped
    assert cache.branch_point(384, 0, 384) == 320  # an exact repeat: short of the last token
    assert cache.branch_point(1024, 320, 700) == 640 and cache.branch_point(575, 320, 700) == 0
    assert cache.kept(b[:256]) is kept and cache.kept(b[:257]) is None and cache.kept(a) is not None
    assert cache.keys(a, cache.keys(a[:150])) == cache.keys(a) and cache.keys(a, cache.keys(a[:64])) == cache.keys(a)
    assert cache.evict(keep=cache.kept(a)) is kept  # the least recently used but the one kept
    assert cache.match(b) == (None, 256) and cache.kept(b[:256]) is None
    cache.evict()
    assert cache.match(b) == (None, 0) and not cache._blocks and not cache._ends


def test_a_beginning_counts_as_used_with_the_prompts_kept_beyond_it():
    """Touching or keeping a prompt touches the kept prompts it begins with (just before it): a system prompt's
    branch point outlives the questions kept after it; a question goes least recently used first."""
    cache = PrefixCache(rows=4)
    system = np.arange(256, dtype=np.int64)
    questions = [np.concatenate([system, np.full(70, 1000 + i)]) for i in range(3)]
    beginning = cache.add(system, [])
    first, second = cache.add(questions[0], []), cache.add(questions[1], [])
    other = cache.add(np.arange(5000, 5100, dtype=np.int64), [])
    assert cache.entries == [first, beginning, second, other]
    cache.touch(first)
    assert cache.entries == [second, other, beginning, first]
    assert cache.evict() is second and cache.evict() is other and cache.add(questions[2], []) is not None
    assert cache.entries == [first, beginning, cache.kept(questions[2])]
    assert cache.evict() is first and cache.evict() is beginning


def test_a_burst_keeps_its_branch_point_with_few_rows(pair):
    """Three rows, four questions after one system prompt at once: their prompts, kept as they complete, evict
    one another, not the branch point they all began from; a fifth question later starts there."""
    system, *rest = prompts(VOCAB, [300, 20, 30, 25, 40, 35], seed=21)
    config = dict(max_model_len=512, max_num_batched_tokens=512, idle_prefill_tokens=512, prefix_cache=3)
    engine = engine_for(pair[0], **config)
    engine.generate([system + q for q in rest[:4]], [params(i) for i in range(4)])
    assert engine.stats["cached_prompt_tokens"] == 3 * 256 and 256 in kept_lengths(engine)
    one_by_one(engine, [system + rest[4]])
    assert engine.stats["cached_prompt_tokens"] == 4 * 256 and drained(engine)


def test_pages_only_kept_prompts_hold_are_not_in_use():
    pages = PageAllocator(8, 4, 2)
    pages.grow(0, 12)  # pages 0, 1, 2
    pages.keep([0, 1])
    assert (pages.num_used, pages.num_in_use) == (3, 3)
    assert pages.release(0) == 1 and (pages.num_used, pages.num_in_use) == (2, 0)
    pages.adopt(1, [0])  # a restore
    pages.keep([0, 1])  # a second kept prompt on the same pages
    assert (pages.num_used, pages.num_in_use) == (2, 1)
    assert pages.unkeep([0, 1]) == 0 and (pages.num_used, pages.num_in_use) == (2, 1)
    assert pages.release(1) == 0 and (pages.num_used, pages.num_in_use) == (2, 0)
    assert pages.unkeep([0, 1]) == 2 and pages.num_free == 8 and pages.num_kept_only == 0
    assert not pages._extra.any() and not pages._kept.any() and pages._num_extra == 0


def small_branch_points(monkeypatch) -> list[int]:
    """Branch points every 4 tokens past 8, so small prompts make them; returns the branch points admitted
    sequences are given from then on, as the scheduler decides them."""
    monkeypatch.setattr(prefix_cache, "BRANCH_MIN_TOKENS", 8)
    monkeypatch.setattr(prefix_cache, "BRANCH_ALIGN", 4)
    made = []
    branch_point = PrefixCache.branch_point

    def spy(cache: PrefixCache, shared: int, start: int, total: int) -> int:
        point = branch_point(cache, shared, start, total)
        made.extend([point] if point else [])
        return point
    monkeypatch.setattr(PrefixCache, "branch_point", spy)
    return made


def test_many_prompts_on_a_few_beginnings_meet_at_branch_points(pair, monkeypatch):
    """Prompts on three roots added at once, then again in reverse: the later ones of the first wave part from
    the earlier ones' kept prompts and branch there, prefills cut at the budget and at branch points alike, and
    the second wave starts from those points. Outputs equal an engine without the cache."""
    made = small_branch_points(monkeypatch)
    page = page_bytes(pair[0], page_size=4)
    config = dict(max_slots=4, max_model_len=160, page_size=4, max_num_batched_tokens=32, kv_cache_memory=115 * page)
    roots = prompts(VOCAB, [64, 70, 90], seed=14)
    tails = prompts(VOCAB, [1, 5, 9, 13, 2, 6, 10, 3], seed=15)
    batch = [roots[i % 3] + t for i, t in enumerate(tails)]
    engine, plain = engine_for(pair[0], prefix_cache=8, **config), engine_for(pair[0], prefix_cache=0, **config)
    sampling = SamplingParams(max_new_tokens=24, ignore_eos=True)
    for wave in (batch, batch[::-1]):
        got = [c.token_ids for c in engine.generate(wave, sampling)[0]]
        assert got == [c.token_ids for c in plain.generate(wave, sampling)[0]]
    kept = kept_lengths(engine)
    assert made and set(made) & set(kept) and engine.stats["cached_prompt_tokens"] > 0 and drained(engine)


def test_the_least_recently_used_prompt_goes_first(pair):
    a, b, x = prompts(VOCAB, [70, 80, 5], seed=4)
    engine = engine_for(pair[0], prefix_cache=2)  # (one new token: no finished state to keep)
    one_by_one(engine, [a, b], new=1)
    one_by_one(engine, [a + x], new=1)   # a used: b is the least recently used now
    assert engine.stats["cached_prompt_tokens"] == 70
    one_by_one(engine, [b + x], new=1)   # a + x took b's row
    assert engine.stats["cached_prompt_tokens"] == 70
    one_by_one(engine, [a + x + x], new=1)
    assert engine.stats["cached_prompt_tokens"] == 70 + 75 and drained(engine)


def test_kept_prompts_give_their_pages_back_before_anybody_waits_or_is_preempted(pair):
    """A pool of 50 pages of 4 positions: three 70-token prompts would keep 54 pages, so the third evicts
    the first; new prompts then still get every page they need (the kept ones' given back before anybody
    waits or is preempted): the outputs and preemptions equal an engine without the cache."""
    page = page_bytes(pair[0], page_size=4)
    config = dict(max_slots=2, max_model_len=112, page_size=4, kv_cache_memory=50 * page)
    kept = prompts(VOCAB, [70, 70, 70], seed=5)
    fresh = prompts(VOCAB, [80, 90], seed=6)
    engine = engine_for(pair[0], **config)
    one_by_one(engine, kept)
    assert len(engine.scheduler.prefix) == 2
    got = [c.token_ids for c in engine.generate(fresh, SamplingParams(max_new_tokens=16, ignore_eos=True))[0]]
    plain = engine_for(pair[0], prefix_cache=0, **config)
    want = [c.token_ids for c in plain.generate(fresh, SamplingParams(max_new_tokens=16, ignore_eos=True))[0]]
    assert got == want and engine.stats["preemptions"] == plain.stats["preemptions"]
    assert drained(engine)


def test_a_growing_sequence_takes_a_kept_prompts_pages_before_it_is_preempted(pair):
    """40 pages of 4 positions, a kept 66-token prompt holding 17: a 20-token prompt growing to 120 tokens
    (30 pages) takes them as it grows - no preemption, the entry gone (its own state, 119 tokens, kept when it
    finishes)."""
    page = page_bytes(pair[0], page_size=4)
    engine = engine_for(pair[0], max_slots=2, max_model_len=128, page_size=4, kv_cache_memory=40 * page)
    kept, short = prompts(VOCAB, [66, 20], seed=12)
    one_by_one(engine, [kept], new=1)
    assert len(engine.scheduler.prefix) == 1
    got = engine.generate([short], SamplingParams(max_new_tokens=100, ignore_eos=True))[0][0].token_ids
    want = engine_for(pair[0], prefix_cache=0, max_slots=2, max_model_len=128, page_size=4).generate(
        [short], SamplingParams(max_new_tokens=100, ignore_eos=True))[0][0].token_ids
    assert got == want and engine.stats["preemptions"] == 0 and kept_lengths(engine) == [119]
    assert drained(engine)


def test_scored_prompts_are_prefilled_whole(pair):
    a, b = prompts(VOCAB, [80, 12], seed=7)
    engine = engine_for(pair[0])
    one_by_one(engine, [a])
    scored = engine.generate([a + b], params(1, 4, prompt_logprobs=1))[0][0]
    assert engine.stats["cached_prompt_tokens"] == 0
    alone = engine_for(pair[0], prefix_cache=0).generate([a + b], params(1, 4, prompt_logprobs=1))[0][0]
    assert [t.token_id for t in scored.prompt_logprobs] == [t.token_id for t in alone.prompt_logprobs]
    assert torch.allclose(torch.tensor([t.logprob for t in scored.prompt_logprobs]),
                          torch.tensor([t.logprob for t in alone.prompt_logprobs]))
    assert drained(engine)


def test_restored_sequences_preempted_resume_exactly(pair):
    """Four continuations of one kept prompt in a pool too small for all of them at once: restored
    sequences are preempted and recomputed; outputs equal an engine without the cache."""
    base = prompts(VOCAB, [66], seed=8)[0]
    tails = prompts(VOCAB, [3, 6, 9, 12], seed=9)
    page = page_bytes(pair[0], page_size=4)
    config = dict(max_slots=4, max_model_len=128, page_size=4, kv_cache_memory=60 * page)
    batch = [base + t for t in tails]
    engine = engine_for(pair[0], **config)
    one_by_one(engine, [base])
    got = [c.token_ids for c in engine.generate(batch, SamplingParams(max_new_tokens=40, ignore_eos=True))[0]]
    plain = engine_for(pair[0], prefix_cache=0, **config)
    want = [c.token_ids for c in plain.generate(batch, SamplingParams(max_new_tokens=40, ignore_eos=True))[0]]
    assert got == want and engine.stats["preemptions"] > 0 and engine.stats["cached_prompt_tokens"] >= 66
    assert drained(engine)


@pytest.mark.parametrize("branches", [False, True], ids=["whole-prompts", "branch-points"])
def test_many_requests_over_kept_prompts_cancelled_and_preempted_leave_only_the_cache_holding_pages(
        pair, monkeypatch, branches):
    made = small_branch_points(monkeypatch) if branches else []
    page = page_bytes(pair[0], page_size=4)
    engine = engine_for(pair[0], max_slots=4, max_model_len=160, page_size=4, max_num_batched_tokens=32,
                        kv_cache_memory=70 * page, prefix_cache=3)
    g = torch.Generator().manual_seed(2)
    roots = prompts(VOCAB, [64, 70, 90], seed=10)
    ids = []
    for _ in range(150):
        root = roots[int(torch.randint(0, 3, (), generator=g))]
        tail = torch.randint(0, VOCAB, (int(torch.randint(0, 12, (), generator=g)),), generator=g).tolist()
        ids.append(engine.add_request(root + tail, SamplingParams(max_new_tokens=int(torch.randint(1, 16, (),
                                                                                                   generator=g)),
                                                                  ignore_eos=True)))
    run_cancelling(engine, ids, every=4, check=lambda: check_pages_in_use(engine))
    assert engine.stats["cached_prompt_tokens"] > 0 and engine.stats["preemptions"] > 0
    assert bool(made) == branches
    assert drained(engine)


def test_the_prefix_cache_is_checked():
    with pytest.raises(DeltaflashError, match="prefix_cache must be >= 0"):
        EngineConfig(prefix_cache=-1).resolve(torch.device("cpu"), None)
    assert EngineConfig(max_slots=5).resolve(torch.device("cpu"), None).prefix_cache == 5
    assert EngineConfig(prefix_cache=0).resolve(torch.device("cpu"), None).prefix_cache == 0
