"""A prefill chunk's attention, 9B shape (16 query / 4 kv heads of 256), causal, bf16 on CUDA: our paged kernel
(ops/attention/paged.py, one piece) beside torch SDPA's backends for a first chunk, and beside the dense route
(ops/attention/dense.py: gather the context from the pages, then the flash kernel) for a chunk after committed
keys; microseconds per call and the largest difference from the paged kernel.

    python bench/prefill_attention.py [--tokens 2048] [--contexts 0 6144 30720]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from deltaflash.ops.attention.dense import causal_block_attention
from deltaflash.ops.attention.paged import paged_attention


def time_us(fn, n: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048, help="query rows of the chunk")
    ap.add_argument("--contexts", type=int, nargs="+", default=[0, 6144, 30720], help="committed keys before it")
    ap.add_argument("--page-size", type=int, default=16)
    args = ap.parse_args()
    T, nh, nkv, hd, page = args.tokens, 16, 4, 256, args.page_size
    scale = hd ** -0.5
    gen = torch.Generator(device="cuda").manual_seed(0)
    zero = torch.zeros(1, dtype=torch.long, device="cuda")
    print(f"chunks of {T} rows, {nh} / {nkv} heads of {hd}, bf16, causal; pages of {page}")
    for ctx in args.contexts:
        S = ctx + T
        pages = -(-S // page)
        q = torch.randn(1, T, nh, hd, device="cuda", dtype=torch.bfloat16, generator=gen)
        key_pages, value_pages = (torch.randn(pages, page, nkv, hd, device="cuda", dtype=torch.bfloat16, generator=gen)
                                  for _ in range(2))
        tables = torch.randperm(pages, device="cuda", generator=gen).int()[None]  # scattered pages
        rows = (tables[0].long()[:, None] * page + torch.arange(page, device="cuda")).flatten()[:S][None]
        context = torch.full((1,), ctx, dtype=torch.long, device="cuda")

        def ours():
            return paged_attention(q, key_pages, value_pages, tables, zero, context, scale=scale, mode="causal",
                                   split=False)

        def dense():  # what the model runs: gather, then the flash kernel
            k, v = key_pages.flatten(0, 1)[rows], value_pages.flatten(0, 1)[rows]
            return causal_block_attention(q, k, v, scale)

        ref = ours()
        print(f"  context {ctx:6d}: paged kernel {time_us(ours):9.1f} us; dense route (gather + flash) "
              f"{time_us(dense):9.1f} us, max |diff| {(dense().float() - ref.float()).abs().max().item():.2e}")
        if ctx == 0:
            kt = key_pages.flatten(0, 1)[rows].transpose(1, 2)
            vt = value_pages.flatten(0, 1)[rows].transpose(1, 2)
            qt = q.transpose(1, 2)
            for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                def sdpa():
                    with sdpa_kernel([backend]):
                        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True)
                try:
                    print(f"    sdpa {name} alone (no gather): {time_us(sdpa):9.1f} us")
                except RuntimeError as e:
                    print(f"    sdpa {name}: unavailable ({str(e).splitlines()[0][:80]})")


if __name__ == "__main__":
    main()
