"""ops/attention: the paged Triton kernel against the gather + SDPA reference, on CPU under
TRITON_INTERPRET=1 or on CUDA. Awkward shapes: ragged lengths, pages smaller than a block and of odd
size, GQA, padding lanes, tree masks, windows, key-range splits; storage that no key owns holds NaN."""

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction

from deltaflash.ops.attention.naive import paged_attention_ref
from deltaflash.ops.attention.paged import paged_attention, paged_attention_kernel, tiles

INTERPRETED = isinstance(paged_attention_kernel, InterpretedFunction)
DEVICE = "cpu" if INTERPRETED else "cuda"
pytestmark = pytest.mark.skipif(not INTERPRETED and not torch.cuda.is_available(),
                                reason="kernel tests need TRITON_INTERPRET=1 before import, or CUDA")
# Triton 3.6's interpreter multiplies bf16 tiles wrongly (tl.dot off by 1e10 on a 16 x 16 product), so
# bf16 runs on CUDA only; fp16 covers the half-precision path under the interpreter
HALF = torch.float16 if INTERPRETED else torch.bfloat16


def random_tree(T: int, g: torch.Generator) -> torch.Tensor:
    """[T, T] bool ancestor-or-self mask of a random tree rooted at row 0."""
    mask = torch.eye(T, dtype=torch.bool)
    for n in range(1, T):
        mask[n] |= mask[int(torch.randint(0, n, (), generator=g))]
    return mask


def lanes(T, nh, nkv, hd, page, dtype, context, seed, mode="causal", pad_lane=True):
    """Random pages holding each lane's `context[l]` committed keys and its block of T rows (the last lane
    has two fewer valid rows), NaN everywhere else; a padding lane in the middle."""
    g = torch.Generator().manual_seed(seed)
    L = len(context)
    per_lane = -(-(max(context) + T) // page) + 1
    P = L * per_lane + 3
    key_pages = torch.full((P, page, nkv, hd), float("nan"))
    value_pages = torch.full((P, page, nkv, hd), float("nan"))
    tables = torch.randperm(P, generator=g)[:L * per_lane].view(L, per_lane)
    slots = torch.randperm(L, generator=g)
    block_tables = torch.empty(L, per_lane, dtype=torch.int32)
    block_tables[slots] = tables.int()
    n_rows = torch.full((L,), T)
    n_rows[-1] = max(T - 2, 1)
    for lane in range(L):
        for p in range(context[lane] + int(n_rows[lane])):
            page_id, row = tables[lane, p // page], p % page
            key_pages[page_id, row] = torch.randn(nkv, hd, generator=g)
            value_pages[page_id, row] = torch.randn(nkv, hd, generator=g)
    slot_ids = slots.clone()
    if pad_lane and L > 2:
        slot_ids[1] = -1
    tree = torch.stack([random_tree(T, g) for _ in range(L)]) if mode == "tree" else None
    q = torch.randn(L, T, nh, hd, generator=g)
    to = lambda t: t.to(DEVICE)  # noqa: E731
    return dict(q=to(q.to(dtype)), key_pages=to(key_pages.to(dtype)), value_pages=to(value_pages.to(dtype)),
                block_tables=to(block_tables), slot_ids=to(slot_ids), context_lens=to(torch.tensor(context)),
                n_rows=to(n_rows), tree_mask=None if tree is None else to(tree))


CASES = [  # (T, nh, nkv, hd, page, context per lane, mode, window, split_keys: None = one piece here)
    (1, 4, 2, 64, 4, [9, 3, 0, 17], "causal", None, None),    # decode rows, GQA 2
    (1, 8, 2, 64, 16, [40, 5, 130], "causal", None, 64),      # flash-decoding over 3 pieces
    (5, 4, 4, 64, 4, [7, 2, 12], "causal", None, None),       # a block crossing pages smaller than itself
    (5, 6, 3, 64, 5, [11, 0, 70], "causal", None, 64),        # odd page size, empty pieces at short lanes
    (12, 8, 2, 128, 8, [3, 81, 0], "causal", None, 64),       # prefill-like chunk, GQA 4, dk 128
    (5, 4, 2, 64, 4, [6, 13, 1], "full", None, None),         # the drafter's non-causal block
    (12, 4, 2, 64, 4, [9, 2, 30], "tree", None, None),        # tree masks
    (12, 4, 1, 64, 8, [20, 5, 73], "tree", None, 64),
    (5, 4, 2, 64, 4, [69, 8, 2], "causal", 6, 64),            # sliding window (the drafter's causal layers)
    (5, 4, 2, 64, 4, [19, 8, 66], "full", 4, None),           # window in both directions
]


@pytest.mark.parametrize("T,nh,nkv,hd,page,context,mode,window,split_keys", CASES,
                         ids=[f"T{c[0]} nh{c[1]}/{c[2]} hd{c[3]} page{c[4]} {c[6]} w{c[7]} s{c[8]}" for c in CASES])
@pytest.mark.parametrize("dtype", [torch.float32, HALF], ids=["fp32", "half"])
def test_kernel_matches_reference(T, nh, nkv, hd, page, context, mode, window, split_keys, dtype):
    args = lanes(T, nh, nkv, hd, page, dtype, context, seed=T * 7 + page, mode=mode)
    options = dict(scale=hd ** -0.5, mode=mode, window=window)
    got = paged_attention(**args, **options, split_keys=split_keys)
    want = paged_attention_ref(**args, **options)
    valid = (torch.arange(T, device=DEVICE)[None] < args["n_rows"][:, None])
    assert torch.isfinite(got[valid]).all() and torch.isfinite(want[valid]).all()
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got[valid].float(), want[valid].float(), **tol)
    padding = args["slot_ids"] < 0
    assert (got[padding] == 0).all() and (want[padding] == 0).all()


def test_splits_do_not_change_the_result():
    args = lanes(1, 4, 2, 64, 4, torch.float32, [150, 7, 23], seed=3)
    outs = [paged_attention(**args, scale=0.125, split_keys=s) for s in (None, 64, 128)]
    outs.append(paged_attention(**args, scale=0.125, split=False))  # one piece (prefill chunks)
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], rtol=1e-5, atol=1e-6)
    # no split: one piece, on the unsplit calls' tiles (prefill chunks: 64 rows)
    one_piece = paged_attention(**args, scale=0.125, split_keys=1 << 20, key_tile=tiles(64, split=False)[:3])
    assert torch.equal(outs[-1], one_piece)


