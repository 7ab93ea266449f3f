"""The tree round's small ops on the H200: the drafter's vocabulary top-k and the ancestor mask, torch
against the kernels that replaced them (issue 17; CUDA).

Usage: python bench/tree_ops.py

Device microseconds per call (CUDA-graph replay, so launch overhead is the device's, not the host's) of:
the top-4 of each depth's log-probabilities (7 rows a lane; the demo drafter's 8,192-token vocabulary and
the 9B's 248,320) by torch.topk, by the reference's stable sort and by ops/tree/topk.row_top_k; the ancestor
mask of 16-node trees by squaring (core.batch.ancestor_mask) and by ops/tree/ancestors.ancestor_mask.
Results are checked equal first.
"""

import torch

from deltaflash.bench.common import graph_ms
from deltaflash.core.batch import ancestor_mask as ancestor_mask_ref
from deltaflash.ops.tree.ancestors import ancestor_mask
from deltaflash.ops.tree.naive import row_top_k as row_top_k_ref
from deltaflash.ops.tree.topk import row_top_k


def main() -> None:
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    print("top-4 of 7 rows a lane (us per call): lanes, vocabulary, torch.topk, stable sort, row_top_k")
    for V in (8192, 248320):
        for lanes in (1, 16, 64) if V == 8192 else (1, 16):
            x = torch.randn(lanes, 7, V, device=dev, generator=g).log_softmax(-1)
            assert torch.equal(row_top_k(x, 4)[1], row_top_k_ref(x, 4)[1])
            times = [1e3 * graph_ms(lambda f=f: f(x, 4)) for f in (lambda x, k: x.topk(k), row_top_k_ref, row_top_k)]
            print(f"  {lanes:3d}  {V:7d}  " + "  ".join(f"{t:8.1f}" for t in times))
    print("ancestor mask of 16-node trees (us per call): lanes, squaring, kernel")
    for lanes in (1, 16, 64):
        parents = torch.stack([torch.tensor([-1] + [int(torch.randint(0, n, (1,))) for n in range(1, 16)])
                               for _ in range(lanes)]).to(dev)
        assert torch.equal(ancestor_mask(parents), ancestor_mask_ref(parents))
        times = [1e3 * graph_ms(lambda f=f: f(parents)) for f in (ancestor_mask_ref, ancestor_mask)]
        print(f"  {lanes:3d}  " + "  ".join(f"{t:8.1f}" for t in times))


if __name__ == "__main__":
    main()
