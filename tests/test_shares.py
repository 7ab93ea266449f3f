"""Requests with one prompt fork from one prefill (engine/shares.py), on the CPU: the same outputs as
prefilling each (greedy and seeded sampling, speculative and target-only, prompts ending inside a page and
on its edge), the prompt prefilled once, pages held by several slots given back by the last, and every way
out - a follower that cannot fork, a cancelled leader or follower, preemption, prompt logprobs."""

import pytest
import torch

from deltaflash.cache.pages import PageAllocator
from deltaflash.core.request import SamplingParams, Sequence
from deltaflash.engine.shares import PromptShares
from tests.spec_pairs import engine_for, make_pair, prompts, run_cancelling
from tests.test_pages import page_bytes

VOCAB = 96


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("shares"), block_size=6)


def sampled(i: int, new: int = 16, **extra) -> SamplingParams:
    """Greedy for odd i, else seeded sampling (a seed of its own)."""
    return SamplingParams(max_new_tokens=new, ignore_eos=True, temperature=0.0 if i % 2 else 1.0, top_k=20, seed=i,
                          **extra)


def run(engine, batch, params):
    done, _ = engine.generate(batch, params)
    return [c.token_ids for c in done], done


def drained(engine) -> bool:
    """Every slot and page free, and nobody left following anybody."""
    s = engine.scheduler
    return s.pages.num_free == s.pages.num_pages and s.slots.num_free == engine.config.max_slots \
        and not s.pages._extra.any() and not len(s.shares)


def test_allocator_shares_pages_until_the_last_holder_gives_them_back():
    pages = PageAllocator(num_pages=8, page_size=4, num_slots=3)
    pages.grow(0, 10)                                             # pages 0, 1, 2
    assert pages.share(0, 1, 2) == [(1, 0, 0), (1, 1, 1)]         # the two whole ones
    assert pages.grow(1, 10) == [(1, 2, 3)] and pages.num_free == 4
    pages.share(0, 2, 2)
    assert pages.release(0) == 1 and pages.num_free == 5          # page 2 only: 0 and 1 are held by slots 1, 2
    assert pages.release(2) == 0 and pages.release(1) == 3 and pages.num_free == 8 and not pages._extra.any()
    with pytest.raises(ValueError, match="holds 0 pages, not 1"):
        pages.share(0, 1, 1)
    pages.grow(1, 1)
    with pytest.raises(ValueError, match="already holds"):
        pages.share(1, 1, 1)


def test_followers_wait_behind_their_leader_and_go_on_alone_when_it_cannot_lead():
    def seq(name, prompt, **params):
        return Sequence(name, prompt, SamplingParams(**params), frozenset(), 0)

    shares = PromptShares()
    lead, a, b, other = seq("lead", [1, 2]), seq("a", [1, 2]), seq("b", [1, 2]), seq("other", [1, 3])
    picky = seq("picky", [1, 2], prompt_logprobs=1)
    for s in (lead, a, b, other, picky):
        shares.add(s)
    assert shares.leader(a) is lead and shares.leader(b) is lead and len(shares) == 2
    assert shares.leader(other) is None and shares.leader(picky) is None  # another prompt; logprobs lead has not
    shares.forget(lead)                  # past its prompt's end: a leads b
    assert shares.leader(a) is None and shares.leader(b) is a
    shares.forget(b)                     # a follower retired
    assert len(shares) == 0
    late = seq("late", [1, 2])
    shares.add(late)
    assert shares.leader(late) is a
    a.cancel_requested = True            # a cannot lead any more: the next one leads itself
    newer = seq("newer", [1, 2])
    shares.add(newer)
    assert shares.leader(newer) is None
    shares.forget(a)                     # late would wait ahead of newer: it goes on alone
    assert shares.leader(late) is None and len(shares) == 0


@pytest.mark.parametrize("speculative", [True, False], ids=["spec", "target-only"])
def test_samples_of_one_prompt_fork_from_one_prefill(pair, speculative):
    """Four samples of a prompt ending inside a page, three of one ending on a page's edge, one alone, the
    prompts cut in chunks: outputs equal those of an engine prefilling every request, and each prompt is
    prefilled once."""
    draft = pair[1] if speculative else None
    a, b, c = prompts(VOCAB, [21, 16, 7], seed=3)
    batch = [a] * 4 + [b] * 3 + [c]
    params = [sampled(i) for i in range(len(batch))]
    config = dict(page_size=4, max_num_batched_tokens=8, idle_prefill_tokens=8)
    alone = engine_for(pair[0], draft, share_prompts=False, **config)
    want, _ = run(alone, batch, params)
    shared = engine_for(pair[0], draft, **config)
    got, _ = run(shared, batch, params)
    assert got == want
    assert shared.stats["prefill_tokens"] == 21 + 16 + 7 and shared.stats["shared_prompt_tokens"] == 3 * 21 + 2 * 16
    assert alone.stats["shared_prompt_tokens"] == 0 and drained(shared)