@pytest.mark.parametrize("key_tile", [(16, 1), (32, 2), (64, 3), (64, 32, 2), (16, 32, 2), (16, 32, 2, "dotsum"),
                                      (64, 32, 2, "v2", "w4"), (64, 32, 2, "v2", "onepass")],
                         ids=lambda t: ":".join(map(str, t)))
def test_other_key_tiles_match_the_reference(key_tile):
    """The key tiles `bench attention --key-tiles` times compute the same attention (causal and tree rows,
    pages of 5 rows crossed inside a tile, a split; 24 query rows per lane as one 64-row tile or as two
    16-row programs; committed tiles unmasked first or every tile masked)."""
    for mode in ("causal", "tree"):
        args = lanes(6, 8, 2, 64, 5, torch.float32, [70, 3, 41], seed=11, mode=mode)
        want = paged_attention_ref(**args, scale=0.125, mode=mode)
        got = paged_attention(**args, scale=0.125, mode=mode, split_keys=64, key_tile=key_tile)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [
    (6, 4, 2, 64, torch.float32),
    (16, 8, 2, 64, torch.float32),  # blocks of 4 .. 64 rows: 16- and 64-row tiles
    pytest.param((16, 16, 4, 256, HALF), marks=pytest.mark.skipif(
        INTERPRETED, reason="the 9B head shape on tensor cores: 64 rows of a verify block, 4 of a decode row")),
], ids=["fp32-hd64", "fp32-hd64-both-heights", "half-9b-heads"])
@pytest.mark.parametrize("split_keys", [None, 64])
def test_a_rows_bits_do_not_depend_on_the_batch(split_keys, shape):
    """Row t of a lane's verify block, the same row in a shorter block, and the same position decoded
    alone (one row, its block's earlier keys committed) in a launch of one lane, and the lane's whole block
    in a launch of its own: equal to the bit, as speculative == target-only greedy needs
    (ops/attention/paged.py: batch invariance), whichever tile height each takes (`tiles`: 16 rows up to
    16 or for a launch of few (lane, kv head) pairs, else 64). Across heights, and for the row or the lane
    alone, only on the GPU: under the interpreter numpy's BLAS rounds a product by the row's place in the
    tile and by the tile's shape."""
    T, nh, nkv, hd, dtype = shape
    rep = nh // nkv
    context = [70, 9, 131]
    args = lanes(T, nh, nkv, hd, 4, dtype, context, seed=8)
    options = dict(scale=0.125, split_keys=split_keys)
    block = paged_attention(**args, **options)
    valid = args["n_rows"].tolist()  # the last lane has fewer valid rows
    if not INTERPRETED:
        for i in range(len(context)):
            one = {k: args[k][i:i + 1] for k in ("q", "slot_ids", "context_lens", "n_rows")}
            assert tiles(hd, rows=T * rep, pairs=nkv).rows == 16 or T * rep <= 16  # the launch of one lane
            assert torch.equal(paged_attention(**(args | one), **options)[0, :valid[i]], block[i, :valid[i]])
    for t in range(T):
        shorter = paged_attention(**(args | {"q": args["q"][:, :t + 1].contiguous(),
                                             "n_rows": args["n_rows"].clamp(max=t + 1)}), **options)
        same_height = tiles(hd, rows=(t + 1) * rep).rows == tiles(hd, rows=T * rep).rows
        for i, ctx in enumerate(context):
            if t >= valid[i]:
                continue
            if same_height or not INTERPRETED:
                assert torch.equal(shorter[i, t], block[i, t])
            if INTERPRETED:
                continue
            alone = paged_attention(**(args | {"q": args["q"][i:i + 1, t:t + 1].contiguous(),
                                               "slot_ids": args["slot_ids"][i:i + 1],
                                               "context_lens": torch.tensor([ctx + t], device=DEVICE),
                                               "n_rows": torch.ones(1, dtype=torch.long, device=DEVICE)}), **options)
            assert torch.equal(alone[0, 0], block[i, t])


