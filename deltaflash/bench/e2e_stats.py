"""Statistics and the table of `bench e2e` points, shared by the in-process sweep (e2e.py) and the
server mode (e2e_server.py): latency percentiles, where speculative output first differs, the report."""

from __future__ import annotations

import math

from deltaflash.bench.common import print_table
from deltaflash.core.request import SamplingParams


def latency_summary(sequences: list[tuple[float, float, list[tuple[float, int]], int]]) -> dict:
    """Per sequence (first token s, last token s, [(event time, tokens in the event)], tokens), all
    times from the sequence's submission: mean tokens/s, mean decode tokens/s (tokens after the first
    over the time after the first: 1 / TPOT, prefill excluded), TTFT and inter-token percentiles (an
    event of n tokens counts as n gaps of 1/n of its interval), and stream gaps: the time between a
    stream's consecutive events, whatever their tokens - what a client waits between two outputs, where
    a stall shows at its full length (a speculative round's rejected drafts do not: its gap is a round)."""
    ttft = [first for first, _, _, _ in sequences]
    itl = [(b - a) / n for _, _, events, _ in sequences for (a, _), (b, n) in zip(events, events[1:]) for _ in range(n)]
    gaps = [b - a for _, _, events, _ in sequences for (a, _), (b, _) in zip(events, events[1:])]
    per_seq = [tokens / last for _, last, _, tokens in sequences]
    decode = [(tokens - events[0][1]) / (last - first) for first, last, events, tokens in sequences if len(events) > 1]
    out = {"seq_tokens_per_s_mean": sum(per_seq) / len(per_seq) if per_seq else None,
           "seq_decode_tokens_per_s_mean": sum(decode) / len(decode) if decode else None}
    for name, xs in (("ttft", ttft), ("itl", itl), ("gap", gaps)):
        for q in (50, 90, 99):
            out[f"{name}_p{q}_ms"] = percentile(xs, q) * 1e3 if xs else None
    return out


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    xs = sorted(xs)
    return xs[max(0, math.ceil(q / 100 * len(xs)) - 1)]


def compare(points: list[dict], spec: list[list[int]], plain: list[list[int]]) -> None:
    """Mark both points of one concurrency with how many sequences differ, and where each first
    differs (output index and both tokens), so a divergence can be replayed."""
    first = []
    for i, (a, b) in enumerate(zip(spec, plain)):
        if a != b:
            at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            first.append({"sequence": i, "position": at, "spec": a[at] if at < len(a) else None,
                          "target_only": b[at] if at < len(b) else None})
    for p in points:
        p["mismatched_sequences"] = len(first)
        p["first_differences"] = first


def explain(points: list[dict], engine, prompts: list[list[int]], outputs: list[list[int]], margin: float) -> None:
    """For each first difference of a point, the target's two most likely tokens there (one request alone
    on `engine`, target-only, over the prompt and the common prefix) and the gap between their log
    probabilities: `near_tie` when both tokens are those two and the gap is under `margin` (rounding of a
    differently shaped batch can flip such a choice; a wrong token loses by far more)."""
    for d in points[0].get("first_differences", []):
        prompt = prompts[d["sequence"] % len(prompts)]
        prefix = outputs[d["sequence"]][:d["position"]]
        done, _ = engine.generate([prompt + prefix], SamplingParams(max_new_tokens=1, logprobs=2))
        top = dict(done[0].logprobs[0].top)
        pair = [t for t in (d["spec"], d["target_only"]) if t is not None]
        gap = abs(top[pair[0]] - top[pair[1]]) if len(pair) == 2 and set(pair) <= set(top) else None
        d["top2"] = sorted(top.items(), key=lambda kv: -kv[1])
        d["gap"] = gap
        d["near_tie"] = gap is not None and gap < margin
    for p in points:
        p["near_tie_sequences"] = sum(d.get("near_tie", False) for d in p.get("first_differences", []))


TABLE_COLS = ("concurrency", "mode", "tokens_per_s", "seq_tokens_per_s_mean", "seq_decode_tokens_per_s_mean",
              "mean_accepted_length", "ttft_p50_ms",
              "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "gap_p50_ms", "gap_p99_ms", "mismatched_sequences", "near_tie_sequences",
              "kernel_loads", "device_idle_share")


def report(result: dict) -> None:
    rows = [{k: p.get(k) for k in TABLE_COLS} | _shares_cell(p) for p in result["points"]]
    print_table(f"deltaflash e2e, {result['label']}, W {result['block_size']}, "
                f"{result['max_new_tokens']} new tokens", rows)
    for name, fig in result["figures"].items():
        print(f"  {name}: {fig['value']:.3f}  (dominant phase: {fig['dominant_phase']})")
    for p in result["points"]:
        if len(p.get("tokens_per_s_runs", ())) > 1:
            print(f"  C={p['concurrency']} {p['mode']}, tokens/s of the runs (the median kept): "
                  + ", ".join(f"{x:.1f}" for x in p["tokens_per_s_runs"]))
        if p["mode"] == "spec" and p.get("by_round_width"):
            print(f"  C={p['concurrency']} spec, decode steps by round width: " + ", ".join(
                f"{w}: {g['steps']} x {g['step_p50_ms']:.2f} ms, {g['lanes_mean']:.1f} lanes, "
                f"{g['tokens_per_lane']:.2f} tokens/lane" for w, g in p["by_round_width"].items()))
        pre = p.get("prefill_steps")
        if pre and pre["steps"]:
            rows = pre.get("rows_per_token")  # (None in JSON written before it was recorded)
            print(f"  C={p['concurrency']} {p['mode']}, steps that prefilled: {pre['steps']} "
                  f"({pre['beside_a_round']} beside a round) x {pre['step_p50_ms']:.2f} ms, "
                  f"{pre['tokens_mean']:.0f} prompt tokens of a {pre['budget_mean']:.0f}-token budget beside "
                  f"{pre['lanes_mean']:.1f} lanes of {pre['round_rows_mean']:.1f} rows on average"
                  + (f", {rows:.2f} rows computed per prompt token" if rows else ""))
        if p["mode"] == "spec":
            for d in p.get("first_differences", []):
                gap = f"; log-prob gap {d['gap']:.4f}" if d.get("gap") is not None else ""
                print(f"  C={p['concurrency']}: sequence {d['sequence']} first differs at output token {d['position']} "
                      f"(speculative {d['spec']}, target-only {d['target_only']}{gap}"
                      f"{', a near-tie' if d.get('near_tie') else ''})")


def _shares_cell(point: dict) -> dict:
    shares = point.get("phase_shares")
    return {"profile": " ".join(f"{k}:{v:.0%}" for k, v in shares.items() if v >= 0.005)} if shares else {}
