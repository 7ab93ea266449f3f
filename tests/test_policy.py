"""Load-adaptive speculation (speculative/policy.py): widths follow load and acceptance, a lane that is
never accepted stops drafting and probes again, and greedy output is the same at every width mix; a tree
engine's rounds take trees or chains by their measured tokens per second (TreeChoice)."""

import math

import pytest

from deltaflash.core.request import SamplingParams, Sequence
from deltaflash.speculative.policy import (
    FIRST_RATE, MIN_TRIES, PROBE_WIDTH, RoundCosts, TreeChoice, WidthPolicy, acceptance_rate, allowed_widths,
    expected_curve, expected_tokens, observe_round,
)
from deltaflash.speculative.sources import ScriptedSource
from tests.spec_pairs import engine_for, make_pair, prompts

BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def lane(rate: float | None = None, rounds: int = 30, allowed: int = 15) -> Sequence:
    """A sequence whose history accepted each draft with probability `rate` (deterministic counts)."""
    seq = Sequence("r", [1], SamplingParams(max_new_tokens=1000), frozenset(), seed=0)
    if rate is not None:
        for i in range(rounds):  # accept floor(rate * k) drafts in a pattern with that mean rate per position
            accepted = 0
            while accepted < allowed and ((i * 7919 + accepted * 104729) % 1000) / 1000 < rate:
                accepted += 1
            observe_round(seq, allowed, accepted)
    return seq


def compute_bound_costs(weight_read: float = 5.0, per_row: float = 0.02) -> RoundCosts:
    """A GPU-like round: a fixed weight read until lanes x rows make it compute-bound."""
    return RoundCosts(seeds={(b, w): max(weight_read, per_row * b * w) + 0.5 * (w > 1)
                             for b in BUCKETS for w in allowed_widths(16)}, buckets=BUCKETS)


def test_allowed_widths_and_expected_tokens():
    assert allowed_widths(16) == (1, 2, 4, 8, 16) and allowed_widths(6) == (1, 2, 4, 6) and allowed_widths(1) == (1,)
    good, bad = lane(0.9), lane(0.05)
    assert acceptance_rate(good, 1) > 0.8 and acceptance_rate(bad, 1, prior=0.1) < 0.15
    assert expected_tokens(good, 1) == 1.0 and expected_tokens(good, 16) > 4 > 2 > expected_tokens(bad, 16)
    priors = [0.5, 0.9, 0.2]  # the one-pass curve: each width's bonus token plus the product of its draft rates
    for seq in (good, bad, lane()):
        by_product = [1 + sum(math.prod(acceptance_rate(seq, j, priors[j - 1] if j <= 3 else FIRST_RATE)
                                        for j in range(1, i + 1)) for i in range(1, w)) for w in range(1, 17)]
        assert expected_curve(seq, 16, priors) == pytest.approx(by_product, rel=1e-12)
        assert [expected_tokens(seq, w, priors) for w in range(1, 17)] == expected_curve(seq, 16, priors)


def test_width_shrinks_as_load_grows():
    policy = WidthPolicy(allowed_widths(16), compute_bound_costs())
    chosen = {n: policy.choose([lane(0.8) for _ in range(n)], [16] * n)[0] for n in (1, 16, 64)}
    assert chosen[1] == 16 and chosen[1] >= chosen[16] >= chosen[64] and chosen[64] < 16, chosen
    low = {n: policy.choose([lane(0.3) for _ in range(n)], [16] * n)[0] for n in (1, 64)}
    assert low[1] <= chosen[1] and low[64] <= chosen[64]  # poorer acceptance: no wider
    assert policy.choose([lane(0.8)], [3])[1] == [3]  # never past the tokens a lane has left


def test_a_lane_never_accepted_stops_drafting_and_probes_again():
    policy = WidthPolicy(allowed_widths(8), compute_bound_costs(), probe_every=5)
    seq, good = lane(), lane(0.9)
    widths = []
    for _ in range(40):
        _, (w, _) = policy.choose([seq, good], [8, 8])
        widths.append(w)
        observe_round(seq, w - 1, 0)  # none of its drafts is ever accepted
    first_stop = widths.index(1)
    assert seq.draft_tries[0] >= MIN_TRIES and first_stop <= 8
    stops = widths[first_stop:]
    assert 1 in stops and any(w > 1 for w in stops)  # probes now and then
    assert sum(w > 1 for w in stops) <= len(stops) // 5 + 1
    assert set(stops) == {1, PROBE_WIDTH}  # a probe checks the first draft: it does not widen the round


