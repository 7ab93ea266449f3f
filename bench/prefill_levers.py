"""Two prefill levers of issue 15's 2048-token TTFT, timed in isolation on CUDA (9B shape, bf16) before the
engine takes them:

1. a first chunk's causal attention (16 query / 4 kv heads of 256) on SDPA's cuDNN backend beside the flash
   backend: eager, and replayed from a CUDA graph (cuDNN builds an execution plan per new shape, ~8 ms of
   host time: a prefill graph's fixed shape builds it once, at capture; what the route now does), and a long
   prompt's later chunk over its gathered context (lower-right causal mask), where the route keeps flash;
2. the SwiGLU MLP (4096 -> 2 x 12288 -> 4096) over blocks of rows, so that a block's gate / up output (rows
   x 49 KB) can stay in L2 for the activation and the down projection, beside one pass over every row;
3. the residual add in the epilogue of the GEMM before it (o_proj, down_proj: cuBLAS's addmm, beta 1) and a plain
   norm after, beside the GEMM alone and the add-and-norm kernel (the engine's route): one [rows, 4096] read
   and write fewer a site, 63 sites a 9B forward.

    python bench/prefill_levers.py [--tokens 1024 2048] [--contexts 2048 6144] [--mlp-blocks 2048 1024 512]
        [--residual-rows 256 2048]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from deltaflash.engine.graphs import capture
from deltaflash.ops.activation.silu_mul import silu_mul
from deltaflash.ops.norm.rms_norm import add_rms_norm, zero_centered_rms_norm
from prefill_attention import time_us  # (this directory: scripts here run as `python bench/...`)


def graphed(fn):
    """fn captured in a CUDA graph as the engine captures its own (engine/graphs.capture): (replay, the
    graph's output)."""
    graph, out = capture(fn, warmups=1)
    return graph.replay, out


def attention(tokens: list[int]) -> None:
    nh, nkv, hd = 16, 4, 256
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"first-chunk attention, {nh} / {nkv} heads of {hd}, bf16, causal (us per call)")
    for T in tokens:
        q = torch.randn(1, nh, T, hd, device="cuda", dtype=torch.bfloat16, generator=gen)
        k, v = (torch.randn(1, nkv, T, hd, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))

        def sdpa(backend):
            def run():
                with sdpa_kernel([backend]):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=hd ** -0.5, enable_gqa=True)
            return run

        flash, cudnn = sdpa(SDPBackend.FLASH_ATTENTION), sdpa(SDPBackend.CUDNN_ATTENTION)
        line = f"  {T:5d} rows: flash {time_us(flash):8.1f}"
        try:
            eager = cudnn()
            replay, out = graphed(cudnn)
            replay()
            torch.cuda.synchronize()
            same = torch.equal(out, eager)
            diff = (eager.float() - flash().float()).abs().max().item()
            line += (f", cudnn eager {time_us(cudnn):8.1f}, cudnn graph replay {time_us(replay):8.1f}; replay equals "
                     f"eager cudnn bit for bit: {same}; max |cudnn - flash| {diff:.2e}")
        except RuntimeError as e:
            line += f", cudnn: unavailable ({str(e).splitlines()[0][:100]})"
        print(line)


