"""Where do two greedy runs of the same prompts part on a GPU? The first token of each prompt (its
prefill's last row) from the engine under several configurations (graphs, kernels, batch-invariant
products, batch mates, repeats), against transformers' own forward of that prompt.

    python bench/diagnose_prefill.py [--kinds moe dense_gqa] [--device cuda] [--per-op]

(It found the paged attention kernel reading context_lens, a strided column of the positions, at unit
stride: every lane but the first attended from another lane's start, on the GPU past its written keys.)

Prints, per prompt, the first token and its log probability under each configuration, and the gap to
transformers' log probability of the same token; a configuration whose token differs is marked."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path

import torch

if not torch.cuda.is_available():  # transformers would call fla's GPU kernels on CPU tensors
    sys.modules.setdefault("fla", None)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deltaflash.core.request import SamplingParams  # noqa: E402
from deltaflash.engine.config import EngineConfig  # noqa: E402
from deltaflash.engine.engine import Engine  # noqa: E402
from deltaflash.models.dflash import load_drafter  # noqa: E402
from deltaflash.models.loader import load_model  # noqa: E402
from tests.checkpoints import build_hf_model, save_checkpoint  # noqa: E402
from tests.spec_pairs import prompts, save_drafter  # noqa: E402

PURE_OPS = ("zero_centered_rms_norm", "gated_rms_norm", "moe_experts", "paged_attention")
CHECKS: list[tuple[str, tuple, float]] = []  # (op, shape of its first argument, max |triton - reference|)


def mixed_kernels(reference_ops=(), check=False):
    """The triton set with `reference_ops` swapped for the pure-torch ones; with `check`, every pure op
    also runs the reference on the same inputs and records the largest difference in CHECKS."""
    from deltaflash.ops.kernels import reference_kernels, triton_kernels

    fused, ref = triton_kernels(), reference_kernels()
    swaps = {name: getattr(ref, name) for name in reference_ops}
    if check:
        def checked(name):
            def op(*args, **kwargs):
                got = getattr(fused, name)(*args, **kwargs)
                want = getattr(ref, name)(*args, **kwargs)
                CHECKS.append((name, tuple(args[0].shape), float((got.float() - want.float()).abs().max())))
                return got
            return op
        swaps |= {name: checked(name) for name in PURE_OPS if name not in reference_ops}
    return dataclasses.replace(fused, **swaps)


FIRST = SamplingParams(max_new_tokens=8, ignore_eos=True, logprobs=3)


def first_tokens(folder, device, batch, draft=None, kernels=None, **config):
    """(first token, its top log probabilities) per prompt of `batch`, generated together; `kernels`:
    a Kernels set for the engine's runner instead of the configured one."""
    if kernels is not None:
        import deltaflash.engine.runner as runner

        named, runner.kernels_named = runner.kernels_named, lambda name: kernels
        try:
            return first_tokens(folder, device, batch, draft, **config)
        finally:
            runner.kernels_named = named
    config = {"max_slots": 8, "max_model_len": 256, "speculation": "fixed"} | config
    model = load_model(folder, device=device, dtype=torch.float32, progress=False)
    drafter = None
    if draft is not None:
        drafter = load_drafter(draft, target_hidden_size=model.cfg.hidden_size, target_vocab_size=model.cfg.vocab_size,
                               target_num_layers=model.cfg.num_layers, dtype=torch.float32, device=device)
    done, _ = Engine(model, None, drafter, EngineConfig(**config)).generate(batch, FIRST)
    return [(c.token_ids[0], dict(c.logprobs[0].top)) for c in done]


def reference(hf, batch, device):
    out = []
    for p in batch:
        with torch.no_grad():
            logits = hf(torch.tensor([p], device=device)).logits[0, -1].float()
        out.append(torch.log_softmax(logits, -1))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kinds", nargs="+", default=["moe", "dense_gqa"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--per-op", action="store_true",
                    help="also the fused set with one op at a time swapped for the reference, and a pass that "
                         "checks every pure op against the reference on its live inputs (CPU: TRITON_INTERPRET=1)")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp())
    cuda = args.device == "cuda"
    configs = {"default": {}, "no-graphs": {"cuda_graphs": False} if cuda else {},
               "reference-kernels": {"kernels": "reference", "cuda_graphs": False} if cuda else {},
               "batch-invariant": {"batch_invariant": True} if cuda else {},
               "chunk-8": {"max_num_batched_tokens": 8, "idle_prefill_tokens": 8}, "slots-1": {"max_slots": 1}, "slots-3": {"max_slots": 3}}
    for kind in args.kinds:
        hf = build_hf_model(kind, seed=0)
        folder = save_checkpoint(hf, root / kind)
        draft = save_drafter(root / f"{kind}-draft", load_model(folder, device="cpu", progress=False).cfg)
        hf = hf.to(args.device)
        for lengths, seed in (([3, 10, 17], 3), ([4, 9, 15, 22, 30, 6, 12, 17], 4), ([30] * 8, 6)):
            batch = prompts(hf.config.vocab_size, lengths, seed=seed)
            ref = reference(hf, batch, args.device)
            print(f"\n{kind}, prompts of {lengths} (seed {seed}); transformers' top-2 per prompt:")
            for i, lp in enumerate(ref):
                top = torch.topk(lp, 2)
                print(f"  prompt {i}: {top.indices.tolist()} {[round(v, 4) for v in top.values.tolist()]}")
            runs = {name: first_tokens(folder, args.device, batch, **cfg) for name, cfg in configs.items()}
            runs["default-again"] = first_tokens(folder, args.device, batch)
            runs["drafter"] = first_tokens(folder, args.device, batch, draft)
            runs["drafter-slots-3"] = first_tokens(folder, args.device, batch, draft, max_slots=3)
            if args.per_op:
                for op in PURE_OPS:
                    runs[f"ref-{op}"] = first_tokens(folder, args.device, batch, kernels=mixed_kernels([op]),
                                                     cuda_graphs=False)
                CHECKS.clear()
                runs["checked"] = first_tokens(folder, args.device, batch, kernels=mixed_kernels(check=True),
                                               cuda_graphs=False)  # CHECKS counts padding rows too
            runs["each-alone"] = [first_tokens(folder, args.device, [p])[0] for p in batch]
            for name, got in runs.items():
                cells = []
                for i, (tok, top) in enumerate(got):
                    want = int(torch.argmax(ref[i]))
                    gap = top[tok] - float(ref[i][tok])
                    cells.append(f"{'*' if tok != want else ' '}{tok}({gap:+.1e})")
                print(f"  {name:26s} " + " ".join(cells))
            worst = {}
            for name, shape, diff in CHECKS:
                if diff > worst.get(name, (-1.0,))[0]:
                    worst[name] = (diff, shape)
            for name, (diff, shape) in worst.items():
                print(f"  checked {name}: largest |triton - reference| {diff:.2e} (first argument {shape})")


if __name__ == "__main__":
    main()
