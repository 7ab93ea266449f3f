"""n samples of one prompt with prompt sharing (forks from one prefill) against without, alternated in one run;
or n questions after one system prompt with the prefix cache against without.

    python3 bench/prompt_forks.py [--shape 9b|27b|toy] [--prompt-len 2048] [--n 8] [--new 64] [--repeats 2]
                                  [--questions Q] [--others K]

The 9B shape's target (random bf16 weights; CUDA) or the toy shape's (any device), target-only, the serve
defaults (max_model_len the model's 262,144) but for a 10 GiB page pool each (two engines share the device),
max(8, n) slots and, comparing forks, the prefix cache off: `n` greedy requests of
one prompt added at once, to completion. With --questions Q each request's prompt is that prompt (a system
prompt) and Q random tokens of its own, and the modes are the prefix cache on and off (the first prompt's
prefill stops where they part, the others start there). Prints per mode the time to the first token of the first
and of the last request, the wall time, and the prefill tokens the engine computed; then the ratios (without /
with). Each run starts with nothing kept. --others K adds K requests of prompts of their own (prompt-len random
tokens) after the n, at once, and prints their median time to first token: whether they wait behind requests
that wait for another's prefill (slots: max(8, n + K)).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from deltaflash.core.request import SamplingParams
from deltaflash.engine.config import EngineConfig
from deltaflash.engine.engine import Engine
from deltaflash.models.random_init import SHAPES, random_model


def one_run(engine: Engine, prompts: list[list[int]], new: int, others: int = 0) -> dict:
    """The prompts added at once, run to completion; the last `others` of them are reported on their own."""
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    engine.scheduler.clear_prefix_cache()
    for key in engine.stats:
        engine.stats[key] = 0
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    sync()
    t0 = time.perf_counter()
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    first: dict[str, float] = {}
    while engine.has_work():
        events = engine.step()
        now = time.perf_counter() - t0
        for ev in events:
            if ev.token_ids and ev.request_id not in first:
                first[ev.request_id] = now
    sync()
    wall = time.perf_counter() - t0
    ttft = sorted(first[i] for i in ids[:len(ids) - others])
    others_ms = 1e3 * statistics.median(first[i] for i in ids[len(ids) - others:]) if others else 0.0
    return {"ttft_first_ms": 1e3 * ttft[0], "ttft_last_ms": 1e3 * ttft[-1], "ttft_others_ms": others_ms,
            "wall_ms": 1e3 * wall,
            "prefill_tokens": engine.stats["prefill_tokens"],
            "shared_tokens": engine.stats["shared_prompt_tokens"] + engine.stats["cached_prompt_tokens"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="9b")
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--questions", type=int, default=0, metavar="Q",
                   help="each prompt the prompt and Q tokens of its own; the prefix cache on against off")
    p.add_argument("--others", type=int, default=0, metavar="K", help="K more requests of prompts of their own")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    device = torch.device(args.device)
    cfg = SHAPES[args.shape]()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = random_model(cfg, dtype, device, copying=True)
    option = "prefix_cache" if args.questions else "share_prompts"

    def config(on: bool) -> EngineConfig:
        """The mode's option on or off (forks: the prefix cache off in both, whose branch points would share too)."""
        mode = {"prefix_cache": None if on else 0} if args.questions else {"share_prompts": on, "prefix_cache": 0}
        return EngineConfig(max_slots=max(8, args.n + args.others), kv_cache_memory=10 << 30, **mode)
    engines = {on: Engine(model, None, None, config(on)) for on in (False, True)}
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, cfg.vocab_size, (args.prompt_len,), generator=g).tolist()
    prompts = [prompt + torch.randint(0, cfg.vocab_size, (args.questions,), generator=g).tolist()
               for _ in range(args.n)]
    prompts += [torch.randint(0, cfg.vocab_size, (args.prompt_len,), generator=g).tolist() for _ in range(args.others)]
    runs: dict[bool, list[dict]] = {False: [], True: []}
    for _ in range(args.repeats):
        for on in (False, True):
            runs[on].append(one_run(engines[on], prompts, args.new, args.others))
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    what = f"one {args.prompt_len}-token prompt" if not args.questions else \
        f"one {args.prompt_len}-token system prompt and {args.questions} tokens of their own"
    also = f" and {args.others} of {args.prompt_len}-token prompts of their own" if args.others else ""
    print(f"{name}: {args.shape} shape, target-only, {args.n} greedy requests of {what}{also}, {args.new} new tokens "
          f"each, {args.repeats} alternated runs (medians)")
    med = {on: {k: statistics.median(r[k] for r in runs[on]) for k in runs[on][0]} for on in runs}
    for on in (False, True):
        m = med[on]
        print(f"  {option}={'on' if on else 'off':3}: TTFT first {m['ttft_first_ms']:8.1f} ms, last "
              f"{m['ttft_last_ms']:8.1f} ms, wall {m['wall_ms']:8.1f} ms, prefilled {m['prefill_tokens']:6.0f} "
              f"tokens, {'cached' if args.questions else 'forked'} {m['shared_tokens']:6.0f}"
              + (f"; the others' TTFT {m['ttft_others_ms']:8.1f} ms" if args.others else ""))
    off, on = med[False], med[True]
    print(f"  without / with: TTFT of the last {off['ttft_last_ms'] / on['ttft_last_ms']:.2f}x, "
          f"wall {off['wall_ms'] / on['wall_ms']:.2f}x")
    for on in (False, True):
        each = ", ".join(f"{r['ttft_last_ms']:.1f}/{r['wall_ms']:.1f}" for r in runs[on])
        print(f"  runs {option}={'on' if on else 'off'}: {each}")


if __name__ == "__main__":
    main()
