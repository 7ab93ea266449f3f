"""`deltaflash bench e2e`: end-to-end decoding over a prompt set at a sweep of concurrencies,
speculative and target-only in the same run.

Closed loop: at concurrency C, C clients each keep one request in flight and send the next prompt
when theirs finishes; a point serves max(prompts, C, --requests) requests (prompts reused in order). Reported per
point: aggregate tokens/s (all output tokens / wall), per-sequence tokens/s (a sequence's tokens /
its submit-to-finish time, mean), mean accepted length, TTFT and inter-token latency percentiles
(a step's k tokens count as k gaps of 1/k of it). A profile pass (one wave of C requests on an engine
that syncs between phases) gives each phase's share of step time: prefill, draft, verify, accept,
commit, host (the rest of the step: scheduling, emitting, bookkeeping).

Workloads: `demo` (the bundled pair on held-out standard-library prompts: real acceptance) and
`scripted` (the Qwen3.5-9B shape, random bf16 weights, a *scripted* drafter replaying the target's own
greedy continuation, recorded first, with a fraction `--corrupt` of its tokens replaced: chosen
acceptance, labelled scripted everywhere). `--server URL` drives a running `deltaflash serve` instead
(bench/e2e_server.py); `--reference` adds transformers and z-lab dflash at concurrency 1
(bench/e2e_reference.py).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from deltaflash.bench.common import copy_bandwidth_gbs, machine, share_of_device, write_json
from deltaflash.bench.e2e_stats import compare, explain, latency_summary, percentile, report
from deltaflash.bundled import BUNDLED
from deltaflash.core.request import SamplingParams
from deltaflash.engine.args import (
    add_kernel_args, add_scheduler_args, add_speculation_args, check_scheduler_flags, kernel_config, scheduler_config,
    speculation_config,
)
from deltaflash.engine.config import EngineConfig
from deltaflash.engine.engine import Engine
from deltaflash.errors import DeltaflashError
from deltaflash.ops.compiles import kernel_loads

MODES = ("spec", "target-only")
PHASES = ("prefill", "draft", "verify", "accept", "commit", "host")


@dataclass
class Workload:
    """Engines and prompts of one workload. `engine(mode, profile, utilization)` builds an engine sharing
    the loaded weights, its page pool sized to `utilization` of the device (None: the serve default);
    `weight_read_s` (scripted only) is one forward's weight bytes / copy bandwidth."""

    name: str
    label: str
    prompts: list[list[int]]
    params: SamplingParams
    engine: object  # (mode: str, profile: bool, utilization: float | None) -> Engine
    block_size: int
    weight_read_s: float | None = None
    meta: dict = field(default_factory=dict)
    device: torch.device = torch.device("cpu")


@dataclass
class Trace:
    """One request as its client saw it; times in seconds from the point's start."""

    submit: float
    token_ids: list[int] = field(default_factory=list)
    event_times: list[float] = field(default_factory=list)
    event_tokens: list[int] = field(default_factory=list)
    accepted_lengths: list[int] = field(default_factory=list)


# ---- workloads ------------------------------------------------------------------------------
def _engine_config(args, max_slots: int) -> EngineConfig:
    """Both modes' engine: the serve defaults but for the kernel and scheduler flags given (speculation's
    flags are the speculative engine's alone)."""
    return EngineConfig(max_slots=max_slots, max_model_len=args.max_model_len, **kernel_config(args),
                        **scheduler_config(args))


