"""Load-adaptive speculation: how many rows each round verifies (host only; the scheduler asks it).

A verify forward has one width w for all its lanes (rows are a rectangle), and its cost c(L, w) grows
with lanes x rows once the GEMMs stop being weight-bound. Each round takes the w of the allowed widths
(1 and powers of two up to the block) that maximises expected tokens per second,
    sum over lanes of E_l(min(w, cap_l)) / c(bucket(L), w),
where E_l(w) = 1 + sum_{i < w} prod_{j <= i} a_{l,j} is the tokens lane l emits with w rows, a_{l,j} its
running acceptance rate of the j-th draft given the ones before (its decayed counts, with the engine-wide
rate of that position over recent rounds as a prior worth PRIOR_WEIGHT rounds, so a new request starts
from what drafting has been achieving; before any round that rate is the optimistic FIRST_RATE), and
cap_l the tokens it has left. c is seeded at engine start by timing the draft and verify forwards of
every (lane bucket, width) and then follows the measured wall time of the rounds run (decayed means),
so host costs count too. A lane whose first draft is almost never accepted stops drafting (it accepts no
draft in the rounds it shares). Every `probe_every` rounds without drafting, a lane probes: it counts
with the optimistic FIRST_RATE instead of its own record, so drafting is tried again where it could
pay (at one lane, say) and not where the load makes it too dear. A probe verifies at most PROBE_WIDTH
rows - its first draft, the evidence the stop rule reads - so lanes that stopped together and probe
together do not widen a loaded round to the block for nothing (a useless drafter at 16 lanes of the 9B
shape: every 16th round at twice the cost, 5.6% of the time). Greedy output is the same at every
width: acceptance is exact for any number of drafts. A sampled request with a seed is reproducible only
if the positions it drafts do not depend on the load, so its lane always verifies its full width (as with
fixed speculation) and a round holding one runs at the block: the others then draft at no extra cost.
"""

from __future__ import annotations

from collections.abc import Sequence as Seqs
from dataclasses import dataclass, field

from deltaflash.core.request import Sequence

DECAY = 0.9          # weight of the past in a lane's acceptance counts and in the cost means, per observation
ENGINE_DECAY = 0.99  # the same for the engine-wide acceptance counts (a prior: slower)
PRIOR_WEIGHT = 3.0   # rounds' worth of the engine-wide rate in a lane's estimate
FIRST_RATE = 0.8     # the engine-wide rate before any round: optimistic, so that drafting gets tried
STOP_BELOW = 0.15    # first-draft acceptance under which a lane stops drafting
MIN_TRIES = 4.0      # ... once it has this much (decayed) evidence
PROBE_WIDTH = 2      # rows a probing lane verifies: the anchor and its first draft


def allowed_widths(block_size: int) -> tuple[int, ...]:
    """1, the powers of two below the block, and the block: the widths with a CUDA graph."""
    widths, w = [1], 2
    while w < block_size:
        widths.append(w)
        w *= 2
    return tuple(widths + [block_size]) if block_size > 1 else (1,)


def lane_bucket(buckets: Seqs[int], lanes: int) -> int:
    """The smallest of `buckets` (the rounds' graphs) holding `lanes` lanes; `lanes` itself past the last."""
    return next((b for b in buckets if b >= lanes), lanes)


def acceptance_rate(seq: Sequence, j: int, prior: float = FIRST_RATE) -> float:
    """Running rate at which lane `seq` has its j-th draft accepted after the j-1 before it (j >= 1),
    `prior` (the engine-wide rate) counting PRIOR_WEIGHT rounds."""
    hits = seq.draft_hits[j - 1] if j <= len(seq.draft_hits) else 0.0
    tries = seq.draft_tries[j - 1] if j <= len(seq.draft_tries) else 0.0
    return (hits + PRIOR_WEIGHT * prior) / (tries + PRIOR_WEIGHT)


def expected_tokens(seq: Sequence, width: int, priors: Seqs[float] = ()) -> float:
    """Tokens the lane emits in a round of `width` rows: the bonus token plus each draft reached
    (priors[j-1]: the engine-wide rate of draft j; FIRST_RATE where not given)."""
    return expected_curve(seq, width, priors)[-1]


