"""How many long sequences one device holds, and a point that serves that many at once (issue 14).

Usage: python bench/capacity.py [--context 32768] [--new-tokens 64] [--slots 64] [--model FOLDER] [--json FILE]

Builds one target-only engine - the Qwen3.5-9B shape with random bf16 weights, or a checkpoint folder
(`--model`) - at the serve defaults (K/V pool sized by 0.9 of the device, page size 16) but for
`--slots` slots and a context of `--context` prompt tokens + `--new-tokens`. Reports the page plan: the
pool's budget, its pages, and how many sequences of that length fit by memory. Then it admits as many
random prompts of `--context` tokens as fit (at most the slots) all at once, runs them to completion and
reports wall time, output tokens/s, TTFT p50 / p99, preemptions, and whether every request finished with
all its tokens (the issue's bar: no crash, no preemption storm).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from deltaflash.core.request import SamplingParams
from deltaflash.engine.config import EngineConfig
from deltaflash.engine.engine import Engine


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=32768, help="prompt tokens per sequence")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--slots", type=int, default=64, help="sequences served together at most")
    p.add_argument("--model", default=None, help="a checkpoint folder instead of the 9B shape")
    p.add_argument("--layers", type=int, default=32, help="layers of the 9B shape")
    p.add_argument("--device", default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args()

    from deltaflash.models.loader import default_device, load_model
    from deltaflash.models.random_init import qwen35_9b_config, random_model

    device = torch.device(args.device) if args.device else default_device()
    torch.set_grad_enabled(False)
    if args.model:
        model, shape = load_model(args.model, device=device, progress=False), args.model
    else:
        model, shape = random_model(qwen35_9b_config(args.layers), torch.bfloat16, device), "Qwen3.5-9B shape"
    length = args.context + args.new_tokens
    t0 = time.perf_counter()
    engine = Engine(model, None, None, EngineConfig(max_slots=args.slots, max_model_len=length))
    startup_s = time.perf_counter() - t0
    plan, config = engine.runner.page_plan, engine.config
    per_sequence = -(-(length + config.reach) // plan.page_size)
    by_memory = plan.budget_bytes // plan.page_bytes // per_sequence
    served = min(by_memory, args.slots, plan.num_pages // per_sequence)
    print(f"{shape} on {device}: {plan.describe(config.max_model_len, config.block_size)}")
    print(f"pool budget {plan.budget_bytes / 2**30:.1f} GiB ({plan.source}): {by_memory} sequences of "
          f"{args.context} + {args.new_tokens} tokens fit by memory; serving {served} at once "
          f"({args.slots} slots); engine built in {startup_s:.1f} s")

    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, model.cfg.vocab_size, (args.context,), generator=gen).tolist() for _ in range(served)]
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    arrival = {engine.add_request(prompt, params): t0 for prompt in prompts}
    first, tokens, finished, steps = {}, {rid: 0 for rid in arrival}, {}, 0
    while engine.has_work():
        events = engine.step()
        now = time.perf_counter()
        steps += 1
        for ev in events:
            if ev.token_ids:
                first.setdefault(ev.request_id, now - arrival[ev.request_id])
                tokens[ev.request_id] += len(ev.token_ids)
            if ev.finish_reason:
                finished[ev.request_id] = ev.finish_reason
    sync()
    wall = time.perf_counter() - t0
    ttft = sorted(first.values())
    complete = all(finished.get(rid) == "length" and tokens[rid] == args.new_tokens for rid in arrival)
    result = {
        "shape": shape, "device": str(device), "context": args.context, "new_tokens": args.new_tokens,
        "slots": args.slots, "pages": plan.num_pages, "page_size": plan.page_size,
        "pool_gib": plan.num_pages * plan.page_bytes / 2**30, "budget_gib": plan.budget_bytes / 2**30,
        "fit_by_memory": by_memory, "served": served, "startup_s": startup_s, "wall_s": wall, "steps": steps,
        "output_tokens_per_s": sum(tokens.values()) / wall,
        "ttft_p50_s": ttft[len(ttft) // 2] if ttft else None, "ttft_p99_s": ttft[int(0.99 * (len(ttft) - 1))] if ttft else None,
        "preemptions": engine.stats["preemptions"], "all_complete": complete,
    }
    print(f"served {served} x {args.context} tokens: {wall:.1f} s, {steps} steps, "
          f"{result['output_tokens_per_s']:.0f} output tokens/s, TTFT p50 {result['ttft_p50_s']:.2f} s / "
          f"p99 {result['ttft_p99_s']:.2f} s, preemptions {result['preemptions']}, every request complete: {complete}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0 if complete else 1


if __name__ == "__main__":
    raise SystemExit(main())