def _demo_workload(args, max_slots: int) -> Workload:
    from deltaflash.tokenizer import encode_prompt
    from deltaflash.train.corpus import heldout_prompts, load_split

    from deltaflash.models.dflash import load_drafter
    from deltaflash.models.loader import default_device, default_dtype, load_model
    from deltaflash.tokenizer import load_tokenizer

    target, draft = Path(args.model or BUNDLED / "target"), Path(args.draft or BUNDLED / "draft")
    device = torch.device(args.device) if args.device else default_device()
    model = load_model(target, dtype=default_dtype(device), device=device, progress=False)
    cfg = model.cfg
    drafter = load_drafter(draft, target_hidden_size=cfg.hidden_size, target_vocab_size=cfg.vocab_size,
                           target_num_layers=cfg.num_layers, dtype=default_dtype(device), device=device)
    tokenizer = load_tokenizer(target)
    texts = heldout_prompts(load_split(), args.prompts, num_lines=args.prompt_lines)
    prompts = [encode_prompt(tokenizer, t) for t in texts]
    config = dataclasses.replace(_engine_config(args, max_slots), **speculation_config(args))

    def engine(mode: str, profile: bool = False, utilization: float | None = None) -> Engine:
        spec = mode == "spec"
        engine_cfg = dataclasses.replace(config, sync_phase_timing=profile, block_size=config.block_size * spec,
                                         tree_budget=config.tree_budget * spec,
                                         gpu_memory_utilization=utilization or config.gpu_memory_utilization)
        return Engine(model, tokenizer, drafter if mode == "spec" else None, engine_cfg)

    return Workload("demo", f"demo pair ({target.name} + {draft.name}), held-out stdlib prompts", prompts,
                    SamplingParams(max_new_tokens=args.max_new_tokens), engine,
                    args.block_size or drafter.config.block_size,
                    meta={"target": str(target), "draft": str(draft), "prompt_lines": args.prompt_lines,
                          **speculation_config(args)},
                    device=device)


def _scripted_workload(args, max_slots: int) -> Workload:
    from deltaflash.models.loader import default_device, load_model
    from deltaflash.models.random_init import qwen35_9b_config, random_model, weight_bytes
    from deltaflash.speculative.sources import ScriptedSource

    device = torch.device(args.device) if args.device else default_device()
    if args.model:  # a checkpoint (tests: a tiny random one)
        model, shape = load_model(args.model, device=device, progress=False), f"model {args.model}"
    else:
        model = random_model(qwen35_9b_config(args.layers), torch.bfloat16, device, copying=True)
        shape = "Qwen3.5-9B shape (random bf16 weights, copy-biased: see random_model)"
    cfg = model.cfg
    gen = torch.Generator().manual_seed(args.seed)
    if args.prompt_len_max is not None and args.prompt_len_max < args.prompt_len:
        raise DeltaflashError(f"--prompt-len-max {args.prompt_len_max} is below --prompt-len {args.prompt_len}")
    longest = args.prompt_len if args.prompt_len_max is None else args.prompt_len_max
    lengths = [args.prompt_len] * args.prompts if args.prompt_len_max is None else \
        torch.randint(args.prompt_len, longest + 1, (args.prompts,), generator=gen).tolist()
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    W = args.block_size or 16
    config = _engine_config(args, max_slots)
    spec_config = dataclasses.replace(config, **speculation_config(args))
    corrupt = corrupt_for_tau(args.tau, W) if args.tau else args.corrupt
    # the script: the target's own greedy continuation of every prompt, recorded before any timing
    recorder = Engine(model, None, None, config)
    done, _ = recorder.generate(prompts, params)
    scripts = {tuple(c.prompt_ids): c.token_ids for c in done}
    del recorder  # its page pool goes back before the measured engines size theirs (build_engines collects it)

    def engine(mode: str, profile: bool = False, utilization: float | None = None) -> Engine:
        engine_cfg = dataclasses.replace(config, sync_phase_timing=profile,
                                         gpu_memory_utilization=utilization or config.gpu_memory_utilization)
        if mode != "spec":
            return Engine(model, None, None, engine_cfg)
        return Engine(model, None, None, dataclasses.replace(spec_config, sync_phase_timing=engine_cfg.sync_phase_timing,
                                                             gpu_memory_utilization=engine_cfg.gpu_memory_utilization),
                      draft_source=ScriptedSource(scripts, W, cfg.vocab_size, corrupt, args.seed))

    _, read_bytes = weight_bytes(model)
    bandwidth = copy_bandwidth_gbs(device, 4 << 30 if device.type == "cuda" else 64 << 20)
    tau = expected_tau(corrupt, W)
    label = f"scripted drafter (target's greedy continuation, {corrupt:.1%} corrupted, expected tau {tau:.2f}), {shape}"
    return Workload("scripted", label, prompts, params, engine, W, read_bytes / (bandwidth * 1e9),
                    meta={"corrupt": corrupt, "expected_tau": tau, "shape": shape, "prompt_len": args.prompt_len,
                          "prompt_len_max": longest, **speculation_config(args),
                          "weight_read_bytes": read_bytes, "copy_bandwidth_gbs": bandwidth}, device=device)


