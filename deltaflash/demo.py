"""`deltaflash demo`: the bundled demo pair on held-out standard-library prompts, target-only and
speculative side by side in one process (text, mean accepted length, tokens/s, speedup)."""

from __future__ import annotations

from pathlib import Path

from deltaflash.bundled import BUNDLED
from deltaflash.errors import DeltaflashError


def run(args) -> int:
    import torch

    from deltaflash.core.request import SamplingParams
    from deltaflash.engine.engine import Engine
    from deltaflash.tokenizer import encode_prompt
    from deltaflash.train.corpus import heldout_prompts, load_split

    model, draft = Path(args.model or BUNDLED / "target"), Path(args.draft or BUNDLED / "draft")
    for folder in (model, draft):
        if not (folder / "config.json").is_file():
            raise DeltaflashError(f"{folder}: no checkpoint there; the demo pair is trained with bench/train_demo_pair.sh")
    device = torch.device(args.device) if args.device else None
    if device is not None and device.type == "cuda" and not torch.cuda.is_available():
        raise DeltaflashError(f"--device {args.device}: CUDA is not available on this machine")
    # engines compile their kernels and capture their CUDA graphs when built, not inside a request
    plain = Engine.from_pretrained(model, device=device, progress=False, max_slots=1, max_model_len=2048)
    spec = Engine.from_pretrained(model, draft, device=device, progress=False, max_slots=1, max_model_len=2048)
    tok = plain.tokenizer
    prompts = heldout_prompts(load_split(), args.prompts, num_lines=args.prompt_lines)
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    print(f"deltaflash demo on {plain.device}: target {model}, drafter {draft} (block {spec.config.block_size}); "
          f"engines ready in {plain.startup_s:.1f} s + {spec.startup_s:.1f} s (kernels compiled, CUDA graphs "
          f"captured)\n")
    totals = {"plain": 0.0, "spec": 0.0, "tokens": 0, "rounds": [], "same": True}
    for i, text in enumerate(prompts):
        ids = encode_prompt(tok, text)
        (a,), t_plain = plain.generate([ids], params)
        (b,), t_spec = spec.generate([ids], params)
        same = a.token_ids == b.token_ids
        totals["plain"] += t_plain
        totals["spec"] += t_spec
        totals["tokens"] += len(b.token_ids)
        totals["rounds"] += b.accepted_lengths
        totals["same"] &= same
        mean = sum(b.accepted_lengths) / max(len(b.accepted_lengths), 1)
        print(f"--- prompt {i + 1} (held-out) ---\n{text}\n--- completion ---\n{tok.decode(b.token_ids)}")
        print(f"--- target-only {len(a.token_ids) / t_plain:7.1f} tok/s | speculative {len(b.token_ids) / t_spec:7.1f} tok/s "
              f"| mean accepted length {mean:.2f} | speedup {t_plain / t_spec:.2f}x | identical output: {same}\n")
    mean = sum(totals["rounds"]) / max(len(totals["rounds"]), 1)
    print(f"all prompts: mean accepted length {mean:.2f}, speedup {totals['plain'] / totals['spec']:.2f}x "
          f"({totals['tokens']} tokens), speculative output identical to target-only: {totals['same']}")
    return 0 if totals["same"] else 1


def register(sub) -> None:
    p = sub.add_parser("demo", help="the bundled demo pair, target-only vs speculative, side by side")
    p.add_argument("--model", default=None, help="target folder (default: the bundled demo target)")
    p.add_argument("--draft", default=None, help="drafter folder (default: the bundled demo drafter)")
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--prompt-lines", type=int, default=12)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--device", default=None)
    p.set_defaults(func=run)
