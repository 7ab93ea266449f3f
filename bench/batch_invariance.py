"""Which ops make a row's bits depend on the batch around it? (CUDA; prints, decides nothing.)

Speculative greedy output equals target-only's only if the target gives a row the same logits whether
it is verified with other rows and lanes or decoded alone. For the tiny test models (fp32 and bf16) this
runs one lane's row 0 through the eager verify forward at several (lanes, rows) shapes with forward hooks
on every module, and names the first module whose output for that row differs from the one-lane,
one-row forward, with cuBLAS and with the batch-invariant GEMM (ops/gemm); then the cuBLAS products of
the 9B shape, row 0 of M rows against M = 1, and the invariant GEMM's speed against cuBLAS there.
    python bench/batch_invariance.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deltaflash.core.batch import ExtendBatch  # noqa: E402
from deltaflash.engine.config import EngineConfig  # noqa: E402
from deltaflash.engine.engine import Engine  # noqa: E402
from deltaflash.models.loader import load_model  # noqa: E402
from tests.checkpoints import build_hf_model, save_checkpoint  # noqa: E402
from tests.spec_pairs import give_pages, prompts  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a dry run on the reference kernels

SHAPES = [(1, 1), (1, 2), (8, 1), (8, 8)]


def row_outputs(engine, L: int, W: int, slots, starts) -> dict[str, torch.Tensor]:
    runner, seen = engine.runner, {}

    def hook(name):
        def record(module, args, out):
            out = out[0] if isinstance(out, tuple) else out
            if not isinstance(out, torch.Tensor) or out.dim() < 1:
                return
            if out.dim() >= 2 and tuple(out.shape[:2]) == (L, W):
                seen[name] = out[0, 0].detach().float().cpu().clone()
            elif out.shape[0] == L * W:
                seen[name] = out[0].detach().float().cpu().clone()
        return record

    handles = [m.register_forward_hook(hook(n)) for n, m in runner.model.named_modules() if n]
    g = torch.Generator().manual_seed(L * 100 + W)
    ids = torch.randint(0, 96, (L, W), generator=g)
    ids[0, 0] = 5
    with torch.inference_mode():
        logits = runner._verify_rows(ids.to(DEVICE), torch.tensor(slots[:L], device=DEVICE),
                                     torch.tensor(starts[:L], device=DEVICE))[0]
    for h in handles:
        h.remove()
    seen["<logits>"] = logits[0, 0].float().cpu()
    return seen


def gdn_pieces(engine, L: int, W: int, slots) -> dict[str, torch.Tensor]:
    """Row 0 of lane 0 after each step of the first GDN layer's verify (projection GEMM, conv, recurrence)."""
    runner = engine.runner
    layer = next(m for m in runner.model.layers if m.is_gdn).linear_attn
    g = torch.Generator().manual_seed(L * 100 + W)
    x = torch.randn(L, W, runner.model.cfg.hidden_size, generator=g)
    x[0, 0] = torch.randn(runner.model.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    x = x.to(DEVICE, runner.dtype)
    slot_ids = torch.tensor(slots[:L], device=DEVICE)
    parents = (torch.arange(W, device=DEVICE) - 1).expand(L, W).contiguous()
    pool, kernels = runner.pool, runner.kernels
    with torch.inference_mode():
        qkv, z, b, a = layer.project(x)
        window = torch.empty(L, runner.model.cfg.conv_channels, runner.model.cfg.conv_kernel - 1 + W,
                             dtype=x.dtype, device=DEVICE)
        conv_out, _ = kernels.conv_tree_step(qkv, pool.conv_history[:, layer.gdn_index], slot_ids, parents,
                                             layer.conv_weight, window_out=window)
        q, k, v = layer._split_qkv(conv_out)
        o, _ = kernels.gdn_verify(q, k, v, a, b, layer.A_log, layer.dt_bias, pool.recurrent_state[:, layer.gdn_index],
                                  slot_ids, parents, chains=True)
    return {"projection": qkv[0, 0].float().cpu(), "conv": conv_out[0, 0].float().cpu(), "recurrence": o[0, 0].float().cpu()}


def model_check(kind: str, dtype: torch.dtype, root: Path, invariant: bool = False) -> None:
    target = save_checkpoint(build_hf_model(kind, seed=3), root / f"{kind}")
    engine = Engine(load_model(target, device=DEVICE, dtype=dtype, progress=False),
                    config=EngineConfig(max_slots=8, max_model_len=256, speculation="fixed", batch_invariant=invariant))
    slots, batch = list(range(8)), prompts(96, [20, 7, 13, 30, 5, 9, 16, 11], seed=1)
    for s in slots:
        give_pages(engine, s, 256)
    with torch.inference_mode():
        engine.runner.model.extend(ExtendBatch.build([(s, 0, p) for s, p in zip(slots, batch)], DEVICE),
                                   engine.runner.pool, engine.runner.kernels)
    starts = [len(p) for p in batch]
    base, pieces = row_outputs(engine, 1, 1, slots, starts), gdn_pieces(engine, 1, 1, slots)
    order = list(base)
    for L, W in SHAPES[1:]:
        got = row_outputs(engine, L, W, slots, starts)
        bad = [n for n in order if n in got and not torch.equal(got[n], base[n])]
        diff = (got["<logits>"] - base["<logits>"]).abs().max().item()
        first = f"first differing module: {bad[0]} ({len(bad)} differ)" if bad else "all equal"
        steps = gdn_pieces(engine, L, W, slots)
        gdn = [n for n in steps if not torch.equal(steps[n], pieces[n])]
        print(f"  {kind:9s} {str(dtype)[6:]:8s} {'invariant GEMM' if invariant else 'cuBLAS/torch'} L={L} W={W:2d}: logits max |diff| {diff:.3g}; {first}; "
              f"GDN layer steps differing: {gdn or 'none'}")


def gemm_check() -> None:
    print("cuBLAS F.linear, row 0 of M rows vs M = 1 (test-model and 9B shape products); M values that differ:")
    for dtype in (torch.float32, torch.bfloat16):
        for K, N in ((64, 200), (64, 96), (4096, 12288), (12288, 4096), (4096, 248320)):
            x = torch.randn(1024, K, device=DEVICE, dtype=dtype)
            w = torch.randn(N, K, device=DEVICE, dtype=dtype) / K ** 0.5
            one = F.linear(x[:1], w)[0]
            bad = [M for M in (2, 4, 8, 16, 64, 128, 256, 1024) if not torch.equal(F.linear(x[:M], w)[0], one)]
            print(f"  {str(dtype)[6:]:8s} K={K:5d} N={N:6d}: {bad or 'none'}")
            del w


def gemm_speed() -> None:
    """The batch-invariant GEMM against cuBLAS at the 9B shape's products (bf16), by do_bench."""
    from triton.testing import do_bench

    from deltaflash.ops.gemm.invariant import invariant_linear

    print("bf16 products of the 9B shape, ms: cuBLAS F.linear / ops.gemm invariant_linear (ratio)")
    for K, N in ((4096, 12288), (12288, 4096), (4096, 248320)):
        w = torch.randn(N, K, device=DEVICE, dtype=torch.bfloat16) / K ** 0.5
        cells = []
        for M in (1, 16, 64, 256, 1024):
            x = torch.randn(M, K, device=DEVICE, dtype=torch.bfloat16)
            ours, theirs = do_bench(lambda: invariant_linear(x, w)), do_bench(lambda: F.linear(x, w))
            cells.append(f"M={M}: {theirs:.3f} / {ours:.3f} ({ours / theirs:.2f}x)")
        print(f"  K={K:5d} N={N:6d}  " + "; ".join(cells))


def main() -> None:
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU"
    print(f"{name}, torch {torch.__version__}; tf32 matmul {torch.backends.cuda.matmul.allow_tf32}")
    if DEVICE == "cuda":
        gemm_check()
        gemm_speed()
    with tempfile.TemporaryDirectory() as tmp:
        for kind, dtype in (("dense_gqa", torch.float32), ("moe", torch.float32), ("dense_gqa", torch.bfloat16)):
            for invariant in (False, True):
                model_check(kind, dtype, Path(tmp), invariant)


if __name__ == "__main__":
    main()
