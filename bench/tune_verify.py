"""Time the mapped GDN verify kernel over (BV, num_warps) tile choices at the 9B layer shape (CUDA).

Usage: python bench/tune_verify.py [--lanes 1 4 16 64] [--configs 8x1 16x1 16x4 ...] [--fp-fusion] [--widen-at-load]

Prints device milliseconds per call (CUDA-graph replay) of the chain-only kernel (what verify rounds
run) and the ratio to the byte roofline (`bench kernels`' GDN bytes). Checks, per config: the chain-only
and general kernels agree bit for bit, the torch reference agrees to fp32 tolerance (the dk sums follow
the tile, so configs differ in the last bits), and "gates" - gamma in the replay log equals torch's
exp / softplus bit for bit (what the unfused route's bitwise match needs; --fp-fusion may break it).
--fp-fusion, --widen-at-load: compile the kernel with those build options (verify.BuildOptions).
"""

import argparse

import torch
import triton

import deltaflash.ops.gdn.verify as verify_mod
from deltaflash.ops.gdn.naive import gdn_verify_ref
from deltaflash.bench.common import copy_bandwidth_gbs, graph_ms
from deltaflash.bench.kernels import layer_inputs, split_qkv, verify_bytes
from deltaflash.ops.kernels import triton_kernels


def run_with(config, t, conv_out, parents, chains):
    bv, warps = config
    verify_mod.verify_tiles = lambda dk, dv, programs: (triton.next_power_of_2(dk), bv, warps)
    q, k, v = split_qkv(conv_out, *t["dims"][:4])
    return lambda: verify_mod.gdn_verify(q, k, v, t["a"], t["b"], t["A_log"], t["dt_bias"], t["state"][:, 0],
                                         t["slot_ids"], parents, chains=chains)


@torch.inference_mode()
def main():
    p = argparse.ArgumentParser()
    p.add_argument("--lanes", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--configs", nargs="+", default=["4x1", "8x1", "16x1", "32x1", "16x2", "32x2", "16x4", "32x4"])
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--fp-fusion", action="store_true")
    p.add_argument("--widen-at-load", action="store_true")
    args = p.parse_args()
    verify_mod.BUILD = verify_mod.BuildOptions(fp_fusion=args.fp_fusion, widen_at_load=args.widen_at_load)
    print(verify_mod.BUILD)
    configs = [tuple(int(x) for x in c.split("x")) for c in args.configs]
    bw = copy_bandwidth_gbs("cuda")
    fused = triton_kernels()
    print("lanes  " + "  ".join(f"{b}x{w}".rjust(14) for b, w in configs) + "   (ms, x roofline; BVxwarps)")
    for L in args.lanes:
        t = layer_inputs(L, args.width, slots=max(2 * L, 8))
        conv_out = fused.conv_tree_step(t["qkv"], t["history"][:, 0], t["slot_ids"], t["parents"], t["conv_w"])[0]
        trees = torch.randint(0, 2, (L, args.width), device="cuda")  # parent n-1 or n-2: a random tree
        tree_parents = torch.clamp(torch.arange(args.width, device="cuda") - 1 - trees, min=-1)
        tree_parents[:, 0] = -1
        roof = verify_bytes(L, args.width, t["dims"])[1] / (bw * 1e9) * 1e3
        q, k, v = split_qkv(conv_out, *t["dims"][:4])
        refs = [gdn_verify_ref(q, k, v, t["a"], t["b"], t["A_log"], t["dt_bias"], t["state"][:, 0], t["slot_ids"], par)
                for par in (t["parents"], tree_parents)]
        cells = []
        for config in configs:
            outs = [tuple(x.clone() for x in run_with(config, t, conv_out, par, chains)())
                    for par, chains in ((t["parents"], True), (t["parents"], False), (tree_parents, False))]
            flags = []
            if not all(torch.equal(a, b) for a, b in zip(outs[0], outs[1])):
                flags.append("CHAIN!=GENERAL")
            for (o, log), (o_ref, log_ref) in zip(outs[1:], refs):
                if not (torch.allclose(log, log_ref, rtol=1e-4, atol=1e-5)
                        and torch.allclose(o.float(), o_ref.float(), rtol=2e-2, atol=2e-2)):
                    flags.append("FAR FROM REF")
                if not torch.equal(log[..., 0], log_ref[..., 0]):
                    flags.append("GATES")
            ms = graph_ms(run_with(config, t, conv_out, t["parents"], True))
            cells.append(f"{ms:.3f} {ms / roof:5.1f}x{''.join(' ' + f for f in sorted(set(flags)))}")
        print(f"{L:5d}  " + "  ".join(c.rjust(14) for c in cells))


if __name__ == "__main__":
    main()