def test_lanes_probing_together_under_load_keep_the_round_narrow():
    """Sixteen lanes that stopped drafting together probe together: the round verifies PROBE_WIDTH rows,
    not the block's (a useless drafter at 16 lanes otherwise ran every 16th round at twice the cost)."""
    policy = WidthPolicy(allowed_widths(16), compute_bound_costs(), probe_every=4)
    seqs = [lane() for _ in range(16)]
    rounds = []
    for _ in range(24):
        round_width, widths = policy.choose(seqs, [100] * 16)
        rounds.append(round_width)
        for seq, w in zip(seqs, widths):
            policy.observe(seq, w - 1, 0)
    after = rounds[rounds.index(1):]  # (the first rounds try the block: no evidence yet)
    assert after.count(1) > len(after) // 2 and max(after) == PROBE_WIDTH, rounds


def test_costs_follow_the_measured_rounds():
    costs = RoundCosts(seeds={(1, 1): 1.0, (1, 8): 2.0})
    costs.observe(1, 8, 4.0)  # the round took longer than its seed: 2 s of host work
    assert costs.cost(1, 8) == 4.0 and costs.cost(1, 1) == pytest.approx(1.0 + 0.1 * 2.0)
    assert costs.cost(4, 8) > costs.cost(1, 8) / 2  # an unseen entry scales from the nearest seed


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("policy"), block_size=8)


def test_greedy_output_is_the_same_at_every_width_mix(pair):
    """Lanes with a script (most drafts right) beside lanes drafting at random: target-only greedy output,
    widths that vary, and the random lanes' drafting stopped. The policy weighs fixed GPU-like costs, not
    the CPU's measured ones: measured costs made which widths the rounds took (and so when the random lanes
    gathered the evidence that stops them) depend on the machine's load."""
    target, _ = pair
    batch = prompts(96, [4, 9, 6, 12, 3, 7], seed=9)
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    plain = [c.token_ids for c in engine_for(target, max_model_len=96).generate(batch, params)[0]]
    scripts = {tuple(p): out for p, out in zip(batch[:3], plain[:3])}  # lanes 3..5 draft at random
    engine = engine_for(target, draft_source=ScriptedSource(scripts, 8, 96, corrupt=0.1, seed=4),
                        speculation="adaptive", max_model_len=96)
    assert engine.scheduler.policy is not None and engine.config.widths == (1, 2, 4, 8)
    engine.scheduler.policy.costs = compute_bound_costs()  # the engine goes on timing its own (scheduler.costs)
    done, _ = engine.generate(batch, params)
    assert [c.token_ids for c in done] == plain
    scripted, random_lanes = done[:3], done[3:]
    assert all(max(c.widths) > 1 for c in scripted)
    assert all(c.widths[-8:].count(1) >= 6 for c in random_lanes)  # stopped drafting (bar the probes)
    assert len({w for c in done for w in c.widths}) >= 2


def test_seeded_sampled_lanes_verify_their_full_width_whatever_the_load():
    """A seeded sampled request reproduces only if the positions it drafts do not depend on the load."""
    policy = WidthPolicy(allowed_widths(16), compute_bound_costs())
    seqs = [lane(0.3) for _ in range(64)]
    assert policy.choose(seqs, [16] * 64)[0] < 16  # under load, greedy lanes narrow down
    seeded = lane(0.3)
    seeded.params = SamplingParams(max_new_tokens=1000, temperature=0.8, seed=5)
    round_width, widths = policy.choose(seqs + [seeded], [16] * 64 + [9])
    assert round_width == 16 and widths[-1] == 9 and widths[:-1] == [16] * 64


def test_forget_keeps_only_the_calibration():
    policy = WidthPolicy(allowed_widths(8), RoundCosts(seeds={(1, 1): 1.0, (1, 8): 2.0}))
    seq = lane()
    policy.observe(seq, 7, 0)
    policy.costs.observe(1, 8, 5.0)
    policy.forget()
    assert policy.priors() == [] and policy.costs.cost(1, 8) == 2.0


