"""`deltaflash train tokenizer|target|generate|draft|evaluate`: the bundled demo pair, trained on the stdlib.

Standalone: `python -m deltaflash.train <stage> ...`. Model code is imported inside the handlers
so that `--gdn-kernel torch` can act before transformers loads its Qwen3.5 module.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import fields
from pathlib import Path

from deltaflash.train.shapes import DrafterShape, TargetShape, default_target_layer_ids

RESERVE_SECONDS = 30.0  # kept out of --max-minutes for the final held-out evaluation and the export
TARGET_KNOBS = tuple(f.name for f in fields(TargetShape))
DRAFTER_KNOBS = ("num_layers", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim")


def register(subparsers) -> None:
    """Adds `train` with its stages to a `deltaflash` subcommand parser."""
    add_stages(subparsers.add_parser("train", help="train the bundled demo pair on the Python standard library"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m deltaflash.train", description=__doc__.splitlines()[0])
    add_stages(parser)
    args = parser.parse_args(argv)
    args.func(args)


def add_stages(parser: argparse.ArgumentParser) -> None:
    stages = parser.add_subparsers(dest="stage", required=True)

    p = stages.add_parser("tokenizer", help="byte-level BPE on the train split")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--model-max-length", type=int, default=4096)
    _add_corpus_args(p)
    p.set_defaults(func=_run_tokenizer)

    p = stages.add_parser("target", help="causal-LM training of the Qwen3.5 target")
    p.add_argument("--tokenizer", type=Path, required=True, help="folder written by `train tokenizer`")
    p.add_argument("--out", type=Path, required=True)
    _add_shape_args(p, TargetShape, TARGET_KNOBS)
    p.add_argument("--gdn-kernel", choices=("auto", "torch"), default="auto",
                   help="torch: use transformers' torch GDN reference even when fla is installed")
    _add_loop_args(p, steps=6000, lr=2e-3, batch_size=32)
    p.set_defaults(func=_run_target)

    p = stages.add_parser("generate", help="self-distillation data: the target's greedy continuations of train prompts")
    p.add_argument("--target", type=Path, required=True, help="folder written by `train target`")
    p.add_argument("--out", type=Path, required=True, help="safetensors file for the token stream")
    p.add_argument("--prompts", type=int, default=2048, help="prompts (file starts first, then random windows)")
    p.add_argument("--new-tokens", type=int, default=256, help="greedy tokens per prompt (fewer at end-of-text)")
    p.add_argument("--max-slots", type=int, default=64, help="sequences decoded together")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    _add_corpus_args(p)
    p.set_defaults(func=_run_generate)

    p = stages.add_parser("draft", help="DFlash drafter training against the frozen target")
    p.add_argument("--target", type=Path, required=True, help="folder written by `train target`")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--block-size", type=int, default=8, help="B: the anchor plus B-1 drafted tokens")
    _add_shape_args(p, DrafterShape, DRAFTER_KNOBS)
    p.add_argument("--target-layers", type=int, nargs="+", default=None,
                   help="target layer ids feeding the context (default: num-layers ids spread over 1..L-3)")
    p.add_argument("--blocks-per-seq", type=int, default=None,
                   help="anchors per sequence (default seq-len / block-size)")
    p.add_argument("--gamma", type=float, default=None, help="slot loss decay exp(-(k-1)/gamma) (default 7 B / 16)")
    p.add_argument("--labels", choices=("data", "target"), default="data",
                   help="slot k learns the corpus token (data) or the target's greedy token (target)")
    p.add_argument("--data", type=Path, nargs="+", default=None,
                   help="streams written by `train generate`, trained on together with the corpus train split")
    p.add_argument("--init", type=Path, default=None, help="start from this exported drafter (same shape)")
    p.add_argument("--gdn-kernel", choices=("auto", "torch"), default="auto")
    _add_loop_args(p, steps=6000, lr=2e-3, batch_size=32)
    p.set_defaults(func=_run_draft)

    p = stages.add_parser("evaluate", help="held-out loss of a target, teacher-forced acceptance of a drafter")
    p.add_argument("--target", type=Path, required=True)
    p.add_argument("--draft", type=Path, default=None)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--eval-tokens", type=int, default=None, help="cap on held-out tokens (default: all)")
    p.add_argument("--device", default="auto")
    p.add_argument("--gdn-kernel", choices=("auto", "torch"), default="auto")
    _add_corpus_args(p)
    p.set_defaults(func=_run_evaluate)


def _add_shape_args(p: argparse.ArgumentParser, shape_class, names: tuple[str, ...]) -> None:
    """--field-name options for the sized fields of a shape dataclass, with its defaults."""
    for field in fields(shape_class):
        if field.name in names:
            p.add_argument("--" + field.name.replace("_", "-"), type=type(field.default), default=field.default)


def _shape_kwargs(args, names: tuple[str, ...]) -> dict:
    return {name: getattr(args, name) for name in names}


def _add_corpus_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-files", type=int, default=None, help="strided subset of the stdlib files (tests)")


def _add_loop_args(p: argparse.ArgumentParser, steps: int, lr: float, batch_size: int) -> None:
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=steps, help="planned steps (fewer if --max-minutes binds)")
    p.add_argument("--max-minutes", type=float, default=None, help="wall-clock budget of the whole stage")
    p.add_argument("--lr", type=float, default=lr)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--batch-size", type=int, default=batch_size)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--eval-every", type=int, default=500,
                   help="held-out figure every N steps (0: only at the end); the best evaluated state is exported")
    p.add_argument("--eval-tokens", type=int, default=262144, help="held-out tokens per evaluation")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    _add_corpus_args(p)


def _device(name: str):
    from deltaflash.train.loop import resolve_device

    return resolve_device(name)


def _select_gdn_kernel(choice: str) -> None:
    """transformers binds fla's GDN kernels when it imports its Qwen3.5 module; hiding `fla` before keeps torch."""
    if choice == "torch":
        if "transformers.models.qwen3_5.modeling_qwen3_5" in sys.modules:
            raise RuntimeError("--gdn-kernel torch must act before transformers' Qwen3.5 module is imported")
        sys.modules["fla"] = None  # makes `import fla` fail, so transformers falls back to torch


