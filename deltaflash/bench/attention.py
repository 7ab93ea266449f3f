"""`deltaflash bench attention`: the paged attention kernel of one layer of the Qwen3.5-9B shape (16 query /
4 kv heads of 256, bf16) at real context lengths, against its K/V byte roofline and the torch reference.

Roofline: the K/V bytes every lane must read (context + rows, 2 x nkv x hd x 2 bytes per position) plus
q and the output, over the measured copy bandwidth. Pages of the default size hold each lane's context
in a random order of a pool shared by all lanes. Device times by CUDA-graph replay (as the engine
replays its rounds); the reference (gather + SDPA) only where its gathered copy stays under 8 GiB.
"""

from __future__ import annotations

import torch

from deltaflash.bench.common import copy_bandwidth_gbs, graph_ms, machine, print_table, write_json
from deltaflash.cache.pages import DEFAULT_PAGE_SIZE, pages_for
from deltaflash.ops.attention.naive import paged_attention_ref
from deltaflash.ops.attention.paged import paged_attention, split_keys_for

NH, NKV, HD = 16, 4, 256


def lanes_at(context: int, lanes: int, rows: int, page_size: int, device, max_model_len: int | None = None):
    """Arguments of one call: `lanes` lanes with `context` committed positions and `rows` query rows; the
    block tables as wide as `max_model_len` (the engine's: it sets the flash-decoding split), else as the
    lanes' pages."""
    per_lane = pages_for(context + rows, page_size)
    pages = lanes * per_lane
    key_pages = torch.randn(pages + 1, page_size, NKV, HD, dtype=torch.bfloat16, device=device)
    value_pages = torch.randn_like(key_pages)
    tables = torch.randperm(pages, device=device).int().view(lanes, per_lane)
    width = pages_for(max_model_len, page_size) if max_model_len else per_lane
    if width > per_lane:  # entries past a lane's length point at the sink page, as the engine's do
        tables = torch.cat([tables, torch.full((lanes, width - per_lane), pages, dtype=torch.int32, device=device)], 1)
    return dict(q=torch.randn(lanes, rows, NH, HD, dtype=torch.bfloat16, device=device), key_pages=key_pages,
                value_pages=value_pages, block_tables=tables, slot_ids=torch.arange(lanes, device=device),
                context_lens=torch.full((lanes,), context, device=device),
                n_rows=torch.full((lanes,), rows, device=device))


@torch.inference_mode()
def run(args) -> dict:
    bw = copy_bandwidth_gbs("cuda")
    out = []
    for context in args.contexts:
        for lanes in args.lanes:
            for rows in args.rows:
                call = lanes_at(context, lanes, rows, args.page_size, "cuda", args.max_model_len)
                kv_bytes = lanes * (context + rows) * 2 * NKV * HD * 2
                roofline_ms = (kv_bytes + 2 * call["q"].numel() * 2) / (bw * 1e9) * 1e3
                kernel_ms = graph_ms(lambda: paged_attention(**call, scale=HD ** -0.5))
                row = {"context": context, "lanes": lanes, "rows": rows,
                       "split_keys": split_keys_for(call["block_tables"].shape[1] * args.page_size),
                       "kernel_ms": kernel_ms, "roofline_ms": roofline_ms, "kernel/roofline": kernel_ms / roofline_ms}
                for keys in args.split_keys:  # other split sizes, for choosing split_keys_for's rule
                    row[f"ms@{keys}"] = graph_ms(lambda: paged_attention(**call, scale=HD ** -0.5, split_keys=keys))
                for tile in args.key_tiles:  # other tiles ([rows:]keys:stages[:flags]), at the default split and each of --split-keys
                    shape = tuple(int(t) if t.isdigit() else t for t in tile.split(":"))  # (flags: key_tile_of)
                    for keys in (None, *args.split_keys):
                        row[f"ms@{tile}" + (f"/{keys}" if keys else "")] = graph_ms(lambda: paged_attention(
                            **call, scale=HD ** -0.5, split_keys=keys, key_tile=shape))
                gathered = lanes * call["block_tables"].shape[1] * args.page_size * 2 * NKV * HD * 2  # the whole table
                if gathered < 8 << 30:
                    ref_ms = graph_ms(lambda: paged_attention_ref(**call, scale=HD ** -0.5), reps=3, trials=3)
                    row |= {"reference_ms": ref_ms, "reference/kernel": ref_ms / kernel_ms}
                out.append(row)
                call = None  # free the pages before the next size
                torch.cuda.empty_cache()
    print(f"copy bandwidth {bw:.0f} GB/s; page size {args.page_size}; 9B attention layer: {NH} / {NKV} heads of {HD}")
    print_table("paged attention, one layer, bf16 (device time by CUDA-graph replay)", out)
    result = {"machine": machine(), "copy_bandwidth_gbs": bw, "page_size": args.page_size, "rows": out}
    write_json(args.json, result)
    return result


def register(sub) -> None:
    p = sub.add_parser("attention", help="paged attention kernel vs its K/V byte roofline at real contexts (CUDA)")
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768, 131072])
    p.add_argument("--lanes", type=int, nargs="+", default=[1, 16])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16], help="query rows per lane (1: decode, W: verify)")
    p.add_argument("--page-size", type=int, default=DEFAULT_PAGE_SIZE)
    p.add_argument("--split-keys", type=int, nargs="*", default=[],
                   help="also time these keys per split (multiples of 64) beside the default rule's")
    p.add_argument("--key-tiles", nargs="*", default=[], metavar="[ROWS:]KEYS:STAGES[:FLAG...]",
                   help="also time the kernel with these key tiles and pipeline stages, optionally query rows per "
                        "program first (e.g. 32:3 64:2 16:64:2 64:64:2); flags (ops/attention/paged.py key_tile_of): "
                        "dotsum sums the softmax weights by a tensor-core product, v2 also compiles on mma.sync at "
                        "any height, wN launches N warps, rN caps a thread's registers at N, onepass masks every key tile")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="block tables as wide as this capacity, as an engine's (default: the lanes' pages)")
    p.add_argument("--json", default=None)
    p.set_defaults(func=run)
