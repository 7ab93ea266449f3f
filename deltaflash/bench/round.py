"""`deltaflash bench round`: a full speculative round of the Qwen3.5-9B (or 27B) shape (random bf16
weights, scripted drafts) at several concurrencies, as a ratio to the weight-read limit, fused vs
unfused; with --tensor-parallel-size N, over N GPUs (each rank's share of random weights: the shapes
are what counts) against one GPU's weight-read limit of its share."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch

from deltaflash.bench.common import copy_bandwidth_gbs, machine, print_table, time_ms, write_json
from deltaflash.core.request import SamplingParams, Status
from deltaflash.engine.config import EngineConfig
from deltaflash.engine.engine import Engine
from deltaflash.models.random_init import SHAPES, random_model, weight_bytes
from deltaflash.parallel.tensor import connect, shard_config
from deltaflash.speculative.sources import ScriptedSource


def decoding_engine(model, lanes: int, width: int, prompt_len: int, max_len: int, kernels: str = "auto",
                    tree_budget: int = 0, tensor_parallel=None, unwritten: bool = False,
                    skinny_gemm: str = "auto") -> Engine:
    """An engine with `lanes` sequences past prefill, drafting from a (random) script (trees of
    `tree_budget` nodes when given); `tensor_parallel`: this rank's place when the model is a share.
    `unwritten`: the prompts take their pages and lengths but are not computed (their K/V rows hold
    whatever the pool held, the GDN state stays zero): a round reads the same bytes and does the same
    arithmetic whatever the values, and 16 x 128k prompt tokens need minutes to prefill."""
    cfg = model.cfg
    source = ScriptedSource({}, width, cfg.vocab_size, seed=0)
    engine = Engine(model, None, None, EngineConfig(max_slots=lanes, max_model_len=max_len, max_num_batched_tokens=4096,
                                                    kernels=kernels, tree_budget=tree_budget, tree_max_lanes=0,
                                                    skinny_gemm=skinny_gemm),
                    draft_source=source, tensor_parallel=tensor_parallel)
    gen = torch.Generator().manual_seed(lanes)
    for _ in range(lanes):
        prompt = torch.randint(0, cfg.vocab_size, (prompt_len,), generator=gen).tolist()
        engine.add_request(prompt, SamplingParams(max_new_tokens=max_len - prompt_len - 1, ignore_eos=True))
    with _prefill_skipped(engine) if unwritten else contextlib.nullcontext():
        while any(s.status is not Status.DECODING for s in engine.scheduler.running.values()) or engine.scheduler.waiting:
            engine.step()
    return engine


@contextlib.contextmanager
def _prefill_skipped(engine):
    """Inside: a prefill chunk records its lanes' lengths and returns zeros for each lane's last row, its
    hidden state or its logits (eagerly: no prefill graph, which holds the real forward)."""
    runner, model = engine.runner, engine.runner.model
    graphs = runner.prefill_graphs

    def extend(batch, pool, kernels, tap_layer_ids=(), all_logits=False, all_hidden=False, last_hidden=False):
        if all_logits or all_hidden:
            raise ValueError("a skipped prefill returns each lane's last row alone")
        for slot, start, n in zip(batch.slot_ids_host, batch.start_host, batch.n_rows_host):
            if slot >= 0:
                pool.lengths[slot] = start + n
        L = batch.input_ids.shape[0]
        device = batch.input_ids.device
        if last_hidden:  # (the runner projects the rows it samples from)
            return torch.zeros(L, model.cfg.hidden_size, device=device, dtype=model.embed_tokens.weight.dtype), None
        return torch.zeros(L, model.cfg.vocab_size, device=device), None

    runner.prefill_graphs, model.extend = {}, extend
    try:
        yield
    finally:
        runner.prefill_graphs = graphs
        del model.extend  # the class's method again


def verify_inputs(engine) -> tuple:
    """(input_ids [L, W], slot_ids [L], start [L], kmax) of one verify forward of the engine's lanes."""
    seqs = list(engine.scheduler.running.values())
    W, dev = engine.config.block_size, engine.device
    starts = [s.position for s in seqs]
    gen = torch.Generator().manual_seed(len(seqs))  # the same ids on every rank
    return (torch.randint(0, engine.cfg.vocab_size, (len(seqs), W), generator=gen).to(dev),
            torch.tensor([s.slot for s in seqs], device=dev), torch.tensor(starts, device=dev), max(starts) + W)