def _loop_options(args, started: float):
    from deltaflash.train.loop import LoopOptions

    deadline = float("inf") if args.max_minutes is None else started + args.max_minutes * 60 - RESERVE_SECONDS
    return LoopOptions(steps=args.steps, lr=args.lr, warmup=args.warmup, weight_decay=args.weight_decay,
                       deadline=deadline, eval_every=args.eval_every)


def _bf16_bytes(module) -> int:
    return sum(p.numel() for p in module.parameters()) * 2  # parameters() lists tied tensors once


def _loop_report(result, args, started: float) -> dict:
    return {
        "best_step": result.best_step, "best_value": round(result.best_value, 4), "steps": result.steps,
        "planned_steps": result.planned_steps, "train_seconds": round(result.seconds, 1),
        "stage_seconds": round(time.monotonic() - started, 1),
        "tokens_seen": result.steps * args.batch_size * args.seq_len,
        "evals": [[step, round(value, 4)] for step, value in result.evals],
    }


def _args_report(args) -> dict:
    def plain(value):
        return [plain(v) for v in value] if isinstance(value, list) else str(value) if isinstance(value, Path) else value

    return {k: plain(v) for k, v in vars(args).items() if k != "func"}


def _write_report(out: Path, report: dict) -> None:
    (out / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report))


def _run_tokenizer(args) -> None:
    from deltaflash.train.corpus import encode_corpus, load_split
    from deltaflash.train.tokenizer import save_tokenizer, special_ids, train_tokenizer

    started = time.monotonic()
    split = load_split(max_files=args.max_files)
    tokenizer = train_tokenizer(split.train.texts, args.vocab_size)
    save_tokenizer(tokenizer, args.out, args.model_max_length)
    heldout = encode_corpus(tokenizer, split.heldout, special_ids(tokenizer).endoftext)
    _write_report(args.out, {
        "stage": "tokenizer", "vocab_size": tokenizer.get_vocab_size(),
        "train_files": len(split.train.paths), "train_bytes": split.train.num_bytes,
        "heldout_files": len(split.heldout.paths), "heldout_bytes": split.heldout.num_bytes,
        "heldout_bytes_per_token": round(split.heldout.num_bytes / heldout.numel(), 3),
        "seconds": round(time.monotonic() - started, 1),
    })


def _run_target(args) -> None:
    started = time.monotonic()
    _select_gdn_kernel(args.gdn_kernel)
    from deltaflash.train.corpus import token_streams
    from deltaflash.train.target import build_target, export_target, train_target
    from deltaflash.train.tokenizer import load_tokenizer, special_ids

    device = _device(args.device)
    tokenizer = load_tokenizer(args.tokenizer)
    ids = special_ids(tokenizer)
    train_tokens, heldout_tokens = token_streams(tokenizer, ids.endoftext, args.max_files)
    shape = TargetShape(**_shape_kwargs(args, TARGET_KNOBS))
    model = build_target(shape, tokenizer.get_vocab_size(), ids, args.seed)
    print(f"target: {_bf16_bytes(model) / 2**20:.2f} MiB bf16, {train_tokens.numel()} train tokens, device {device}")
    result = train_target(model, train_tokens, heldout_tokens, options=_loop_options(args, started),
                          seq_len=args.seq_len, batch_size=args.batch_size, seed=args.seed, device=device,
                          eval_tokens=args.eval_tokens)
    export_target(model, args.tokenizer, args.out)
    print(f"target: held-out loss {result.best_value:.4f} nats/token (step {result.best_step} of {result.steps})")
    _write_report(args.out, {
        "stage": "target", **_loop_report(result, args, started), "train_tokens": train_tokens.numel(),
        "bf16_bytes": _bf16_bytes(model), "args": _args_report(args),
    })


