"""The command-line flags that build an engine (`generate`, `serve`, `bench serve`, `bench e2e`), and the
engine they describe. Checks every flag before any weight is loaded."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from deltaflash.bundled import BUNDLED
from deltaflash.cache.pages import DEFAULT_PAGE_SIZE
from deltaflash.errors import DeltaflashError


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The flags every command that builds an engine from a checkpoint takes (generate, serve, bench serve)."""
    p.add_argument("--model", help="Hugging Face checkpoint folder of the target (default: the bundled demo pair)")
    p.add_argument("--draft", help="DFlash / DFlash2 drafter folder (enables speculative decoding)")
    add_speculation_args(p)
    add_kernel_args(p)
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None,
                   help="default: bfloat16 on GPU, float32 on CPU")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="prompt + generated tokens of one request (default: the model's max_position_embeddings, "
                        "lowered to what the K/V page pool holds)")
    p.add_argument("--page-size", type=int, default=DEFAULT_PAGE_SIZE, help="token positions per K/V page")
    p.add_argument("--kv-cache-memory", type=parse_bytes, default=None, metavar="SIZE",
                   help="memory of the K/V page pool, e.g. 2GiB, 512MiB or bytes (default: 2GiB on CPU; on CUDA "
                        "what --gpu-memory-utilization leaves)")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="GPUs (or CPU processes) the target is sharded over, one process each (generate, serve; "
                        "`bench round` has its own)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of the GPU's memory the engine may use in all: weights, slot state, CUDA graphs, "
                        "activations and the K/V pages that fill the rest (default 0.9)")


def add_speculation_args(p: argparse.ArgumentParser) -> None:
    """How an engine with a drafter speculates (the engine commands and `bench e2e`)."""
    p.add_argument("--block-size", type=int, default=0, help="speculative block W (default: the drafter's)")
    p.add_argument("--speculation", choices=["auto", "adaptive", "fixed"], default="auto",
                   help="adaptive: each round verifies the width (1, powers of two, the block) that maximises expected "
                        "tokens per second from the lanes' acceptance and the measured round cost; fixed: the block; "
                        "auto (default): adaptive on CPU, fixed on CUDA (where adaptive measured slower)")
    p.add_argument("--round-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="greedy rounds (chains, or trees with --tree-budget) replay one CUDA graph each (draft, "
                        "verify, accept, commit) instead of three graphs and ~25-70 launches (default: on with CUDA "
                        "graphs and the fused kernels; --no-round-graphs or DELTAFLASH_NO_ROUND_GRAPHS=1 turns it off)")
    p.add_argument("--tree-budget", type=int, default=0,
                   help="verify draft trees of N nodes built from the drafter's block (0: its top-1 chain)")
    p.add_argument("--tree-top-k", type=int, default=4, help="candidates per depth a draft tree may branch into")
    p.add_argument("--tree-max-lanes", type=int, default=None,
                   help="with --tree-budget: rounds of more decoding lanes than this verify top-1 chains instead "
                        "(0: trees at every load; default: each round takes trees or chains by the tokens per "
                        "second each has measured at that load)")


def add_kernel_args(p: argparse.ArgumentParser) -> None:
    """Which kernels the target's products run on (the engine commands and `bench e2e`)."""
    p.add_argument("--batch-invariant", action="store_true",
                   help="the target's products through a batch-invariant Triton GEMM instead of cuBLAS, so a token's "
                        "logits never depend on what it is batched with (exact speculative == target-only on a GPU; "
                        "opt-in: its speed is not measured yet)")
    p.add_argument("--skinny-gemm", default="auto", metavar="auto|off|TABLE",
                   help="products of rounds of at most 64 rows through a split-K Triton GEMM where a table tuned on "
                        "the device (bench/tune_skinny.py) measured it faster than cuBLAS: auto (default) = the "
                        "table shipped for this GPU, if any; off = cuBLAS; or the path of a table")
    p.add_argument("--fla-tiles", default="auto", metavar="auto|off|TABLE",
                   help="launch configs of fla-core's chunked prefill kernels by rows (bench/tune_fla.py): auto "
                        "(default) = $DELTAFLASH_FLA_TILES if set, else the table shipped for this GPU, if any; off = "
                        "fla-core's autotuner; or the path of a table")


def add_scheduler_args(p: argparse.ArgumentParser) -> None:
    """How each step shares the device between the running rounds and the waiting prompts (serve, bench serve,
    bench e2e). The defaults are EngineConfig's (tests/test_cli.py holds them equal)."""
    p.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="prompt tokens one step prefills, in chunks, beside every running lane's round (which "
                        "always runs): a prompt arriving stalls the running streams by at most this much prefill")
    p.add_argument("--scale-prefill-budget", action=argparse.BooleanOptionalAction, default=None,
                   help="beside a speculative round, scale --max-num-batched-tokens by the round's measured cost "
                        "over a plain round's (up to --idle-prefill-tokens): prompts keep the share of each step "
                        "they get beside plain decoding (default: on for speculative engines of one rank)")
    p.add_argument("--max-prefill-stall", type=float, default=0.0,
                   help="beside a round, prefill at most the prompt tokens whose measured cost is this many plain "
                        "rounds (within --max-num-batched-tokens): a prompt arriving stretches a running stream's "
                        "inter-token time to about 1 + this many rounds at any load; 0: off")
    p.add_argument("--idle-prefill-tokens", type=int, default=2048,
                   help="prompt tokens one step prefills while nothing decodes (no stream to stall: larger "
                        "chunks, faster time to first token); at least --max-num-batched-tokens")
    p.add_argument("--prefix-cache", type=int, default=None, metavar="N",
                   help="prompts (of 64 tokens or more), and beginnings prompts share (a system prompt: from the "
                        "second prompt on), whose state is kept for later prompts that begin with them: an agent's "
                        "next turn prefills only what is new (a slot's GDN state each, and their K/V pages, given "
                        "back least recently used first); default: --max-concurrency; 0: off")
    p.add_argument("--share-prompts", action=argparse.BooleanOptionalAction, default=True,
                   help="a request whose prompt another is prefilling (the n samples of one prompt, the same prompt "
                        "sent twice) forks from that prefill instead of prefilling the prompt again")