def expected_curve(seq: Sequence, rows: int, priors: Seqs[float] = ()) -> list[float]:
    """expected_tokens(seq, w, priors) for w = 1..rows, in one pass (the policy weighs every width of
    every lane each round: at 64 lanes one pass per lane, not one per width, is most of its host time)."""
    hits, tries = seq.draft_hits, seq.draft_tries
    n_hits, n_tries, n_priors = len(hits), len(tries), len(priors)
    curve, total, reach = [1.0], 1.0, 1.0
    for j in range(1, rows):  # acceptance_rate(seq, j, prior), inlined
        prior = priors[j - 1] if j <= n_priors else FIRST_RATE
        reach *= ((hits[j - 1] if j <= n_hits else 0.0) + PRIOR_WEIGHT * prior) / \
            ((tries[j - 1] if j <= n_tries else 0.0) + PRIOR_WEIGHT)
        total += reach
        curve.append(total)
    return curve


def observe_round(seq: Sequence, allowed: int, accepted: int) -> None:
    """A round offered the lane `allowed` drafts and `accepted` of them were taken: positions
    1..accepted hit, position accepted + 1 (when offered) missed, the counts decay; a lane offered none
    counts one more round since it drafted."""
    seq.rounds_since_draft = 0 if allowed else seq.rounds_since_draft + 1
    _count(seq.draft_tries, seq.draft_hits, allowed, accepted, DECAY)


def _count(tries: list[float], hits: list[float], allowed: int, accepted: int, decay: float) -> None:
    """Decayed per-position counts, in place: positions 1..accepted tried and hit, accepted + 1 (when
    offered) tried and missed."""
    tries += [0.0] * (allowed - len(tries))
    hits += [0.0] * (allowed - len(hits))
    for j in range(1, min(accepted + 1, allowed) + 1):
        tries[j - 1] = decay * tries[j - 1] + 1.0
        hits[j - 1] = decay * hits[j - 1] + (1.0 if j <= accepted else 0.0)


@dataclass
class RoundCosts:
    """Seconds of one round per (lane bucket, width). `seeds`: the device work timed at calibration;
    `measured`: decayed means of the rounds run, host work included; `overhead`: the decayed mean of
    measured less seed, added to the seeds of the entries not measured yet (so that they compare fairly
    with those that were). An entry with neither is scaled from the nearest seed by its rows."""

    seeds: dict[tuple[int, int], float] = field(default_factory=dict)
    measured: dict[tuple[int, int], float] = field(default_factory=dict)
    overhead: float = 0.0
    buckets: tuple[int, ...] = ()  # the lane buckets (the rounds' graphs): cost_ratio's lanes go to the next one up
    prefill: PrefillCost = field(default_factory=lambda: PrefillCost())  # what prompt tokens add to a step

    def cost(self, bucket: int, width: int) -> float:
        key = (bucket, width)
        if key in self.measured:
            return self.measured[key]
        return self._seed(bucket, width) + self.overhead

    def _seed(self, bucket: int, width: int) -> float:
        if (bucket, width) in self.seeds:
            return self.seeds[(bucket, width)]
        if not self.seeds:
            return float(bucket * width)
        (b, w), s = min(self.seeds.items(), key=lambda kv: abs(kv[0][0] * kv[0][1] - bucket * width))
        return s * (bucket * width) / (b * w)

    def bucket(self, lanes: int) -> int:
        return lane_bucket(self.buckets, lanes)

    def cost_ratio(self, lanes: int, width: int) -> float:
        """A round of `lanes` lanes at `width` rows over one at width 1 (the same lane bucket)."""
        bucket = self.bucket(lanes)
        return self.cost(bucket, width) / max(self.cost(bucket, 1), 1e-12)

    def forget(self) -> None:
        """Back to the calibration alone."""
        self.measured.clear()
        self.overhead = 0.0
        self.prefill = PrefillCost()

    def observe(self, bucket: int, width: int, seconds: float) -> None:
        key = (bucket, width)
        old = self.measured.get(key)
        self.measured[key] = seconds if old is None else DECAY * old + (1 - DECAY) * seconds
        self.overhead = DECAY * self.overhead + (1 - DECAY) * (seconds - self._seed(bucket, width))