def test_the_warm_requests_run_every_width_in_use(pair, monkeypatch):
    """Start-up's warm requests (run on CUDA before the first client) go through a round at every width an
    adaptive engine may choose, whatever the policy would choose for them (here: always the block), so no
    width meets a kernel for the first time inside a request; afterwards the policy chooses freely again."""
    target, _ = pair
    engine = engine_for(target, draft_source=ScriptedSource({}, 8, 96, seed=1), speculation="adaptive",
                        max_model_len=96)
    assert engine.config.widths == (1, 2, 4, 8)
    execute, widths = engine.runner.execute, set()

    def recording(plan, *args, **kwargs):
        if plan.decode:
            widths.add(plan.round_width)
        return execute(plan, *args, **kwargs)

    monkeypatch.setattr(engine.runner, "execute", recording)
    policy = engine.scheduler.policy
    monkeypatch.setattr(policy, "choose", lambda seqs, caps: (8, [min(8, c) for c in caps]))
    engine._warm_requests()
    assert widths == set(engine.config.widths)
    assert engine.scheduler.pin.width is None and not engine.has_work()


# ---- trees or chains ------------------------------------------------------------------------------
def feed(choice: TreeChoice, lanes: int, rounds: int, seconds: dict, tokens: dict) -> list[bool]:
    """`rounds` rounds of `lanes` lanes, each in the mode the choice picks, costing seconds[mode] and emitting
    tokens[mode] per lane; returns the modes chosen."""
    modes = []
    for _ in range(rounds):
        trees = choice.choose(lanes)
        choice.observe(lanes, trees, seconds[trees], [tokens[trees]] * lanes)
        modes.append(trees)
    return modes


def test_trees_or_chains_follow_tokens_per_second_at_each_bucket():
    """Trees where their extra rows are nearly free (one lane: 4 tokens for 1.0 ms against 3 for 0.9), chains
    where they are dear (16 lanes: 4 tokens for 2.0 ms against 3 for 1.2). A bucket without figures tries
    trees, then chains; afterwards the loser runs one round in explore_every there."""
    choice = TreeChoice(BUCKETS, explore_every=8)
    one = feed(choice, 1, 40, {True: 1.0e-3, False: 0.9e-3}, {True: 4, False: 3})
    assert one[:2] == [True, False] and one[2:].count(False) == 38 // 8
    sixteen = feed(choice, 13, 40, {True: 2.0e-3, False: 1.2e-3}, {True: 4, False: 3})
    assert sixteen[:2] == [True, False] and sixteen[2:].count(True) == 38 // 8
    assert choice.best(1) is True and choice.best(16) is False and choice.bucket(13) == 16


def test_an_exploring_round_turns_the_choice_when_the_loser_got_cheaper():
    """The chain lost at one lane; its cost drops (another workload, a faster kernel): the next exploring
    round measures it and the choice turns within a few explorations."""
    choice = TreeChoice(BUCKETS, explore_every=4)
    feed(choice, 1, 20, {True: 1.0e-3, False: 1.0e-3}, {True: 4, False: 3})
    assert choice.best(1) is True
    modes = feed(choice, 1, 200, {True: 1.0e-3, False: 0.5e-3}, {True: 4, False: 3})
    assert choice.best(1) is False and modes[-20:].count(False) >= 20 - 20 // 4


def test_a_losing_mode_s_first_figures_do_not_stick():
    """The chain's first round happened to accept nothing (1 token a lane): the next explorations, at its
    true 3 tokens in 0.5 ms against the tree's 4 in 1.0, turn the choice to chains within a few of them (an
    exponential mean seeded with the first value moves 1% per lane observed and kept trees for hundreds of
    rounds: seen on the CPU)."""
    choice = TreeChoice(BUCKETS, explore_every=4)
    choice.observe(1, True, 1.0e-3, [4])
    choice.observe(1, False, 0.5e-3, [1])
    assert choice.best(1) is True
    modes = feed(choice, 1, 24, {True: 1.0e-3, False: 0.5e-3}, {True: 4, False: 3})
    assert choice.best(1) is False and modes[-8:].count(False) == 8 - 8 // 4  # (one exploring tree in 4)


def test_a_step_that_also_prefilled_does_not_move_a_measured_cost():
    choice = TreeChoice(BUCKETS)
    choice.observe(1, True, 1.0e-3, [4])
    choice.observe(1, True, 9.0e-3, [4], clean=False)  # the step's time holds a prefill's
    assert choice.costs[(1, True)].value == 1.0e-3
    choice.observe(1, False, 9.0e-3, [3], clean=False)  # no figure yet: better than none
    assert choice.costs[(1, False)].value == 9.0e-3
    choice.forget()
    assert not choice.costs and not choice.tokens and choice.choose(1) is True
