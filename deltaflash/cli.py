"""Command line: `deltaflash generate | serve | bench | demo | train`."""

from __future__ import annotations

import argparse
import json
import sys

from deltaflash.engine.args import add_engine_args, check_engine_flags, engine_from_args
from deltaflash.errors import DeltaflashError


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")


def _prompt_ids(text: str) -> list[int]:
    """--prompt-ids: comma-separated integers."""
    ids = []
    for item in text.split(","):
        try:
            ids.append(int(item))
        except ValueError:
            if item.strip():
                raise DeltaflashError(f"--prompt-ids: {item.strip()!r} is not an integer token id "
                                      "(give comma-separated integers, e.g. 1,2,3)") from None
    if not ids:
        raise DeltaflashError("--prompt-ids: no token ids given (give comma-separated integers, e.g. 1,2,3)")
    return ids


def cmd_generate(args) -> int:
    from deltaflash.core.request import SamplingParams
    from deltaflash.tokenizer import utf8_length

    # the prompt and the sampling flags are checked before any weight loads
    if args.prompt_ids is not None:
        _prompt_ids(args.prompt_ids)
    else:
        utf8_length(args.prompt, "--prompt")
    SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                   top_k=args.top_k, seed=args.seed, ignore_eos=args.ignore_eos).validate()
    if args.tensor_parallel_size > 1:
        import torch

        from deltaflash.parallel.launch import ranks

        check_engine_flags(args)
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        with ranks(args.tensor_parallel_size, torch.device(device).type, _generate, args) as tp:
            payload = _generate(tp, args)  # every rank generates in step; this one (rank 0) prints
    else:
        payload = _generate(None, args)
    if args.json:
        print(json.dumps(payload))
    else:
        text = payload["text"]
        print(text if text is not None else " ".join(map(str, payload["token_ids"])))
        print(json.dumps(payload["stats"]), file=sys.stderr)
    return 0


def _generate(tensor_parallel, args) -> dict:
    """One `generate` on this process's engine (a rank's, under --tensor-parallel-size): {token_ids, text,
    stats}."""
    from deltaflash.core.request import SamplingParams
    from deltaflash.tokenizer import decode, encode_chat, encode_prompt

    prompt = _prompt_ids(args.prompt_ids) if args.prompt_ids is not None else None
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, ignore_eos=args.ignore_eos)
    rank = tensor_parallel.rank if tensor_parallel is not None else 0
    engine = engine_from_args(args, progress=not args.json and rank == 0, tensor_parallel=tensor_parallel)
    tok = engine.tokenizer
    if args.chat:
        prompt = encode_chat(tok, [{"role": "user", "content": args.prompt}])
    elif args.prompt_ids is None:
        prompt = encode_prompt(tok, args.prompt)
    (done,), elapsed = engine.generate([prompt], params)
    # as the server: a stop token ends the text and is not part of it
    text_ids = done.token_ids[:-1] if done.finish_reason == "stop" else done.token_ids
    text = decode(tok, text_ids) if tok is not None else None
    stats = {
        "prompt_tokens": len(prompt),
        "generated_tokens": len(done.token_ids),
        "finish_reason": done.finish_reason,
        "elapsed_s": round(elapsed, 4),
        "tokens_per_second": round(len(done.token_ids) / elapsed, 2) if elapsed > 0 else None,
    }
    if engine.config.tensor_parallel_size > 1:
        stats.update(tensor_parallel_size=engine.config.tensor_parallel_size)
    if engine.config.speculative:
        acc = done.accepted_lengths
        stats.update(block_size=engine.config.block_size, accepted_lengths=acc,
                     mean_accepted_length=round(sum(acc) / len(acc), 3) if acc else None,
                     speculation=engine.config.speculation, round_widths=done.widths)
        if engine.config.tree_budget:
            stats.update(tree_budget=engine.config.tree_budget)
    return {"token_ids": done.token_ids, "text": text, "stats": stats}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="deltaflash", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate for one prompt")
    add_engine_args(gen)
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="raw text (tokenized as /v1/completions does)")
    src.add_argument("--prompt-ids", help="comma-separated token ids (no tokenizer needed)")
    gen.add_argument("--chat", action="store_true", help="apply the chat template to --prompt (as /v1/chat/completions)")
    _sampling_args(gen)
    gen.add_argument("--json", action="store_true", help="print one JSON object {token_ids, text, stats}")
    gen.set_defaults(func=cmd_generate)

    for register in _subcommands():
        register(sub)
    args = parser.parse_args(argv)
    if getattr(args, "chat", False) and args.prompt is None:
        parser.error("--chat needs --prompt")
    try:
        status = args.func(args)  # an exit status, or a result (benchmarks return theirs): exit 0
    except DeltaflashError as exc:
        print(f"deltaflash: error: {exc}", file=sys.stderr)
        return 2
    return status if isinstance(status, int) else 0


def _subcommands():
    """`register(subparsers)` of the subcommands living in their own modules (imports stay light:
    each module imports its heavy dependencies only when its command runs)."""
    from deltaflash import demo
    from deltaflash.bench import cli as bench
    from deltaflash.server import cli as server
    from deltaflash.train import cli as train

    return (server.register, bench.register, demo.register, train.register)


if __name__ == "__main__":
    sys.exit(main())
