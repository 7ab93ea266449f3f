"""Session 18, call 3: a verify block's rows (64-row mma.sync tiles, 4 warps) against the same positions decoded
alone (16-row tiles), with row sums by product, in the 9B heads (bf16): default (committed tiles unmasked first)
and one-pass (every tile masked) - equal to the bit?"""
import sys

import torch

sys.path.insert(0, ".")
from tests.test_ops_attention import lanes
from deltaflash.ops.attention.paged import paged_attention

T, nh, nkv, hd = 16, 16, 4, 256
context = [300, 90, 4100]
args = lanes(T, nh, nkv, hd, 16, torch.bfloat16, context, seed=8)
for name, block_tile, row_tile in (("default", None, None),
                                   ("onepass", (64, 64, 2, "v2", "w4", "onepass"), (16, 64, 2, "dotsum", "onepass"))):
    for split_keys in (None, 256):
        opts = dict(scale=hd ** -0.5, split_keys=split_keys)
        block = paged_attention(**args, **opts, key_tile=block_tile)
        same = rows = 0
        for i, ctx in enumerate(context):
            if args["slot_ids"][i] < 0:
                continue
            for t in range(int(args["n_rows"][i])):
                alone = paged_attention(**(args | {"q": args["q"][i:i + 1, t:t + 1].contiguous(),
                                                   "slot_ids": args["slot_ids"][i:i + 1],
                                                   "context_lens": torch.tensor([ctx + t], device="cuda"),
                                                   "n_rows": torch.ones(1, dtype=torch.long, device="cuda")}),
                                        **opts, key_tile=row_tile)
                same += torch.equal(alone[0, 0], block[i, t])
                rows += 1
        print(f"{name} split_keys {split_keys}: block rows equal to the rows decoded alone {same}/{rows}")