def later_chunks(T: int, contexts: list[int]) -> None:
    """A one-lane chunk of T rows after ctx committed keys over the gathered run of ctx + T keys (a long
    prompt's later chunks; lower-right causal mask): the flash backend the route runs against cuDNN's."""
    nh, nkv, hd = 16, 4, 256
    gen = torch.Generator(device="cuda").manual_seed(2)
    print(f"later chunks of {T} rows over the gathered context, lower-right causal (us per call)")
    for ctx in contexts:
        S = ctx + T
        q = torch.randn(1, nh, T, hd, device="cuda", dtype=torch.bfloat16, generator=gen)
        k, v = (torch.randn(1, nkv, S, hd, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
        mask = causal_lower_right(T, S)

        def sdpa(backend):
            def run():
                with sdpa_kernel([backend]):
                    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=hd ** -0.5, enable_gqa=True)
            return run

        line = f"  after {ctx:6d} keys: flash {time_us(sdpa(SDPBackend.FLASH_ATTENTION)):9.1f}"
        try:
            diff = (sdpa(SDPBackend.CUDNN_ATTENTION)().float() - sdpa(SDPBackend.FLASH_ATTENTION)().float()).abs().max()
            line += f", cudnn {time_us(sdpa(SDPBackend.CUDNN_ATTENTION)):9.1f}; max |cudnn - flash| {diff.item():.2e}"
        except RuntimeError as e:
            line += f", cudnn: unavailable ({str(e).splitlines()[0][:100]})"
        print(line)


def mlp(tokens: int, blocks: list[int]) -> None:
    H, inter = 4096, 12288
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16, generator=gen)
    w_gu = torch.randn(2 * inter, H, device="cuda", dtype=torch.bfloat16, generator=gen) * H ** -0.5
    w_d = torch.randn(H, inter, device="cuda", dtype=torch.bfloat16, generator=gen) * inter ** -0.5
    out = torch.empty(tokens, H, device="cuda", dtype=torch.bfloat16)
    flops = 2 * tokens * H * 3 * inter
    print(f"SwiGLU MLP, {tokens} rows, {H} -> 2 x {inter} -> {H}, bf16, graph replay (us per call)")
    ref = None
    for block in blocks:
        def run(block=block):
            for r in range(0, tokens, block):
                gate, up = F.linear(x[r:r + block], w_gu).split(inter, dim=-1)
                torch.mm(silu_mul(gate, up), w_d.t(), out=out[r:r + block])
            return out

        replay, _ = graphed(run)
        us = time_us(replay)
        got = out.clone()
        ref = got if ref is None else ref
        print(f"  blocks of {block:5d} rows: {us:8.1f} us ({flops / us / 1e6:6.1f} TFLOP/s); "
              f"max |diff| from the first {(got.float() - ref.float()).abs().max().item():.2e}")


def residual_epilogue(rows_list: list[int]) -> None:
    H = 4096
    gen = torch.Generator(device="cuda").manual_seed(2)
    w_norm = torch.randn(H, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.1
    print(f"residual add + next norm after a product into {H} features, bf16, graph replay (us per call)")
    for rows in rows_list:
        for K, name in ((4096, "o_proj"), (12288, "down_proj")):
            a = torch.randn(rows, K, device="cuda", dtype=torch.bfloat16, generator=gen)
            w = torch.randn(H, K, device="cuda", dtype=torch.bfloat16, generator=gen) * K ** -0.5
            x = torch.randn(rows, H, device="cuda", dtype=torch.bfloat16, generator=gen)

            def separate():  # the engine's route: the GEMM, then the add and the norm in one kernel
                return add_rms_norm(x, torch.mm(a, w.t()), w_norm, 1e-6)

            def epilogue():  # the add in the GEMM's epilogue, then the norm alone
                total = torch.addmm(x, a, w.t())
                return total, zero_centered_rms_norm(total, w_norm, 1e-6)

            times = {}
            for label, fn in (("mm alone", lambda: torch.mm(a, w.t())), ("addmm alone", lambda: torch.addmm(x, a, w.t())),
                              ("mm + add_rms_norm", separate), ("addmm + rms_norm", epilogue)):
                replay, _ = graphed(fn)
                times[label] = min(time_us(replay) for _ in range(3))
            (s_tot, s_h), (e_tot, e_h) = separate(), epilogue()
            print(f"  {rows:5d} rows, {name:9s} (K {K:5d}): " + ", ".join(f"{k} {v:7.1f}" for k, v in times.items())
                  + f"; saved {times['mm + add_rms_norm'] - times['addmm + rms_norm']:6.1f} us; residual max |diff| "
                  f"{(s_tot.float() - e_tot.float()).abs().max().item():.2e}, normed {(s_h.float() - e_h.float()).abs().max().item():.2e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048])
    ap.add_argument("--contexts", type=int, nargs="*", default=[2048, 6144],
                    help="keys before a later chunk of the largest --tokens rows")
    ap.add_argument("--mlp-blocks", type=int, nargs="*", default=[2048, 1024, 512], help="none: skip the MLP")
    ap.add_argument("--residual-rows", type=int, nargs="*", default=[256, 2048], help="none: skip lever 3")
    ap.add_argument("--only-residual", action="store_true", help="lever 3 alone")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}")
    if not args.only_residual:
        attention(args.tokens)
        if args.contexts:
            later_chunks(max(args.tokens), args.contexts)
        if args.mlp_blocks:
            mlp(max(args.mlp_blocks), args.mlp_blocks)
    if args.residual_rows:
        residual_epilogue(args.residual_rows)


if __name__ == "__main__":
    main()