def expected_tau(corrupt: float, block_size: int) -> float:
    """Mean accepted length of a chain of W-1 drafts, each independently correct with p = 1 - corrupt:
    1 + p + ... + p^(W-1) (ignores the few tokens cut by max_new_tokens)."""
    p = 1.0 - corrupt
    return float(block_size) if p == 1 else (1 - p ** block_size) / (1 - p)


def corrupt_for_tau(tau: float, block_size: int) -> float:
    """The corruption fraction whose expected mean accepted length is `tau` (bisection)."""
    if not 1 < tau < block_size:
        raise ValueError(f"--tau must lie in (1, {block_size}) for block size {block_size}, got {tau}")
    lo, hi = 0.0, 1.0  # expected_tau falls as corrupt rises
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tau(mid, block_size) > tau else (lo, mid)
    return (lo + hi) / 2


# ---- one point ------------------------------------------------------------------------------
def drive(engine: Engine, prompts: list[list[int]], params: SamplingParams, concurrency: int,
          requests: int) -> tuple[list[Trace], list, float]:
    """Closed loop of `concurrency` clients over `requests` requests (prompts reused in order).
    Returns (traces in request order, (step seconds, StepReport) per step, wall seconds)."""
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    traces: dict[str, Trace] = {}
    order, reports, next_index = [], [], 0
    sync()
    t0 = time.perf_counter()

    def submit():
        nonlocal next_index
        rid = engine.add_request(prompts[next_index % len(prompts)], params)
        traces[rid] = Trace(time.perf_counter() - t0)
        order.append(rid)
        next_index += 1

    while next_index < min(concurrency, requests):
        submit()
    while engine.has_work():
        ts, step_report = time.perf_counter(), []
        events = engine.step(step_report.append)
        now = time.perf_counter()
        reports.append((now - ts, step_report[0]))
        for ev in events:
            trace = traces[ev.request_id]
            if ev.token_ids:
                trace.token_ids += ev.token_ids
                trace.event_times.append(now - t0)
                trace.event_tokens.append(len(ev.token_ids))
            if ev.finish_reason and next_index < requests:
                submit()
    sync()
    wall = time.perf_counter() - t0
    return [traces[r] for r in order], reports, wall