def test_a_follower_without_a_free_slot_prefills_alone(pair):
    """Two slots, three samples of one prompt: the third cannot fork when the prompt's prefill ends, so it
    prefills the prompt itself once a slot is free, and its output is what it is prefilled alone."""
    prompt = prompts(VOCAB, [13], seed=5)[0]
    params = [sampled(i, new=10) for i in range(3)]
    got, _ = run(shared := engine_for(pair[0], max_slots=2, page_size=4), [prompt] * 3, params)
    want, _ = run(engine_for(pair[0], max_slots=2, page_size=4, share_prompts=False), [prompt] * 3, params)
    assert got == want and shared.stats["shared_prompt_tokens"] == 13 and shared.stats["prefill_tokens"] == 26
    assert drained(shared)


def test_cancelled_leaders_and_followers(pair):
    """A leader cancelled during its prefill hands its followers to the first of them; a follower cancelled
    while it waits is gone. The others' outputs are unchanged."""
    p, q = prompts(VOCAB, [30, 9], seed=8)
    params = [sampled(i) for i in range(4)]
    alone, _ = run(engine_for(pair[0], share_prompts=False), [p] * 4 + [q], params + [sampled(4)])
    engine = engine_for(pair[0], max_num_batched_tokens=8, idle_prefill_tokens=8)
    ids = [engine.add_request(prompt, sp) for prompt, sp in zip([p] * 4 + [q], params + [sampled(4)])]
    engine.step()                        # the leader's first chunk
    engine.abort(ids[0])
    engine.abort(ids[2])
    out = {i: [] for i in ids}
    reasons = {}
    while engine.has_work():
        for ev in engine.step():
            out[ev.request_id] += ev.token_ids
            reasons[ev.request_id] = ev.finish_reason or reasons.get(ev.request_id)
    assert reasons[ids[0]] == reasons[ids[2]] == "cancelled"
    assert [out[ids[i]] for i in (1, 3, 4)] == [alone[i] for i in (1, 3, 4)]
    assert engine.stats["prefill_tokens"] == 8 + 30 + 9 and engine.stats["shared_prompt_tokens"] == 30
    assert drained(engine)


def test_forks_under_preemption_give_every_page_back(pair):
    """A pool too small for every sample: forks holding their leader's pages are preempted and recomputed,
    outputs equal an engine with room for all, and every page comes back."""
    batch = [p for p in prompts(VOCAB, [14, 11], seed=9) for _ in range(3)]
    params = [SamplingParams(max_new_tokens=30, ignore_eos=True)] * len(batch)
    config = dict(max_slots=6, max_model_len=64, page_size=4)
    roomy, _ = run(engine_for(pair[0], **config), batch, params)
    tight = engine_for(pair[0], kv_cache_memory=30 * page_bytes(pair[0], page_size=4), **config)
    got, _ = run(tight, batch, params)
    assert got == roomy and tight.stats["preemptions"] > 0 and tight.stats["shared_prompt_tokens"] > 0
    assert drained(tight)


def test_followers_get_the_leaders_prompt_logprobs(pair):
    prompt = prompts(VOCAB, [12], seed=10)[0]
    params = [sampled(i, new=4, prompt_logprobs=2) for i in range(3)]
    engine = engine_for(pair[0])
    _, done = run(engine, [prompt] * 3, params)
    _, alone = run(engine_for(pair[0], share_prompts=False), [prompt], params[:1])
    assert engine.stats["shared_prompt_tokens"] == 24
    for c in done:
        assert [(lp.token_id, lp.top) for lp in c.prompt_logprobs] == \
            [(lp.token_id, lp.top) for lp in alone[0].prompt_logprobs]
        assert torch.allclose(torch.tensor([lp.logprob for lp in c.prompt_logprobs]),
                              torch.tensor([lp.logprob for lp in alone[0].prompt_logprobs]))


def test_many_requests_with_repeated_prompts_cancelled_and_preempted_give_every_page_back(pair):
    engine = engine_for(pair[0], max_slots=5, max_model_len=48, page_size=4, max_num_batched_tokens=8,
                        kv_cache_memory=18 * page_bytes(pair[0], page_size=4))
    g = torch.Generator().manual_seed(1)
    pool = prompts(VOCAB, [1, 4, 7, 13, 19], seed=11)
    ids = [engine.add_request(pool[int(torch.randint(0, 5, (), generator=g))],
                              SamplingParams(max_new_tokens=int(torch.randint(1, 20, (), generator=g)), ignore_eos=True))
           for _ in range(300)]
    run_cancelling(engine, ids, every=3)
    assert engine.stats["preemptions"] > 0 and engine.stats["shared_prompt_tokens"] > 0
    assert drained(engine)