def round_ms(engine, rounds: int) -> float:
    """Median wall time of engine.step() (one round over all lanes, host work included), after one
    untimed round (first-call costs: allocator growth, lazy module state)."""
    times = []
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    engine.step()
    for _ in range(rounds):
        sync()
        t0 = time.perf_counter()
        engine.step()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return times[len(times) // 2]


def run(args) -> dict | None:
    if args.tensor_parallel_size > 1:
        from deltaflash.parallel.launch import ranks

        with ranks(args.tensor_parallel_size, torch.device(args.device).type, _measure, args) as tp:
            return _measure(tp, args)  # every rank times the same rounds in step; this one (rank 0) reports
    return _measure(None, args)


@torch.inference_mode()
def _measure(tensor_parallel, args) -> dict | None:
    cfg = SHAPES[args.shape](*([args.layers] if args.layers else []))
    size, rank = (tensor_parallel.size, tensor_parallel.rank) if tensor_parallel is not None else (1, 0)
    device = torch.device(args.device)  # (cuda: this rank's, set when the group formed)
    model = random_model(shard_config(cfg, size) if size > 1 else cfg, torch.bfloat16, device)
    if size > 1:
        connect(model, rank, size, tensor_parallel.group)
    _, read_bytes = weight_bytes(model)
    bw = copy_bandwidth_gbs(device, 4 << 30 if device.type == "cuda" else 64 << 20)
    limit = read_bytes / (bw * 1e9) * 1e3
    rows, graphs, pages = [], False, {}
    for max_len in args.max_model_len:  # one model, every capacity: the rounds side by side
        for lanes in args.lanes:
            row = {"max_model_len": max_len, "lanes": lanes}
            routes = [r for r in (("fused", "triton"), ("unfused", "reference")) if r[0] in args.routes]
            for gemm in args.skinny_gemm:
                tag = gemm_tag(gemm, args.skinny_gemm)
                for name, kernels in routes:
                    engine = decoding_engine(model, lanes, args.width, args.prompt_len, max_len, kernels,
                                             args.tree_budget, tensor_parallel, args.unwritten_context, gemm)
                    graphs = engine.config.cuda_graphs
                    pages[max_len] = engine.runner.page_plan.describe(engine.config.max_model_len,
                                                                      engine.config.block_size)
                    inputs = verify_inputs(engine)
                    if not args.tree_budget:  # (a tree round's verify needs a tree: timed inside the round)
                        row[f"{name}{tag}_verify_ms"] = time_ms(lambda: engine.runner.verify(*inputs), 3, 10)
                    row[f"{name}{tag}_round_ms"] = round_ms(engine, args.rounds)
                    engine = None  # free its pool before the next engine
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
            row["weight_read_ms"] = limit
            for gemm in args.skinny_gemm:
                tag = gemm_tag(gemm, args.skinny_gemm)
                if "fused" in args.routes:
                    if not args.tree_budget:
                        row[f"verify{tag}/limit"] = row[f"fused{tag}_verify_ms"] / limit
                    row[f"round{tag}/limit"] = row[f"fused{tag}_round_ms"] / limit
                if len(args.routes) == 2:
                    row[f"unfused/fused_round{tag}"] = row[f"unfused{tag}_round_ms"] / row[f"fused{tag}_round_ms"]
            first = gemm_tag(args.skinny_gemm[0], args.skinny_gemm)
            for gemm in args.skinny_gemm[1:]:  # each GEMM choice's round against the first's
                tag = gemm_tag(gemm, args.skinny_gemm)
                route = args.routes[0]
                row[f"round{tag}/{first}"] = row[f"{route}{tag}_round_ms"] / row[f"{route}{first}_round_ms"]
            rows.append(row)
    route = args.routes[0] + gemm_tag(args.skinny_gemm[0], args.skinny_gemm)
    if len(args.max_model_len) > 1:  # does a round's cost follow the capacity? each row against the first length's
        first = {r["lanes"]: r[f"{route}_round_ms"] for r in rows if r["max_model_len"] == args.max_model_len[0]}
        for r in rows:
            r[f"round/at {args.max_model_len[0]}"] = r[f"{route}_round_ms"] / first[r["lanes"]]
    if rank:
        return None
    per = f" per rank (tensor parallel {size}: rank 0's share and bandwidth)" if size > 1 else ""
    print(f"weight bytes read per forward{per} {read_bytes / 1e9:.2f} GB; copy bandwidth {bw:.0f} GB/s; "
          f"weight-read limit {limit:.2f} ms; W = {args.width}; context {args.prompt_len}"
          f"{' (unwritten: prefill skipped)' if args.unwritten_context else ''}; CUDA graphs: "
          f"{'on' if graphs else 'off'}")
    for max_len, described in pages.items():
        print(f"max_model_len {max_len}: {described}")
    print_table(f"speculative round, Qwen3.5-{args.shape} shape{f', TP {size}' if size > 1 else ''}, random bf16 "
                "weights, scripted drafts", rows)
    result = {"machine": machine(), "shape": args.shape, "tensor_parallel_size": size, "weight_read_limit_ms": limit,
              "weight_read_bytes": read_bytes, "copy_bandwidth_gbs": bw, "rows": rows}
    write_json(args.json, result)
    return result


def gemm_tag(skinny_gemm: str, compared: list[str]) -> str:
    """The column suffix of a --skinny-gemm value among those `compared`: none for one, else [auto], [off] or
    [the table file's stem]."""
    if len(compared) == 1:
        return ""
    return f"[{skinny_gemm if skinny_gemm in ('auto', 'off') else Path(skinny_gemm).stem}]"


def register(sub) -> None:
    p = sub.add_parser("round", help="a full speculative round of the 9B / 27B shape vs the weight-read limit (CUDA)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="9b",
                   help="the model's shapes (toy: a few-MB model to try the script on the CPU)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs the target is sharded over")
    p.add_argument("--device", default="cuda", help="cuda (the point), or cpu to try the script")
    p.add_argument("--lanes", type=int, nargs="+", default=[1, 4, 16, 32])
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--layers", type=int, default=None, help="layers (default: the shape's own)")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--unwritten-context", action="store_true",
                   help="give the lanes their prompt's pages and length without computing them (long contexts "
                        "in seconds; a round's work does not depend on the values)")
    p.add_argument("--max-model-len", type=int, nargs="+", default=[1024],
                   help="capacities to time, each with the same lanes and context (several: the rounds side by side)")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--tree-budget", type=int, default=0, help="rounds verify draft trees of N nodes (0: chains of W)")
    p.add_argument("--routes", nargs="+", choices=["fused", "unfused"], default=["fused", "unfused"],
                   help="kernel sets to time (the unfused reference gathers whole tables inside CUDA graphs: slow "
                        "at long max_model_len)")
    p.add_argument("--skinny-gemm", nargs="+", default=["auto"], metavar="auto|off|TABLE",
                   help="the rounds' few-row GEMMs (engine flag --skinny-gemm); several: each timed, side by side")
    p.add_argument("--json", default=None)
    p.set_defaults(func=run)