def speculation_config(args) -> dict:
    """The EngineConfig fields of `add_speculation_args`' flags."""
    return {"block_size": args.block_size, "speculation": args.speculation, "round_graphs": args.round_graphs,
            "tree_budget": args.tree_budget, "tree_top_k": args.tree_top_k, "tree_max_lanes": args.tree_max_lanes}


def kernel_config(args) -> dict:
    """The EngineConfig fields of `add_kernel_args`' flags."""
    return {"batch_invariant": args.batch_invariant, "skinny_gemm": args.skinny_gemm, "fla_tiles": args.fla_tiles}


def scheduler_config(args) -> dict:
    """The EngineConfig fields of `add_scheduler_args`' flags."""
    return {"max_num_batched_tokens": args.max_num_batched_tokens, "scale_prefill_budget": args.scale_prefill_budget,
            "max_prefill_stall": args.max_prefill_stall, "idle_prefill_tokens": args.idle_prefill_tokens,
            "share_prompts": args.share_prompts, "prefix_cache": args.prefix_cache}


def given_flags(args, add: Callable[[argparse.ArgumentParser], None]) -> list[str]:
    """The flags `add` defines that `args` holds at other than their defaults, as command-line words: a
    command passing its engine flags on to a process it starts (`bench serve` -> `deltaflash serve`)."""
    parser = argparse.ArgumentParser(add_help=False)
    add(parser)
    words = []
    for action in parser._actions:
        value = getattr(args, action.dest, action.default)
        if value == action.default:
            continue
        flag = action.option_strings[0]
        if isinstance(action, argparse.BooleanOptionalAction):
            words.append(flag if value else "--no-" + flag[2:])
        elif action.nargs == 0:  # store_true
            words.append(flag)
        else:
            words += [flag, str(value)]
    return words


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6, "mib": 1 << 20,
          "g": 1 << 30, "gb": 10**9, "gib": 1 << 30, "t": 1 << 40, "tb": 10**12, "tib": 1 << 40}