def summarize(traces: list[Trace], steps: list, wall: float) -> dict:
    tokens = sum(len(t.token_ids) for t in traces)
    accepted = [n for _, r in steps for n in r.accepted_lengths]
    out = {"requests": len(traces), "output_tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall}
    out |= latency_summary([(t.event_times[0] - t.submit, t.event_times[-1] - t.submit,
                             list(zip(t.event_times, t.event_tokens)), len(t.token_ids)) for t in traces if t.event_times])
    out |= {"mean_accepted_length": sum(accepted) / len(accepted) if accepted else None, "rounds": len(accepted)}
    idle = [r.device_idle_s for _, r in steps if r.device_idle_s is not None]  # CUDA: the device's waits for the host
    out |= {"device_idle_s": sum(idle) if idle else None, "device_idle_share": sum(idle) / wall if idle else None,
            "device_idle_per_step_us": sum(idle) / len(idle) * 1e6 if idle else None}
    # engine.step's own wall time, for the steps that only decoded (no prompt tokens): beside the inter-token
    # latency it tells the engine's step from the time the loop around it (the clients' bookkeeping) takes
    decode_only = [s for s, r in steps if r.decode_lanes and not r.prefill_tokens]
    out |= {"steps": len(steps), "decode_step_p50_ms": 1e3 * percentile(decode_only, 50) if decode_only else None}
    out["by_round_width"] = by_round_width(steps)
    prefilling = [(s, r) for s, r in steps if r.prefill_tokens]  # the scheduler's prefill budget at work
    n = len(prefilling) or None  # (None: no step prefilled, no means)
    out["prefill_steps"] = {"steps": len(prefilling), "beside_a_round": sum(1 for _, r in prefilling if r.decode_lanes),
                            "step_p50_ms": 1e3 * percentile([s for s, _ in prefilling], 50) if n else None,
                            "tokens_mean": sum(r.prefill_tokens for _, r in prefilling) / n if n else None,
                            "budget_mean": sum(r.prefill_budget for _, r in prefilling) / n if n else None,
                            # rows computed per prompt token (a replayed graph's padding included; 1.0: none)
                            "rows_per_token": sum(r.prefill_rows for _, r in prefilling) /
                            max(1, sum(r.prefill_tokens for _, r in prefilling)) if n else None,
                            # the rounds beside them: lanes and the widest lane's rows (what a step pays beside its prefill)
                            "lanes_mean": sum(r.decode_lanes for _, r in prefilling) / n if n else None,
                            "round_rows_mean": sum(max(r.widths, default=0) for _, r in prefilling) / n if n else None}
    for path, graphed in (("graph", True), ("eager", False)):  # a replayed graph, or launches one by one
        walls = [s for s, r in prefilling if bool(r.prefill_graphed) == graphed]
        out["prefill_steps"] |= {f"{path}_steps": len(walls),
                                 f"{path}_step_p50_ms": 1e3 * percentile(walls, 50) if walls else None}
    # the slowest eager steps, what the scheduler put in them (an eager step of a small model is host-bound)
    eager = sorted(((s, r) for s, r in prefilling if not r.prefill_graphed), key=lambda sr: -sr[0])[:8]
    out["prefill_steps"]["eager_slowest"] = [
        {"ms": 1e3 * s, "prompt_tokens": r.prefill_tokens, "chunks": r.prefill_chunks, "budget": r.prefill_budget,
         "admitted": r.admitted, "decode_lanes": r.decode_lanes} for s, r in eager]
    return out


def by_round_width(steps: list) -> dict:
    """The decode-only steps grouped by their round's width (the most rows a lane verified: what the
    speculation policy chose; a tree round under "tree N", its nodes): per width, the steps, their median
    wall ms, and the mean lanes and tokens emitted per lane of those rounds - where an adaptive policy's
    choices (widths, trees or chains) and their costs can be read."""
    groups: dict[tuple[int, int], list] = {}
    for s, r in steps:
        if r.decode_lanes and not r.prefill_tokens:
            groups.setdefault((r.tree_budget, max(r.widths, default=1)), []).append((s, r))
    table = {}
    for (budget, width), rows in sorted(groups.items()):
        emitted = [n for _, r in rows for n in r.accepted_lengths]
        table[f"tree {budget}" if budget else f"W {width}"] = {"steps": len(rows), "step_p50_ms": 1e3 * percentile([s for s, _ in rows], 50),
                             "lanes_mean": sum(r.decode_lanes for _, r in rows) / len(rows),
                             "tokens_per_lane": sum(emitted) / len(emitted) if emitted else 1.0}
    return table


def phase_shares(steps: list) -> dict:
    """Share of summed step wall time per phase (PHASES); host = step time not in any phase."""
    total = {p: 0.0 for p in PHASES}
    for step_s, r in steps:
        ph = r.phases
        total["prefill"] += r.prefill_s
        spec = ph.draft_s + ph.verify_s + ph.accept_s + ph.commit_s
        if spec:
            for name in ("draft", "verify", "accept", "commit"):
                total[name] += getattr(ph, f"{name}_s")
        else:
            total["verify"] += r.decode_s  # target-only: the decode forward
        total["host"] += step_s - r.prefill_s - (spec or r.decode_s)
    whole = sum(total.values()) or 1.0
    return {p: total[p] / whole for p in PHASES}


# ---- the sweep ------------------------------------------------------------------------------
def build_engines(workload: Workload, profile: bool) -> tuple[dict, dict]:
    """The sweep's engines by mode, and their profiling twins (`profile`), built one after another in
    this process. Each sizes its page pool from the device memory in use when it is built, so on CUDA
    each is given an equal part of what the weights and the engines before it leave below the serve
    default (0.9 of the device): the first would otherwise take all of it."""
    wanted = [(mode, False) for mode in MODES] + ([(mode, True) for mode in MODES] if profile else [])
    built = {}
    for i, (mode, prof) in enumerate(wanted):
        built[mode, prof] = workload.engine(mode, prof, share_of_device(workload.device, len(wanted) - i,
                                                                        EngineConfig().gpu_memory_utilization))
    return ({m: built[m, False] for m in MODES}, {m: built[m, True] for m in MODES} if profile else {})


def sweep(workload: Workload, concurrencies: list[int], profile: bool = True, bar=None, least_requests: int = 0,
          repeats: int = 1) -> dict:
    """Every (concurrency, mode) point of one workload; spec outputs checked against target-only. A point
    serves max(prompts, C, least_requests) requests: past C, the clients' later requests run beside
    others already decoding (a steady state) instead of one wave that starts and ends together.
    `repeats`: each point runs that many times, the modes alternating (spec, target-only, spec, ...), and
    keeps the run of median tokens/s (all runs' tokens/s in `tokens_per_s_runs`): the machine's speed
    drifts between runs, and a single short wave can land on either side of it."""
    points, outputs = [], {}
    engines, profilers = build_engines(workload, profile)
    for c in concurrencies:
        requests = max(len(workload.prompts), c, least_requests)
        runs = {mode: [] for mode in MODES}
        for _ in range(repeats):
            for mode in MODES:
                if bar is not None:
                    bar.set_description(f"{workload.name} C={c} {mode}")
                runs[mode].append(_measure(engines[mode], workload, c, requests))
                if bar is not None:
                    bar.update()
        for mode in MODES:
            ranked = sorted(runs[mode], key=lambda run: run[0]["tokens_per_s"])
            point, tokens = ranked[(len(ranked) - 1) // 2]  # the median run (the lower of two middle ones)
            point = {"workload": workload.name, "concurrency": c, "mode": mode} | point
            point["tokens_per_s_runs"] = [run[0]["tokens_per_s"] for run in runs[mode]]
            if profile:
                _, prof_steps, _ = drive(profilers[mode], workload.prompts, workload.params, c, c)
                point["phase_shares"] = phase_shares(prof_steps)
            outputs[(c, mode)] = tokens
            points.append(point)
        compare(points[-2:], outputs[(c, "spec")], outputs[(c, "target-only")])
        explain(points[-2:], engines["target-only"], workload.prompts, outputs[(c, "target-only")],
                near_tie_margin(engines["target-only"]))
    return {"workload": workload.name, "label": workload.label, "block_size": workload.block_size,
            "tree_budget": workload.meta.get("tree_budget", 0),
            "max_new_tokens": workload.params.max_new_tokens, "prompts": len(workload.prompts),
            "meta": workload.meta, "points": points, "figures": figures(points, workload)}


def _measure(engine: Engine, workload: Workload, concurrency: int, requests: int) -> tuple[dict, list]:
    """One run of a point: (its summary, every request's output tokens)."""
    if engine.device.type == "cuda":  # CUDA graph capture outside the timing
        warm = SamplingParams(max_new_tokens=min(4, workload.params.max_new_tokens), ignore_eos=True)
        drive(engine, workload.prompts, warm, concurrency, concurrency)
    with kernel_loads() as loads:  # compiles inside the measured requests (should be none)
        traces, steps, wall = drive(engine, workload.prompts, workload.params, concurrency, requests)
    point = summarize(traces, steps, wall)
    # what the scheduler weighs an eager prefill step at (graph rows; measured at start on CUDA, 0 elsewhere)
    point["eager_prefill_rows"] = engine.scheduler.eager_prefill_rows
    point["kernel_loads"] = len(loads)
    point["kernels_loaded"] = sorted({name for name, _ in loads})
    point["accepted_lengths"] = [n for _, r in steps for n in r.accepted_lengths]
    return point, [t.token_ids for t in traces]


def near_tie_margin(engine: Engine) -> float:
    """Log-probability gap under which two tokens count as tied by rounding: a few units of the last place
    of the model's logits (bf16 / fp16 logits of magnitude ~10-30 step by 1/16-1/8; fp32 by ~1e-6)."""
    return 0.25 if engine.runner.dtype in (torch.bfloat16, torch.float16) else 1e-3


def figures(points: list[dict], workload: Workload) -> dict:
    """The issue's ratios, each with the phase that dominates the profile it depends on."""
    at = {(p["concurrency"], p["mode"]): p for p in points}
    figs = {}

    def add(name, value, point):
        shares = point.get("phase_shares")
        figs[name] = {"value": value, "dominant_phase": max(shares, key=shares.get) if shares else None,
                      "phase_shares": shares}

    for c in sorted({p["concurrency"] for p in points}):
        add(f"spec_over_target_only_c{c}", at[c, "spec"]["tokens_per_s"] / at[c, "target-only"]["tokens_per_s"],
            at[c, "spec"])
        for mode in MODES:  # issue 15's stall figure: a stream's slowest tokens against its typical one
            p = at[c, mode]
            if p.get("itl_p50_ms") and p.get("itl_p99_ms") is not None:
                add(f"itl_p99_over_p50_c{c}_{mode}", p["itl_p99_ms"] / p["itl_p50_ms"], p)
    if (1, "spec") in at and (16, "spec") in at:
        add("spec_aggregate_c16_over_c1", at[16, "spec"]["tokens_per_s"] / at[1, "spec"]["tokens_per_s"], at[16, "spec"])
    if workload.weight_read_s and (1, "spec") in at and at[1, "spec"]["mean_accepted_length"]:
        p = at[1, "spec"]  # (no accepted length: the adaptive policy never drafted, no limit to compare with)
        limit = p["mean_accepted_length"] / workload.weight_read_s  # tokens/s if a round cost one weight read
        add("spec_c1_over_tau_weight_read_limit", p["tokens_per_s"] / limit, p)
        if p.get("seq_decode_tokens_per_s_mean"):  # the same, prefill (time to first token) excluded
            add("spec_c1_decode_over_tau_weight_read_limit", p["seq_decode_tokens_per_s_mean"] / limit, p)
        for name in ("spec_c1_over_tau_weight_read_limit", "spec_c1_decode_over_tau_weight_read_limit"):
            if name in figs:
                figs[name]["limit_tokens_per_s"] = limit
                figs[name]["weight_read_ms"] = workload.weight_read_s * 1e3
    return figs


@torch.inference_mode()
def run(args) -> int:
    from tqdm import tqdm

    from deltaflash.bench.e2e_plots import plot

    if args.server:
        from deltaflash.bench.e2e_server import run_server

        return run_server(args)
    if args.repeats < 1:
        raise DeltaflashError(f"--repeats must be >= 1, got {args.repeats}")
    check_scheduler_flags(args)
    max_c = max(args.concurrency)
    workload = (_demo_workload if args.workload == "demo" else _scripted_workload)(args, max_c)
    with tqdm(total=len(args.concurrency) * len(MODES) * args.repeats, unit="run", disable=args.quiet) as bar:
        result = sweep(workload, args.concurrency, profile=not args.no_profile, bar=bar, least_requests=args.requests,
                       repeats=args.repeats)
    result["machine"] = machine()
    result["meta"].update(**kernel_config(args), **scheduler_config(args))  # every flag the engines were built with
    out = Path(args.out)
    report(result)
    write_json(out / f"e2e-{workload.name}.json", result)  # kept even if the reference runs are cut short
    if args.reference:
        from deltaflash.bench.e2e_reference import reference

        result["reference"] = reference(args, workload, result)
        write_json(out / f"e2e-{workload.name}.json", result)
    for path in plot(result, out):
        print(f"wrote {path}")
    # a difference at a near-tie is rounding of differently shaped batches, reported but not a failure
    unexplained = sum(p["mismatched_sequences"] - p.get("near_tie_sequences", 0)
                      for p in result["points"] if p["mode"] == "spec")
    return 0 if unexplained == 0 else 1


def register(sub) -> None:
    p = sub.add_parser("e2e", help="end-to-end concurrency sweep, speculative vs target-only (table, JSON, PNGs)")
    p.add_argument("--workload", choices=["demo", "scripted"], default="demo")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--prompts", type=int, default=32, help="distinct prompts (a point serves max(prompts, C) requests)")
    p.add_argument("--requests", type=int, default=0,
                   help="serve at least N requests per point (prompts reused): several per client, a steady state")
    p.add_argument("--repeats", type=int, default=1,
                   help="run each point N times, spec and target-only alternating, and keep the median run's "
                        "figures (the machine's speed drifts between runs)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--out", default="docs/bench", help="folder for e2e-<workload>.json and the PNGs")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--model", default=None, help="demo: target folder; scripted: a checkpoint instead of the 9B shape")
    p.add_argument("--draft", default=None, help="demo: drafter folder (default: the bundled drafter)")
    add_speculation_args(p)  # scripted: --block-size is the scripted drafter's W (default 16)
    add_kernel_args(p)
    add_scheduler_args(p)
    # a point serves max(prompts, C) requests, reusing prompts: at C = 64 and 32 prompts each would be in flight
    # twice and half of them would fork from the other's prefill, and a prompt seen before would start from the
    # prefix cache's branch point short of its end, which clients sending their own prompts pay
    p.set_defaults(share_prompts=False, prefix_cache=0)
    p.add_argument("--prompt-lines", type=int, default=12, help="demo: lines of each held-out file in its prompt")
    p.add_argument("--corrupt", type=float, default=0.1, help="scripted: fraction of drafted tokens replaced")
    p.add_argument("--tau", type=float, default=None, help="scripted: pick --corrupt for this expected accepted length")
    p.add_argument("--layers", type=int, default=32, help="scripted: layers of the 9B shape")
    p.add_argument("--prompt-len", type=int, default=256, help="scripted: tokens per random prompt")
    p.add_argument("--prompt-len-max", type=int, default=None,
                   help="scripted: prompt lengths uniform in [--prompt-len, this] (default: all --prompt-len)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-profile", action="store_true", help="skip the phase-profile pass")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="engine max_model_len (default: the serve default, the model's); trees before the paged "
                        "K/V cache ran this benchmark at the longest prompt + max-new-tokens + 1")
    p.add_argument("--reference", action="store_true",
                   help="demo: transformers generate and z-lab dflash_generate at concurrency 1, side by side")
    p.add_argument("--server", default=None, metavar="URL", help="drive a running `deltaflash serve` (demo prompts)")
    p.add_argument("--target-only-server", default=None, metavar="URL",
                   help="with --server: a second server without a drafter, measured in the same run")
    p.add_argument("--api-key", default=None)
    p.add_argument("--timeout", type=float, default=600, help="--server: seconds per point")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)
