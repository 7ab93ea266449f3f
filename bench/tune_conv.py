"""Time the prefill conv kernel (conv_extend_heads: depthwise causal conv + SiLU, q / k L2-normalised per key
head) over (rows per program, warps, rows a loop step) tiles at the 9B layer shape (CUDA).

Usage: python bench/tune_conv.py [--tokens 2048 512] [--configs 32x1 64x1x2 ...] (ROWSxWARPS[xSTEP], STEP 1 or 2)

Prints device milliseconds per call (CUDA-graph replay), the bytes moved as a rate, and that rate over
the measured copy rate (1.0 = the byte roofline). The input is a strided column view of a projection, as
in the model. Per config it checks the outputs equal the current default tile's bit for bit (the conv
arithmetic is per element; the head norm's sum is over one row's channels, inside a program) - a
config marked BITS would change the prefill's values and cannot be taken as it is.
"""

import argparse

import torch

import deltaflash.ops.conv.extend as extend
from deltaflash.bench.common import copy_bandwidth_gbs, graph_ms

NK, NV, DK, DV, KERNEL = 16, 32, 128, 128, 4  # the 9B GDN layer


def layer(T: int):
    """One lane's inputs: rows, its layer of an 8-slot, 24-layer conv pool, its slot (3), weight, n_rows."""
    C = 2 * NK * DK + NV * DV
    proj = torch.randn(1, T, C + NV * DV + 2 * NV, dtype=torch.bfloat16, device="cuda")  # qkv, z, a, b
    rows = proj[..., :C]
    pool = torch.randn(8, 24, C, KERNEL - 1, dtype=torch.bfloat16, device="cuda")
    weight = torch.randn(C, KERNEL, dtype=torch.bfloat16, device="cuda") * 0.5
    n_rows = torch.tensor([T], device="cuda")
    return rows, pool[:, 5], torch.tensor([3], device="cuda"), weight, n_rows


def moved_bytes(T: int) -> int:
    """Rows read once, q, k and v written once, history read and written."""
    C = 2 * NK * DK + NV * DV
    return 2 * (2 * T * C + 2 * C * (KERNEL - 1))


@torch.inference_mode()
def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, nargs="+", default=[2048, 512])
    p.add_argument("--configs", nargs="+", default=["8x1", "16x1", "32x1", "8x1x2", "16x1x2", "32x1x2", "64x1x2",
                                                     "16x2x2"])
    args = p.parse_args()
    default = (extend.ROW_TILE, extend.NUM_WARPS, extend.STEP)
    configs = [(*(int(x) for x in c.split("x")), 1)[:3] for c in args.configs]
    bw = copy_bandwidth_gbs("cuda")
    print(f"copy rate {bw:.0f} GB/s; default tile {'x'.join(map(str, default))} (rows x warps x step)")
    print("tokens  " + "  ".join("x".join(map(str, c)).rjust(20) for c in configs) + "   (ms, TB/s, x roofline)")
    for T in args.tokens:
        inputs = layer(T)
        history = inputs[1]  # written in place by each call: every compared call starts from the same one
        start = history.clone()

        def run() -> tuple[torch.Tensor, ...]:
            history.copy_(start)
            return (*extend.conv_extend_heads(*inputs, NK, NV, DK), history.clone())

        extend.ROW_TILE, extend.NUM_WARPS, extend.STEP = default
        reference = run()
        cells = []
        for config in configs:
            extend.ROW_TILE, extend.NUM_WARPS, extend.STEP = config
            out = run()
            same = all(torch.equal(a, b) for a, b in zip(out, reference))
            ms = graph_ms(lambda: extend.conv_extend_heads(*inputs, NK, NV, DK))
            rate = moved_bytes(T) / (ms * 1e-3) / 1e12
            cells.append(f"{ms:.4f} {rate:4.2f} {bw / 1e3 / rate:4.1f}x{'' if same else ' BITS'}")
        print(f"{T:6d}  " + "  ".join(c.rjust(20) for c in cells))
    extend.ROW_TILE, extend.NUM_WARPS, extend.STEP = default


if __name__ == "__main__":
    main()