def _run_generate(args) -> None:
    from deltaflash.engine.engine import Engine
    from deltaflash.train.corpus import load_split
    from deltaflash.train.generate import generate_stream, generation_prompts, save_stream
    from deltaflash.train.tokenizer import load_tokenizer, special_ids

    started = time.monotonic()
    device = _device(args.device)
    tokenizer = load_tokenizer(args.target)
    prompts = generation_prompts(load_split(max_files=args.max_files).train, tokenizer, args.prompts, args.seed)
    max_len = max(map(len, prompts)) + args.new_tokens + 1
    engine = Engine.from_pretrained(args.target, device=device, progress=False, max_slots=args.max_slots,
                                    max_model_len=max_len)
    stream, offsets, generated = generate_stream(engine, prompts, args.new_tokens, special_ids(tokenizer).endoftext)
    report = {"stage": "generate", "target": str(args.target), "prompts": len(prompts), "tokens": stream.numel(),
              "generated_tokens": generated, "seconds": round(time.monotonic() - started, 1),
              "device": str(device), "args": _args_report(args)}
    save_stream(args.out, stream, offsets, {k: json.dumps(v) for k, v in report.items()})
    print(json.dumps(report))


def _run_draft(args) -> None:
    started = time.monotonic()
    _select_gdn_kernel(args.gdn_kernel)
    from deltaflash.train.corpus import heldout_windows, token_streams
    import torch

    from deltaflash.train.draft import (Drafter, default_gamma, export_drafter, load_drafter, teacher_forced_acceptance,
                                        train_drafter)
    from deltaflash.train.evaluate import format_acceptance
    from deltaflash.train.loop import seed_everything
    from deltaflash.train.target import load_target
    from deltaflash.train.tokenizer import load_tokenizer, special_ids

    device = _device(args.device)
    target = load_target(args.target, device)
    tokenizer = load_tokenizer(args.target)
    ids = special_ids(tokenizer)
    train_tokens, heldout_tokens = token_streams(tokenizer, ids.endoftext, args.max_files)
    if args.data:
        from deltaflash.train.generate import load_stream

        train_tokens = torch.cat([load_stream(path) for path in args.data] + [train_tokens])
    config = target.config
    layer_ids = args.target_layers or default_target_layer_ids(config.num_hidden_layers, args.num_layers)
    shape = DrafterShape(
        hidden_size=config.hidden_size, vocab_size=config.vocab_size, num_target_layers=config.num_hidden_layers,
        target_layer_ids=tuple(layer_ids),
        block_size=args.block_size, mask_token_id=ids.mask, max_position_embeddings=config.max_position_embeddings,
        **_shape_kwargs(args, DRAFTER_KNOBS),
    )
    seed_everything(args.seed)
    drafter = Drafter(shape)
    if args.init:
        initial = load_drafter(args.init, device)
        if initial.shape != shape:
            raise ValueError(f"--init {args.init}: its shape {initial.shape} differs from this run's {shape}")
        drafter.load_state_dict(initial.state_dict())
    pair_bytes = _bf16_bytes(target) + _bf16_bytes(drafter)
    print(f"draft: {_bf16_bytes(drafter) / 2**20:.2f} MiB bf16 (pair {pair_bytes / 2**20:.2f} MiB), "
          f"context layers {shape.target_layer_ids}, block {shape.block_size}, device {device}")
    result = train_drafter(
        drafter, target, train_tokens, heldout_tokens, options=_loop_options(args, started), seq_len=args.seq_len,
        batch_size=args.batch_size, blocks_per_seq=args.blocks_per_seq or args.seq_len // args.block_size,
        gamma=args.gamma or default_gamma(args.block_size), label_source=args.labels, seed=args.seed,
        device=device, eval_tokens=args.eval_tokens,
    )
    export_drafter(drafter, args.out)
    windows = heldout_windows(heldout_tokens, args.seq_len, args.eval_tokens)
    acceptance = teacher_forced_acceptance(drafter, target, windows, device)
    print(f"draft: {format_acceptance(acceptance)} (step {result.best_step} of {result.steps})")
    _write_report(args.out, {
        "stage": "draft", "acceptance": [round(a, 4) for a in acceptance], **_loop_report(result, args, started),
        "bf16_bytes": _bf16_bytes(drafter), "pair_bf16_bytes": pair_bytes, "args": _args_report(args),
    })


def _run_evaluate(args) -> None:
    _select_gdn_kernel(args.gdn_kernel)
    from deltaflash.train.evaluate import evaluate_folders, format_acceptance

    result = evaluate_folders(args.target, args.draft, _device(args.device), seq_len=args.seq_len,
                              eval_tokens=args.eval_tokens, max_files=args.max_files)
    print(f"evaluate: target {args.target}: held-out loss {result.heldout_loss:.4f} nats/token "
          f"over {result.heldout_tokens} tokens")
    if result.acceptance is not None:
        print(f"evaluate: drafter {args.draft}: {format_acceptance(result.acceptance)}")