@dataclass
class PrefillCost:
    """Seconds n prompt rows (a graph's padding included) add to a step beside a round, a + b n, from the
    steps measured (decayed sums, DECAY per step). While the rows measured vary enough the line is fitted;
    else b is their mean cost per row and a is 0 (tokens_within then moves the budget, and the budgets it
    sets settle where a + b n is the time allowed: n' = allowed n / (a + b n) has that fixed point)."""

    sums: list[float] = field(default_factory=lambda: [0.0] * 5)  # weight, n, n^2, seconds, n x seconds

    def observe(self, tokens: int, seconds: float) -> None:
        seconds = max(seconds, 0.0)  # (a step quicker than its round's mean)
        for i, x in enumerate((1.0, tokens, tokens * tokens, seconds, tokens * seconds)):
            self.sums[i] = DECAY * self.sums[i] + x

    def line(self) -> tuple[float, float, bool] | None:
        """(a, b, whether the line was fitted), or None before any step."""
        w, n, nn, s, ns = self.sums
        if not w or not n:
            return None
        mean_n, mean_s = n / w, s / w
        spread = nn / w - mean_n * mean_n
        if spread > (0.1 * mean_n) ** 2:  # tokens that vary by 10% and more: fit the line
            b = (ns / w - mean_n * mean_s) / spread
            if b > 0:
                return max(0.0, mean_s - b * mean_n), b, True
        return 0.0, s / n, False

    def tokens_within(self, seconds: float, least: int, most: int) -> int:
        """The prompt tokens of a step whose prefill adds at most `seconds`, in [least, most]; where even
        `least` would add more by the fitted line, `most` (a stall that cannot be met: fewer, larger chunks
        stall less in all)."""
        line = self.line()
        if line is None:
            return most
        a, b, fitted = line
        if b <= 0:  # (every step measured at no more than its round: nothing to hold)
            return most
        n = int((seconds - a) / b)
        return (most if fitted else least) if n < least else min(most, n)


@dataclass
class WidthPolicy:
    """Chooses each round's width and each lane's (see the module docstring)."""

    widths: tuple[int, ...]
    costs: RoundCosts  # its buckets are the policy's
    probe_every: int = 16
    tries: list[float] = field(default_factory=list)  # engine-wide decayed counts per draft position
    hits: list[float] = field(default_factory=list)

    def forget(self) -> None:
        """Back to the calibration alone: no acceptance record, no measured rounds."""
        self.tries, self.hits = [], []
        self.costs.forget()

    def priors(self) -> list[float]:
        """The engine-wide acceptance rate of each draft position (FIRST_RATE worth one round as its prior)."""
        return [(h + FIRST_RATE) / (t + 1.0) for h, t in zip(self.hits, self.tries)]

    def observe(self, seq: Sequence, allowed: int, accepted: int) -> None:
        """One lane's round: its own counts (observe_round) and the engine-wide ones."""
        observe_round(seq, allowed, accepted)
        _count(self.tries, self.hits, allowed, accepted, ENGINE_DECAY)

    def choose(self, seqs: Seqs[Sequence], caps: Seqs[int]) -> tuple[int, list[int]]:
        """(round width, per-lane widths) for lanes `seqs` that may emit at most caps[l] tokens."""
        priors = self.priors()
        seeded = [seq.params.seeded_sampling for seq in seqs]
        if any(cap > 1 and s for cap, s in zip(caps, seeded)):  # the block, every lane at its most unless stopped
            lanes = [cap if cap > 1 and (s or self._drafts(seq, priors)) else 1 for seq, cap, s in zip(seqs, caps, seeded)]
            return self.widths[-1], lanes
        probing = [seq.rounds_since_draft + 1 >= self.probe_every for seq in seqs]
        caps = [min(cap, PROBE_WIDTH) if probe else cap for cap, probe in zip(caps, probing)]
        drafting = [cap > 1 and (probe or self._drafts(seq, priors)) for seq, cap, probe in zip(seqs, caps, probing)]
        bucket = self.costs.bucket(len(seqs))
        gains = [0.0] * len(self.widths)  # expected tokens of the round at each width, summed in lane order
        for seq, cap, d, probe in zip(seqs, caps, drafting, probing):
            curve = (_OPTIMISTIC[:cap] if probe else expected_curve(seq, cap, priors)) if d else None
            for i, w in enumerate(self.widths):
                gains[i] += curve[min(w, cap) - 1] if curve is not None else 1.0
        best, best_value = 1, -1.0
        for w, gain in zip(self.widths, gains):
            value = gain / max(self.costs.cost(bucket, w), 1e-9)
            if value > best_value * (1 + 1e-9):
                best, best_value = w, value
        lane_widths = [min(best, cap) if d else 1 for cap, d in zip(caps, drafting)]
        return (best if any(w > 1 for w in lane_widths) else 1), lane_widths

    def _drafts(self, seq: Sequence, priors: list[float]) -> bool:
        """Whether the lane drafts (outside probes): unless its own record says its first draft almost
        never lands (the engine-wide prior does not excuse a lane that fails where others succeed)."""
        tries = seq.draft_tries[0] if seq.draft_tries else 0.0
        return tries < MIN_TRIES or seq.draft_hits[0] / tries >= STOP_BELOW