def test_per_lane_vectors_may_be_strided_views():
    """The models pass context_lens as a column of the positions [L, T] (stride T): each lane must read
    its own entry (a kernel reading them at unit stride gave lane l the start of lane 0's row l)."""
    T, context = 5, [6, 2, 9]
    args = lanes(T, 4, 2, 64, 4, torch.float32, context, seed=4)
    want = paged_attention(**args, scale=0.125)
    column = lambda t: torch.stack([t, t.roll(1)], 1)[:, 0]  # noqa: E731  the same values at stride 2
    strided = {name: column(args[name]) for name in ("slot_ids", "context_lens", "n_rows")}
    assert all(t.stride() == (2,) for t in strided.values())
    got = paged_attention(**(args | strided), scale=0.125)
    valid = (torch.arange(T, device=DEVICE)[None] < args["n_rows"][:, None])
    assert torch.equal(got[valid], want[valid])


def test_reference_reads_a_bounded_table_alike():
    """The eager reference reads only `max_pages` entries; a bound that covers every lane changes nothing."""
    args = lanes(5, 4, 2, 64, 4, torch.float32, [6, 2, 9], seed=5)
    full = paged_attention_ref(**args, scale=0.125)
    bounded = paged_attention_ref(**args, scale=0.125, max_pages=-(-(9 + 5) // 4))
    torch.testing.assert_close(bounded, full)


def test_bad_arguments_name_what_is_wrong():
    args = lanes(5, 4, 2, 64, 4, torch.float32, [6, 2, 9], seed=1)
    with pytest.raises(ValueError, match="mode must be"):
        paged_attention(**args, scale=1.0, mode="sideways")
    with pytest.raises(ValueError, match="tree_mask goes with mode"):
        paged_attention(**(args | {"tree_mask": torch.ones(3, 5, 5, dtype=torch.bool, device=DEVICE)}), scale=1.0)
    with pytest.raises(ValueError, match="do not fit"):
        paged_attention(**(args | {"q": args["q"][..., :3, :]}), scale=1.0)
    with pytest.raises(ValueError, match="context_lens must be"):
        paged_attention(**(args | {"context_lens": args["context_lens"][:2]}), scale=1.0)


@pytest.mark.parametrize("context", [0, 45], ids=["first-chunk", "after-45-keys"])
@pytest.mark.parametrize("nh,nkv,hd", [(4, 4, 64), (8, 2, 128), (16, 4, 256)], ids=["mha", "gqa4-hd128", "gqa4-hd256"])
def test_a_dense_chunk_matches_the_paged_reference(nh, nkv, hd, context):
    """ops/attention/dense.py against the paged reference: a first chunk (context 0; rows past a lane's
    valid rows hold finite values, the layer's projections of padding, which no valid row sees), and a
    one-lane chunk after committed keys, gathered with them into one dense run (the query rows last)."""
    from deltaflash.ops.attention.dense import causal_block_attention, supports

    T, page = 37, 8
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    assert supports(dtype, torch.device(DEVICE), hd)
    # with context, lane 0 is the one-lane chunk (all T rows valid: lanes() cuts only the last lane's)
    args = lanes(T, nh, nkv, hd, page, dtype, [context, 0, 0], seed=hd, pad_lane=False)
    kp, vp, tables, slots = args["key_pages"], args["value_pages"], args["block_tables"], args["slot_ids"]
    t = torch.arange(context + T, device=DEVICE)
    pages = tables[slots][:, t // page].long()  # [L, S]
    k, v = kp[pages, t % page], vp[pages, t % page]  # [L, S, nkv, hd]
    valid = (t[None] < context + args["n_rows"][:, None])[..., None, None]
    k, v = torch.where(valid, k, 3.0), torch.where(valid, v, -2.0)
    live = 1 if context else 3
    got = causal_block_attention(args["q"][:live], k[:live], v[:live], hd ** -0.5)
    want = paged_attention_ref(**args, scale=hd ** -0.5, mode="causal")
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for lane, n in enumerate(args["n_rows"].tolist()[:live]):
        assert torch.allclose(got[lane, :n].float(), want[lane, :n].float(), atol=tol, rtol=tol)


def test_a_fixed_shape_first_chunk_may_take_cudnn_and_nothing_else_does():
    """ops/attention/dense.backends: cuDNN's kernel leads only for a first chunk of a fixed shape on CUDA
    (it builds a plan per shape); every other chunk, and every chunk on the CPU, runs the flash kernel."""
    from torch.nn.attention import SDPBackend

    from deltaflash.ops.attention.dense import backends

    flash, cudnn = SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION
    q = torch.zeros(1, 4, 2, 8, device=DEVICE)
    for first_chunk, fixed_shape in ((True, False), (False, True), (False, False)):
        assert backends(q, first_chunk, fixed_shape) == [flash]
    assert backends(q, True, True) == ([cudnn, flash] if q.is_cuda and torch.backends.cudnn.is_available() else [flash])


@pytest.mark.skipif(DEVICE != "cuda", reason="cuDNN's attention runs on CUDA")
@pytest.mark.parametrize("T", [256, 1024])
def test_a_fixed_shape_first_chunk_on_cudnn_matches_the_flash_kernel_and_replays_exactly(T):
    """9B heads (16 / 4 of 256), two lanes: the fixed-shape route runs cuDNN's kernel (not the flash one),
    within bf16 rounding of the flash route, and a CUDA graph of it replays the eager call's bits."""
    from torch.profiler import ProfilerActivity, profile

    from deltaflash.engine.graphs import capture
    from deltaflash.ops.attention.dense import causal_block_attention

    g = torch.Generator(device=DEVICE).manual_seed(T)
    q, k, v = (torch.randn(2, T, h, 256, device=DEVICE, dtype=torch.bfloat16, generator=g) for h in (16, 4, 4))

    def kernels_of(fn):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return " ".join(e.name for e in prof.events() if e.device_type.name == "CUDA")

    fixed = lambda: causal_block_attention(q, k, v, 256 ** -0.5, fixed_shape=True)  # noqa: E731
    eager = fixed()
    assert "pytorch_flash" not in kernels_of(fixed) and "pytorch_flash" in kernels_of(
        lambda: causal_block_attention(q, k, v, 256 ** -0.5))
    want = causal_block_attention(q, k, v, 256 ** -0.5)
    torch.testing.assert_close(eager.float(), want.float(), atol=2e-2, rtol=2e-2)
    graph, out = capture(fixed, warmups=1)  # as the engine captures its prefill graphs
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@pytest.mark.parametrize("dtype", [torch.float32, HALF], ids=["fp32", "half"])
@pytest.mark.parametrize("L,T,nkv,hd,page", [(3, 5, 2, 64, 4), (1, 37, 4, 256, 16), (2, 3, 3, 40, 5)])
def test_kv_write_is_the_references_scatter(L, T, nkv, hd, page, dtype):
    """ops/attention/kv_write.py: keys (the RoPE kernel's contiguous output) and values (a strided view of
    the projection) of every row land at their storage rows, as naive.write_kv_ref puts them; rows of a
    padding lane and past a lane's valid rows all go to the sink page, which is never compared."""
    from deltaflash.cache.pages import BlockTables
    from deltaflash.ops.attention.kv_write import write_kv
    from deltaflash.ops.attention.naive import write_kv_ref

    g = torch.Generator().manual_seed(T * hd)
    slots = 4
    tables = BlockTables(slots, 64, page, DEVICE, num_pages=slots * -(-64 // page))
    tables.map([(s, i, s * tables.max_pages + i) for s in range(slots) for i in range(tables.max_pages)])
    slot_ids = torch.tensor([2, -1, 0][:L] if L > 1 else [3], device=DEVICE)
    positions = torch.randint(0, 60 - T, (L, 1), generator=g).to(DEVICE) + torch.arange(T, device=DEVICE)
    keep = torch.arange(T, device=DEVICE)[None] < torch.tensor([T, T, T - 1][:L], device=DEVICE)[:, None]
    rows = tables.rows(slot_ids, positions, keep)
    keys = torch.randn(L, T, nkv, hd, generator=g).to(dtype).to(DEVICE)
    projection = torch.randn(L, T, 3 * nkv * hd, generator=g).to(dtype).to(DEVICE)
    values = projection[..., nkv * hd:2 * nkv * hd].unflatten(-1, (nkv, hd))  # strided, as the layer's v
    shape = (tables.num_pages + 1, page, nkv, hd)
    caches = [torch.randn(shape, generator=g).to(dtype).to(DEVICE) for _ in range(2)]
    got, want = [c.clone() for c in caches], [c.clone() for c in caches]
    write_kv(*got, rows, keys, values)
    write_kv_ref(*want, rows, keys, values)
    for a, b, before in zip(got, want, caches):
        assert torch.equal(a[:-1], b[:-1])  # the sink page (last) takes whatever padding rows write
        assert not torch.equal(a[:-1], before[:-1])
    with pytest.raises(ValueError, match="unit feature stride"):
        write_kv(*got, rows, keys, projection[..., ::3][..., :nkv * hd].unflatten(-1, (nkv, hd)))


def test_the_dense_routes_gather_is_bounded_for_the_memory_plan():
    from deltaflash.ops.attention.dense import MAX_DENSE_KEYS, gather_bytes

    assert gather_bytes(262144, 4, 256, torch.bfloat16) == 2 * MAX_DENSE_KEYS * 4 * 256 * 2  # 9B shape: 128 MiB
    assert gather_bytes(1000, 2, 64, torch.float32) == 2 * 1000 * 2 * 64 * 4  # never more than the context


# ---- a tree commit's K/V moves (tree_rows.py against naive.move_tree_rows_ref and a by-hand walk) ----------
def tree_commit_case(page: int, T: int, seed: int):
    """Caches of 3 layers in pages of `page` rows, shuffled over 4 slots' tables (+ the padding row, all
    sink), lanes at odd starts with random root paths of T-node trees (node ids grow by 1-3 a depth; the
    ids past a path are 0, as acceptance pads them), accepted counts 1..len, a chain lane and a padding lane."""
    g = torch.Generator().manual_seed(seed)
    S, max_pages = 4, -(-(11 + T) // page)  # room for the latest start's T rows
    P = S * max_pages
    shape = (3, P + 1, page, 2, 5)
    key_cache, value_cache = (torch.randn(shape, generator=g).to(DEVICE) for _ in range(2))
    tables = torch.full((S + 1, max_pages), P, dtype=torch.int32)
    tables[:S] = torch.randperm(P, generator=g).view(S, max_pages).int()
    slot_ids, start, nodes, rows = [2, 0, 3, -1, 1], [3, 11, 0, 0, 7], [], []
    for lane in range(len(slot_ids)):
        path = [0]
        while lane != 2 and path[-1] + 1 < T:  # lane 2: a chain (nothing moves)
            step = path[-1] + 1 + int(torch.randint(0, 3, (), generator=g))
            if step >= T:
                break
            path.append(step)
        if lane == 2:
            path = list(range(T))
        nodes.append(path + [0] * (T - len(path)))
        rows.append(len(path) if lane == 0 else 1 + int(torch.randint(0, len(path), (), generator=g)))
    to = lambda x: torch.tensor(x, device=DEVICE)  # noqa: E731
    return key_cache, value_cache, tables.to(DEVICE), to(slot_ids), to(start), to(nodes), to(rows)


def moved_by_hand(key_cache, value_cache, tables, slot_ids, start, nodes, rows):
    """The expected caches: every accepted node's row (gathered first) at start + its place in the path."""
    page, out = key_cache.shape[2], (key_cache.clone(), value_cache.clone())
    at = lambda slot, pos: (int(tables[slot, pos // page]), pos % page)  # noqa: E731
    for slot, first, path, n in zip(slot_ids.tolist(), start.tolist(), nodes.tolist(), rows.tolist()):
        if slot < 0:
            continue
        for cache, moved in zip((key_cache, value_cache), out):
            rows_of_path = [cache[:, p, r].clone() for p, r in (at(slot, first + node) for node in path[:n])]
            for t, row in enumerate(rows_of_path):
                moved[:, at(slot, first + t)[0], at(slot, first + t)[1]] = row
    return out


@pytest.mark.parametrize("page,T", [(1, 6), (3, 9), (4, 16), (16, 12)])
def test_tree_commit_moves_match_the_reference_and_the_walk(page, T):
    from deltaflash.ops.attention.naive import move_tree_rows_ref
    from deltaflash.ops.attention.tree_rows import move_tree_rows

    for seed in range(3):
        case = tree_commit_case(page, T, seed)
        expected = moved_by_hand(*case)
        assert not torch.equal(expected[0], case[0])  # some row moves
        for move in (move_tree_rows_ref, move_tree_rows):
            key_cache, value_cache = case[0].clone(), case[1].clone()
            sink = key_cache[:, -1].clone(), value_cache[:, -1].clone()
            move(key_cache, value_cache, *case[2:])
            # the padding lane's and unmoved rows may be written back to the sink; every owned row is exact
            assert torch.equal(key_cache[:, :-1], expected[0][:, :-1]), move.__name__
            assert torch.equal(value_cache[:, :-1], expected[1][:, :-1]), move.__name__
            if move is move_tree_rows:  # the kernel touches nothing it does not move
                assert torch.equal(key_cache[:, -1], sink[0]) and torch.equal(value_cache[:, -1], sink[1])
