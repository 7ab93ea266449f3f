"""The GDN verify kernel's tree path against its chain path at the 9B layer shape (CUDA; issue 17).

Usage: python bench/verify_trees.py [--lanes 1 4 16 64]

Device milliseconds per call (CUDA-graph replay) of: a chain of 8 rows and a chain of 16 (chains=True,
what chain rounds run), and a 16-node tree of depth 7 shaped as best-first trees come out (the top-1
chain of 8 with second candidates hanging off its first nodes: 5 leaves), run by the tree kernel. The
tree's nodes are checked bit for bit against chains along their root paths first.
"""

import argparse

import torch

from deltaflash.bench.common import graph_ms
from deltaflash.bench.kernels import layer_inputs, split_qkv
from deltaflash.ops.gdn.verify import gdn_verify

#: node -> parent: the top-1 chain 0..7, second candidates 8..11 under nodes 0..3, one child each (12..15)
TREE = [-1, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 8, 9, 10, 11]


def verify(t, rows, parents, chains):
    nk, nv, dk, dv = t["dims"][:4]
    q, k, v = split_qkv(t["qkv"][:, rows], nk, nv, dk, dv)
    return lambda: gdn_verify(q, k, v, t["a"][:, rows], t["b"][:, rows], t["A_log"], t["dt_bias"], t["state"][:, 0],
                              t["slot_ids"], parents, chains=chains)


def root_path(node):
    path = []
    while node >= 0:
        path.append(node)
        node = TREE[node]
    return path[::-1]


@torch.inference_mode()
def main():
    p = argparse.ArgumentParser()
    p.add_argument("--lanes", type=int, nargs="+", default=[1, 4, 16, 64])
    args = p.parse_args()
    print("lanes   chain 8   chain 16   tree 16 (depth 7)   tree / chain 8   (ms per call, 9B GDN layer)")
    for L in args.lanes:
        t = layer_inputs(L, 16, slots=max(2 * L, 8))
        chain = lambda n: (torch.arange(n, device="cuda") - 1).expand(L, n).contiguous()  # noqa: E731
        tree = torch.tensor(TREE, device="cuda").expand(L, 16).contiguous()
        o, log = verify(t, slice(None), tree, False)()
        for leaf in (7, 12, 15):  # every node on these paths, against a chain over the path's rows
            path = root_path(leaf)
            o_c, log_c = verify(t, path, chain(len(path)), True)()
            assert torch.equal(o[:, path], o_c) and torch.equal(log[:, path], log_c), f"tree path to {leaf} differs"
        ms = [graph_ms(verify(t, slice(0, 8), chain(8), True)), graph_ms(verify(t, slice(None), chain(16), True)),
              graph_ms(verify(t, slice(None), tree, False))]
        print(f"{L:5d}  {ms[0]:8.3f}  {ms[1]:9.3f}  {ms[2]:18.3f}  {ms[2] / ms[0]:15.2f}x")


if __name__ == "__main__":
    main()