def _optimistic_tokens(width: int) -> float:
    """Expected tokens of a probing lane: every draft at FIRST_RATE."""
    return sum(FIRST_RATE ** i for i in range(width))


_OPTIMISTIC = [_optimistic_tokens(w) for w in range(1, PROBE_WIDTH + 1)]  # a probe's caps are at most PROBE_WIDTH


TREE_EXPLORE_EVERY = 32  # a bucket's rounds per round of the mode that lost there (keeps its figures current)


@dataclass
class DecayedMean:
    """A mean in which each observation weighs 1 and the past decays by `decay` per observation: the
    first few are averaged plainly (a first value is not carried for rounds, as an exponential average
    seeded with it would: the losing mode is observed once in TREE_EXPLORE_EVERY rounds)."""

    decay: float
    total: float = 0.0
    weight: float = 0.0

    def add(self, x: float) -> None:
        self.total = self.decay * self.total + x
        self.weight = self.decay * self.weight + 1.0

    @property
    def value(self) -> float:
        return self.total / self.weight


@dataclass
class TreeChoice:
    """Trees or top-1 chains, round by round, for an engine that drafts trees (config.tree_max_lanes None).

    A tree's extra rows cost little beside a launch-bound round and a lot beside a compute-bound one: on the
    H200 the demo pair's tree of 16 beats its chain at one lane and about matches it at 4 and 16, while on
    the 9B shape a tree round of 16 lanes costs 1.5x the chain's, where the demo pair's tree accepts 1.2x
    the chain's tokens (and on a CPU every row costs compute).
    So each round takes the mode with more tokens per second at its lane bucket: tokens a speculating lane
    emits per round of that mode (an engine-wide decayed mean: acceptance does not depend on the load) over
    the mode's round time at the bucket (a decayed mean of the rounds measured there). A mode without
    figures at a bucket is tried there first (trees first); then the mode that lost runs one round in every
    `explore_every` at that bucket, so a drifting cost or acceptance can turn the choice back. Greedy
    output is the same either way.
    """

    buckets: tuple[int, ...]
    explore_every: int = TREE_EXPLORE_EVERY
    tokens: dict[bool, DecayedMean] = field(default_factory=dict)  # trees? -> tokens per speculating lane a round
    costs: dict[tuple[int, bool], DecayedMean] = field(default_factory=dict)  # (bucket, trees?) -> seconds a round
    since: dict[int, int] = field(default_factory=dict)  # bucket -> rounds since the losing mode last ran there

    def bucket(self, lanes: int) -> int:
        return lane_bucket(self.buckets, lanes)

    def rate(self, bucket: int, trees: bool) -> float | None:
        """Tokens per second a lane gets from rounds of that mode at `bucket` (None: no figures yet)."""
        if trees not in self.tokens or (bucket, trees) not in self.costs:
            return None
        return self.tokens[trees].value / max(self.costs[(bucket, trees)].value, 1e-9)

    def best(self, bucket: int) -> bool | None:
        """The mode with more tokens per second at `bucket`, None while either lacks figures there."""
        trees, chains = self.rate(bucket, True), self.rate(bucket, False)
        return None if trees is None or chains is None else trees >= chains

    def choose(self, lanes: int) -> bool:
        """Whether a round of `lanes` decoding lanes verifies trees (no state changes: observe does that)."""
        bucket = self.bucket(lanes)
        best = self.best(bucket)
        if best is None:  # try what has no figures here yet
            return self.rate(bucket, True) is None
        return best if self.since.get(bucket, 0) + 1 < self.explore_every else not best

    def observe(self, lanes: int, trees: bool, seconds: float, tokens: Seqs[int], clean: bool = True) -> None:
        """A round of `lanes` lanes ran in mode `trees`, took `seconds` and its speculating lanes emitted
        `tokens`. `clean`: the seconds are the round's alone (a step that also prefilled is not: its time
        then counts only where the mode has no figure at that bucket yet)."""
        bucket = self.bucket(lanes)
        best = self.best(bucket)
        self.since[bucket] = 0 if best is None or trees != best else self.since.get(bucket, 0) + 1
        cost = self.costs.get((bucket, trees))
        if cost is None or clean:
            self.costs.setdefault((bucket, trees), DecayedMean(DECAY)).add(seconds)
        mean = self.tokens.setdefault(trees, DecayedMean(ENGINE_DECAY))
        for n in tokens:
            mean.add(n)

    def forget(self) -> None:
        """No figures: what the warm-up measured is not about clients."""
        self.tokens.clear()
        self.costs.clear()
        self.since.clear()
