"""The command-line flags that build an engine (`generate`, `serve`, `bench serve`), and the engine
they describe. Checks every flag before any weight is loaded."""

from __future__ import annotations

import argparse
from pathlib import Path

from deltaflash.bundled import BUNDLED
from deltaflash.errors import DeltaflashError


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The flags every command that builds an engine takes (generate, serve, bench serve)."""
    p.add_argument("--model", help="Hugging Face checkpoint folder of the target (default: the bundled demo pair)")
    p.add_argument("--draft", help="DFlash / DFlash2 drafter folder (enables speculative decoding)")
    p.add_argument("--block-size", type=int, default=0, help="speculative block W (default: the drafter's)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None,
                   help="default: bfloat16 on GPU, float32 on CPU")
    p.add_argument("--max-model-len", type=int, default=4096)


def engine_from_args(args, max_slots: int = 1, progress: bool = True, **config):
    """The engine `add_engine_args` flags describe (the bundled demo pair without --model);
    `config`: more EngineConfig fields."""
    import torch  # here, not at module level: the command line stays quick to start

    from deltaflash.engine.engine import Engine

    if args.model is None:
        args.model = str(BUNDLED / "target")
        if args.draft is None and (BUNDLED / "draft").is_dir():
            args.draft = str(BUNDLED / "draft")
    if not Path(args.model, "config.json").is_file():
        raise DeltaflashError(f"--model {args.model}: no config.json there (give a Hugging Face checkpoint folder)")
    if args.draft is not None and not Path(args.draft, "config.json").is_file():
        raise DeltaflashError(f"--draft {args.draft}: no config.json there (give a DFlash drafter folder)")
    if args.block_size and args.draft is None:
        raise DeltaflashError("--block-size needs --draft (a drafter to speculate with)")
    if args.device is not None:
        try:
            device = torch.device(args.device)
        except RuntimeError:
            raise DeltaflashError(f"--device {args.device!r}: expected cpu, cuda or cuda:N") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise DeltaflashError(f"--device {args.device}: CUDA is not available on this machine")
    dtype = getattr(torch, args.dtype) if args.dtype else None
    return Engine.from_pretrained(args.model, args.draft, device=args.device, dtype=dtype, progress=progress,
                                  max_slots=max_slots, max_model_len=args.max_model_len, block_size=args.block_size,
                                  **config)
