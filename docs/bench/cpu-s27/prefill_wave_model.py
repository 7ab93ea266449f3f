"""A model (not a measurement) of the prefill steps of a wave of prompts under a step budget: the scheduler's
chunking (exact, or with prefill_slack's eighth where the whole pads to the cut chunk's graph shape) and the
runner's graph choice (lane buckets: powers of two, or prefill_lane_buckets' 3 x 2^k as well; replayed where
the power-of-two bucket meets padded_rows_allowed, else eager). Cost: a replay 24 us a padded
row (the H200's 9B prefill rows, 2026-12-05 wave), an eager step max(24 us a row, FLOOR).
Rows: budget, chunking, buckets -> (steps, steps replayed, model ms, model ms / 24 us a prompt token).
The varied-length rows: the last figure for (exact, pow2), (exact, fine), (slack, pow2), (slack, fine).
Run from the repository root: python docs/bench/cpu-s27/prefill_wave_model.py"""
FLOOR = 40.0  # ms of host an eager 9B prefill step costs (a guess: ~20 ms for the 8-layer demo pair measured)
from deltaflash.engine.graphs import prefill_shapes, prefill_lane_buckets, prefill_tile, buckets_for, padded_rows_allowed
def run(budget, slack_frac, fine, prompts, max_slots=64, round_tokens=2048):
    shapes = dict(prefill_shapes(round_tokens, max_slots, 4096, 2048))
    rest = list(prompts); steps = []; 
    while rest:
        b = budget; slack = min(b // 8, round_tokens - b) if slack_frac else 0
        chunks = []; i = 0
        while i < len(rest) and b > 0:
            n = min(rest[i], b)
            if rest[i] - n <= slack and prefill_tile(rest[i]) == prefill_tile(n): n = rest[i]
            chunks.append(n); rest[i] -= n; b -= n; i += 1
        rest = [r for r in rest if r > 0]
        T = next(t for t in sorted(shapes) if t >= max(chunks))
        bk = (prefill_lane_buckets(T, shapes[T]) if fine else buckets_for(shapes[T]))
        L = next((x for x in bk if x >= len(chunks)), None)
        rows = sum(chunks)
        graphed = L and buckets_for(len(chunks))[-1] * T <= padded_rows_allowed(rows)  # judged at 2^k
        ms = L * T * 0.024 if graphed else max(rows * 0.024, FLOOR)
        steps.append((rows, ms, graphed))
    tok = sum(r for r, _, _ in steps); ms = sum(m for _, m, _ in steps)
    return len(steps), sum(g for *_, g in steps), round(ms), round(ms / (tok * 0.024), 3)
for budget in (512, 745, 757):
    for slack, fine in ((0, 0), (0, 1), (1, 0), (1, 1)):
        print(budget, "slack" if slack else "exact", "fine" if fine else "pow2", run(budget, slack, fine, [256] * 64))
import random
random.seed(1)
for dist in ("uniform 64-1024", "uniform 200-300"):
    lo, hi = map(int, dist.split()[1].split("-"))
    ps = [random.randint(lo, hi) for _ in range(64)]
    for budget in (512, 745, 1024):
        print(dist, budget, [run(budget, s, f, ps)[3] for s, f in ((0, 0), (0, 1), (1, 0), (1, 1))])
