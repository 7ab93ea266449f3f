"""An agent's turns, or questions after one system prompt, with the prefix cache against without, alternated.

    python3 bench/prefix_turns.py [--shape 9b|27b|toy] [--prompt-len 2048] [--turns 4] [--added 128] [--repeats 2]
                                  [--system | --answers] [--new 32]

The 9B shape's target (random bf16 weights; CUDA) or the toy shape's (any device), target-only, the serve
defaults (max_model_len the model's 262,144) but for a 10 GiB page pool each (two engines share the device): one request per turn,
greedy, `new` new tokens; turn 1 is a random prompt, each next turn that prompt and `added` more tokens (the
answer and a tool's result, random here). With --answers each next turn carries the previous answer back, as a
chat client does: the previous prompt, its answer, then `added` random tokens (a finished request's state is kept,
so only those are prefilled). With --system each turn's prompt is instead that random prompt (a system prompt)
and `added` tokens of its own (a question): the second stops its prefill at their branch point, the later ones
start there. Prints each turn's time to first token by mode (medians), the prompt tokens prefilled,
and the ratio without / with from turn 2 on.
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


def turns(engine: Engine, prompts: list[list[int]], new: int, answers: bool) -> tuple[list[float], int]:
    """(TTFT ms of each prompt run alone in order, prompt tokens prefilled). answers: prompts[0] is the first
    turn's and each later one what its turn adds after the previous prompt and that prompt's answer."""
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    engine.scheduler.clear_prefix_cache()
    engine.stats["prefill_tokens"] = 0
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    ttft, previous = [], []
    for prompt in prompts:
        if answers:
            prompt = previous + prompt
        sync()
        t0 = time.perf_counter()
        request = engine.add_request(prompt, params)
        first, answer = None, []
        while engine.has_work():
            events = engine.step()
            if first is None and any(ev.token_ids for ev in events):
                first = time.perf_counter() - t0
            answer += [t for ev in events if ev.request_id == request for t in ev.token_ids]
        ttft.append(1e3 * first)
        previous = prompt + answer
    return ttft, engine.stats["prefill_tokens"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="9b")
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--added", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--new", type=int, default=32, help="new tokens a turn (its answer)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--system", action="store_true", help="each turn the first prompt and a question of its own")
    mode.add_argument("--answers", action="store_true", help="each turn carries the previous answer back")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    device = torch.device(args.device)
    cfg = SHAPES[args.shape]()
    model = random_model(cfg, torch.bfloat16 if device.type == "cuda" else torch.float32, device, copying=True)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, cfg.vocab_size, (args.prompt_len,), generator=g).tolist()
    def more() -> list[int]:
        return torch.randint(0, cfg.vocab_size, (args.added,), generator=g).tolist()
    if args.system:
        prompts = [prompt + more() for _ in range(args.turns)]
    elif args.answers:  # (each turn's answer goes in between at run time)
        prompts = [prompt] + [more() for _ in range(args.turns - 1)]
    else:
        prompts = [prompt]
        for _ in range(args.turns - 1):
            prompts.append(prompts[-1] + more())
    engines = {cache: Engine(model, None, None, EngineConfig(kv_cache_memory=10 << 30,
                                                             prefix_cache=None if cache else 0))
               for cache in (False, True)}
    runs: dict[bool, list] = {False: [], True: []}
    for _ in range(args.repeats):
        for cache in (False, True):
            runs[cache].append(turns(engines[cache], prompts, args.new, args.answers))
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    pattern = f"each a {args.prompt_len}-token system prompt and {args.added} tokens of its own" if args.system \
        else f"{args.prompt_len} tokens, then +{args.added} a turn" + (" after the answer" if args.answers else "")
    print(f"{name}: {args.shape} shape, target-only, {args.turns} turns: {pattern}, {args.new} new tokens each, "
          f"{args.repeats} alternated runs (medians)")
    med = {c: [statistics.median(r[0][i] for r in runs[c]) for i in range(args.turns)] for c in runs}
    for cache in (False, True):
        label = "prefix cache" if cache else "--prefix-cache 0"
        print(f"  {label:17s}: TTFT by turn " + ", ".join(f"{t:.1f}" for t in med[cache])
              + f" ms; prefilled {runs[cache][0][1]} tokens")
    later = [off / on for off, on in zip(med[False][1:], med[True][1:])]
    print("  without / with, turns 2..: " + ", ".join(f"{r:.2f}x" for r in later))


if __name__ == "__main__":
    main()