def parse_bytes(text: str) -> int:
    """'2GiB', '512MiB', '1.5g', '1000000' -> bytes (argparse type: a bad value is a usage error)."""
    number = text.strip().lower().rstrip("bitgmk ") or "x"
    unit = text.strip().lower()[len(number):].strip()
    try:
        value = float(number) * _UNITS[unit]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (examples: 2GiB, 512MiB, 1000000)") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a size must be at least one byte")
    return int(value)


def check_engine_flags(args) -> None:
    """The ranges of the engine flags (before anything loads)."""
    for name, value, low in (("--max-model-len", args.max_model_len, 2), ("--block-size", args.block_size, 0),
                             ("--page-size", args.page_size, 1), ("--tree-top-k", args.tree_top_k, 1),
                             ("--tree-max-lanes", args.tree_max_lanes, 0)):
        if value is not None and value < low:
            raise DeltaflashError(f"{name} must be >= {low}, got {value}")
    if args.tree_budget and not 2 <= args.tree_budget <= 64:
        raise DeltaflashError(f"--tree-budget must be 0 or in [2, 64], got {args.tree_budget}")
    if not 0 < args.gpu_memory_utilization <= 1:
        raise DeltaflashError(f"--gpu-memory-utilization must be in (0, 1], got {args.gpu_memory_utilization}")
    if args.tensor_parallel_size < 1:
        raise DeltaflashError(f"--tensor-parallel-size must be >= 1, got {args.tensor_parallel_size}")
    if args.skinny_gemm not in ("auto", "off"):
        from deltaflash.ops.gemm.skinny import SkinnyGemms

        try:
            SkinnyGemms.load(args.skinny_gemm)
        except ValueError as e:
            raise DeltaflashError(f"--skinny-gemm {e}") from None
    if args.fla_tiles not in ("auto", "off"):
        from deltaflash.ops.gdn.fla_launch import LaunchTable

        try:
            LaunchTable.load(args.fla_tiles)
        except ValueError as e:
            raise DeltaflashError(f"--fla-tiles {e}") from None


def check_scheduler_flags(args) -> None:
    """The ranges of `add_scheduler_args`' flags (before anything loads)."""
    for name, value, low in (("--max-num-batched-tokens", args.max_num_batched_tokens, 1),
                             ("--idle-prefill-tokens", args.idle_prefill_tokens, 1),
                             ("--max-prefill-stall", args.max_prefill_stall, 0),
                             ("--prefix-cache", args.prefix_cache, 0)):
        if value is not None and value < low:
            raise DeltaflashError(f"{name} must be >= {low}, got {value}")


def engine_from_args(args, max_slots: int = 1, progress: bool = True, tensor_parallel=None, **config):
    """The engine `add_engine_args` flags describe (the bundled demo pair without --model);
    `config`: more EngineConfig fields. tensor_parallel: this rank's place when the command runs on
    --tensor-parallel-size ranks (parallel/launch.py)."""
    import torch  # here, not at module level: the command line stays quick to start

    from deltaflash.engine.engine import Engine

    check_engine_flags(args)
    if args.tensor_parallel_size > 1 and tensor_parallel is None:
        raise DeltaflashError("--tensor-parallel-size > 1 runs `deltaflash generate` and `serve` (and "
                              "`bench round`, its own flag); the other benchmarks run on one device")
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
    if args.tree_budget and args.draft is None:
        raise DeltaflashError("--tree-budget needs --draft (a drafter to speculate with)")
    if args.device is not None:
        try:
            device = torch.device(args.device)
        except RuntimeError:
            raise DeltaflashError(f"--device {args.device!r}: expected cpu, cuda or cuda:N") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise DeltaflashError(f"--device {args.device}: CUDA is not available on this machine")
    dtype = getattr(torch, args.dtype) if args.dtype else None
    return Engine.from_pretrained(args.model, args.draft, device=args.device, dtype=dtype, progress=progress,
                                  tensor_parallel=tensor_parallel, max_slots=max_slots,
                                  max_model_len=args.max_model_len, page_size=args.page_size,
                                  kv_cache_memory=args.kv_cache_memory,
                                  gpu_memory_utilization=args.gpu_memory_utilization,
                                  **speculation_config(args), **kernel_config(args), **config)
