"""Paged attention in Triton: K/V read in place from the lanes' pages, up to each lane's real length.

Reference and contract: naive.py; the math and the choices: README.md. One program per (lane, kv head,
tile of BM query rows, split of the key range). The query heads that share a kv head are stacked as rows
(row m = t * REP + r for block row t and head g * REP + r), so each K/V tile is read once per kv head. A
program walks its keys in tiles of BN, gathering each key's page from the lane's block table (pages need
not be as large as a tile), with an online softmax in fp32: first the whole tiles of committed keys,
which every row sees (no masks), then the rest with the causal / tree / window masks. The key range is
cut at fixed multiples of `split_keys` (flash-decoding: one program per piece, `combine_kernel` merges
them by log-sum-exp; a piece past a lane's length exits at once, so a CUDA graph captured for the
table's capacity replays for any lengths).

Batch invariance: a row's result is the same bits whatever rows, lanes and lengths share the launch.
Split calls take 16-row tiles for short blocks and 64-row ones for long blocks (`tiles`), both on
mma.sync with each row's softmax sum taken by a product with ones, so a row's arithmetic does not
depend on the tile's height (wgmma's does: Hopper's 64-row products differ from mma.sync's in the last
bits); key tiles and splits start at fixed multiples of BN and `split_keys`, a tile a row cannot see
leaves its running max, sum and accumulator exactly as they were, and a mask that hides nothing
changes no bit (so skipping it on committed tiles is free); the split size is a function of the
table's capacity alone. So attention gives a verify row, a decode row and a tree node at the same
position the same bits (the products around it must too for equal logits: ops/gemm).

Compiles: Triton would specialise the integer arguments by value (== 1, divisible by 16), so a prefill
of 16 or 32 rows would compile a new binary in the middle of serving; the block height (T, R) is marked
not to specialise, so after start-up's warm-up no prompt length compiles anything.
"""

from __future__ import annotations

import contextlib
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from deltaflash.ops.attention.naive import MODES

_MODE_IDS = {name: i for i, name in enumerate(MODES)}  # causal 0, full 1, tree 2
MAX_SPLITS = 128
MIN_SPLIT_KEYS = 256
# A split call of at most this many (lane, kv head) pairs takes 16-row tiles at any block height: a 64-row
# tile gives each pair one program a split (one lane of the 9B shape: 4 programs on 132 SMs), four 16-row
# tiles give it four, which reread the pair's key tiles from L2. H100, one 9B layer, a 16-row verify block,
# tables of 262,144 positions (`bench attention --key-tiles 16:64:2:dotsum`): one lane 0.038 -> 0.018 ms
# at 256 keys, 0.157 -> 0.069 at 4k, 0.212 -> 0.125 at 32k; four lanes gain to 4k and lose at 32k (0.312
# -> 0.387), sixteen lose. A row's bits are the same at either height (`tiles`).
FEW_PAIRS = 4


@triton.jit
def _rows(first, i_g, stride_t, stride_h, T, REP: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr):
    """Rows first .. first + BM - 1 of a program's (lane, kv head): (row m, block row t, valid, the offset
    of each (row, dim) in a [T, nh, hd] tensor of strides (stride_t, stride_h, 1))."""
    o_m = first + tl.arange(0, BM)
    o_t = o_m // REP
    p = o_t[:, None].to(tl.int64) * stride_t + (i_g * REP + o_m % REP)[:, None] * stride_h + tl.arange(0, BD)[None, :]
    return o_m, o_t, o_t < T, p


@triton.jit
def _rows_of_q(q_lane, first, i_g, stride_q_t, stride_q_h, T, live, REP: tl.constexpr, HD: tl.constexpr,
               BD: tl.constexpr, BM: tl.constexpr):
    """(block row t, valid, the query rows [BM, BD]) of a row tile starting at row `first` (not read
    unless `live`: a program with no keys to walk)."""
    _, o_t, m_m, p_q = _rows(first, i_g, stride_q_t, stride_q_h, T, REP, BD, BM)
    return o_t, m_m, tl.load(q_lane + p_q, mask=(m_m & live)[:, None] & (tl.arange(0, BD) < HD)[None, :], other=0.0)


@triton.jit
def _rows_over_keys(b_q, b_k, b_v, o_t, m_m, o_n, m_n, ctx, t_mask, T, scale, window, b_max, b_sum, b_acc,
                    MODE: tl.constexpr, WINDOWED: tl.constexpr, IEEE: tl.constexpr, SUM_BY_DOT: tl.constexpr,
                    MASKED: tl.constexpr):
    """A tile of query rows (block rows o_t) over one key tile (keys o_n, valid m_n): the online
    softmax's update of (running max, sum, accumulator). A key the rows cannot see leaves them as they
    were, to the bit (the max stays, p is 0, the rescale is exp(0) = 1). Not MASKED: every key of the
    tile is a committed key every row sees (the mask would change no bit), so only the valid keys' scores are kept."""
    if IEEE:
        b_s = tl.dot(b_q, tl.trans(b_k), input_precision="ieee") * scale
    else:
        b_s = tl.dot(b_q, tl.trans(b_k)) * scale
    if MASKED:
        o_b = o_n - ctx  # index inside the block; < 0: a committed key, visible to every row
        if MODE == 0:
            m_vis = (o_b[None, :] < 0) | (o_b[None, :] <= o_t[:, None])
        elif MODE == 1:
            m_vis = (o_t[:, None] >= 0) & m_n[None, :]
        else:
            m_tree = m_m[:, None] & (o_b >= 0)[None, :] & m_n[None, :]
            b_tree = tl.load(t_mask + o_t[:, None] * T + o_b[None, :], mask=m_tree, other=0)
            m_vis = (o_b[None, :] < 0) | (b_tree != 0)
        m_vis = m_vis & m_n[None, :]
        if WINDOWED:
            distance = (ctx + o_t)[:, None] - o_n[None, :]
            m_vis = m_vis & (distance < window) & (-distance < window)
        b_s = tl.where(m_vis, b_s, float("-inf"))
    else:  # (a select all the same: both paths give the compiler one sequence around the scores - no fma
        b_s = tl.where(m_n[None, :], b_s, float("-inf"))  # of the scale into the exponent on one path only)
    b_new = tl.maximum(b_max, tl.max(b_s, 1))
    b_safe = tl.where(b_new == float("-inf"), 0.0, b_new)  # a row that has seen nothing yet
    b_p = tl.exp(b_s - b_safe[:, None])
    b_alpha = tl.exp(b_max - b_safe)
    if SUM_BY_DOT:  # the row sums as products with a column of ones: the tensor cores' order, not the layout's
        ones = tl.full([b_k.shape[0], 16], 1.0, b_v.dtype)
        if IEEE:
            b_sums = tl.dot(b_p.to(b_v.dtype), ones, input_precision="ieee")
        else:
            b_sums = tl.dot(b_p.to(b_v.dtype), ones)
        b_sum = b_sum * b_alpha + tl.max(b_sums, 1)  # (its 16 columns are the same bits)
    else:
        b_sum = b_sum * b_alpha + tl.sum(b_p, 1)
    # the product accumulates onto the rescaled accumulator
    if IEEE:
        b_acc = tl.dot(b_p.to(b_v.dtype), b_v, b_acc * b_alpha[:, None], input_precision="ieee")
    else:
        b_acc = tl.dot(b_p.to(b_v.dtype), b_v, b_acc * b_alpha[:, None])
    return b_new, b_sum, b_acc


@triton.jit
def _key_tile(k_pages, v_pages, p_table, start, s_lo, s_hi, i_g, stride_p, stride_s, stride_h,
              PAGE: tl.constexpr, HD: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr, MASKED: tl.constexpr):
    """Keys start .. start + BN - 1 (valid: those in [s_lo, s_hi)): (keys, valid, K tile, V tile), each
    key's row gathered from its page (K and V pages share one layout). Not MASKED: all of them valid."""
    o_n = start + tl.arange(0, BN)
    o_d = tl.arange(0, BD)
    m_n = (o_n >= s_lo) & (o_n < s_hi)
    if MASKED:
        page = tl.load(p_table + o_n // PAGE, mask=m_n, other=0).to(tl.int64)
    else:
        page = tl.load(p_table + o_n // PAGE).to(tl.int64)
    p_kv = (page * stride_p + (o_n % PAGE) * stride_s + i_g * stride_h)[:, None] + o_d[None, :]
    if MASKED or BD != HD:
        m_kv = m_n[:, None] & (o_d < HD)[None, :]
        b_k = tl.load(k_pages + p_kv, mask=m_kv, other=0.0)
        b_v = tl.load(v_pages + p_kv, mask=m_kv, other=0.0)
    else:
        b_k = tl.load(k_pages + p_kv)
        b_v = tl.load(v_pages + p_kv)
    return o_n, m_n, b_k, b_v


@triton.jit
def _store_rows(out, part_out, part_lse, first, i_g, stride_o_t, stride_o_h, part_base, b_max, b_sum, b_acc,
                visited, T, REP: tl.constexpr, HD: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr,
                SPLIT: tl.constexpr):
    """A row tile's result: its rows' output (one piece), or their partial output and log-sum-exp."""
    o_m, o_t, m_m, p_o = _rows(first, i_g, stride_o_t, stride_o_h, T, REP, BD, BM)
    o_d = tl.arange(0, BD)
    b_o = b_acc / tl.where(b_sum > 0, b_sum, 1.0)[:, None]  # a row that sees no key gives zeros
    if not SPLIT:
        tl.store(out + p_o, b_o.to(out.dtype.element_ty), mask=m_m[:, None] & (o_d < HD)[None, :])
    else:
        # partial results of the R = T * REP valid rows only (a decode row of the 9B shape: 4 of the 16)
        i_part = part_base + o_m
        if visited:
            tl.store(part_out + i_part[:, None] * BD + o_d[None, :], b_o, mask=m_m[:, None])
        tl.store(part_lse + i_part, tl.where(b_sum > 0, b_max + tl.log(b_sum), float("-inf")), mask=m_m)


@triton.jit(do_not_specialize=["T", "R", "SPLITS"])  # one binary for every block height and split count
def paged_attention_kernel(
    q, k_pages, v_pages, block_tables, slot_ids, context_lens, n_rows, tree_mask, out, part_out, part_lse,
    stride_q_l, stride_q_t, stride_q_h, stride_kv_p, stride_kv_s, stride_kv_h,
    stride_bt, stride_o_l, stride_o_t, stride_o_h,
    T, NKV, scale, window, R, split_keys, SPLITS,
    PAGE: tl.constexpr, REP: tl.constexpr, HD: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr,
    BN: tl.constexpr, MODE: tl.constexpr, WINDOWED: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr,
    SUM_BY_DOT: tl.constexpr, SYNC_MMA: tl.constexpr, UNMASKED_FIRST: tl.constexpr,
):
    """A program: BM query rows of one (lane, kv head) over one split's keys. (SYNC_MMA only keeps the
    mma.sync build apart from the wgmma one in Triton's in-memory cache: `_mma_sync`.)"""
    # row tiles innermost: the programs of one (lane, kv head, split) run side by side and share its K/V in L2
    i_m, i_lg, i_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_l = (i_lg // NKV).to(tl.int64)
    i_g = i_lg % NKV
    slot = tl.load(slot_ids + i_l)
    ctx = tl.load(context_lens + i_l)
    kv_end = tl.where(slot >= 0, ctx + tl.load(n_rows + i_l), 0)
    if SPLIT:
        if i_s * split_keys >= kv_end:  # a piece past the lane's keys, which the combine never reads: at a
            return  # long capacity nearly all of the grid
    first = i_m * BM

    # the keys any row of this program can see: [lo, hi)
    t_lo = first // REP
    t_hi = tl.minimum((first + BM - 1) // REP, T - 1)
    hi = kv_end
    if MODE != 1:  # causal / tree rows see no block row past their own
        hi = tl.minimum(hi, ctx + t_hi + 1)
    lo = 0
    if WINDOWED:
        lo = tl.maximum(ctx + t_lo - window + 1, 0)
        hi = tl.minimum(hi, ctx + t_hi + window)
    # this split's share of them: keys [i_s, i_s + 1) * split_keys, walked in tiles at multiples of BN
    s_lo = tl.maximum(lo, i_s * split_keys)
    s_hi = tl.minimum(hi, (i_s + 1) * split_keys)
    t_start = (s_lo // BN) * BN
    live = s_lo < s_hi
    # whole tiles of committed keys first, which every row sees: no masks (a window masks every tile)
    t_full = t_start
    if not WINDOWED:
        t_full = tl.maximum(t_start, t_start + (tl.minimum(s_hi, ctx) - t_start) // BN * BN)
        t_full = tl.where(s_lo == t_start, t_full, t_start)

    o_t, m_m, b_q = _rows_of_q(q + i_l * stride_q_l, first, i_g, stride_q_t, stride_q_h, T, live, REP, HD, BD, BM)
    b_max = tl.full([BM], float("-inf"), tl.float32)
    b_sum = tl.zeros([BM], dtype=tl.float32)
    b_acc = tl.zeros([BM, BD], dtype=tl.float32)
    p_table = block_tables + tl.maximum(slot, 0).to(tl.int64) * stride_bt
    t_mask = tree_mask + i_l * T * T
    if UNMASKED_FIRST:
        for start in range(t_start, t_full, BN):
            o_n, m_n, b_k, b_v = _key_tile(k_pages, v_pages, p_table, start, s_lo, s_hi, i_g, stride_kv_p, stride_kv_s,
                                           stride_kv_h, PAGE, HD, BD, BN, False)
            b_max, b_sum, b_acc = _rows_over_keys(b_q, b_k, b_v, o_t, m_m, o_n, m_n, ctx, t_mask, T, scale, window,
                                                  b_max, b_sum, b_acc, MODE, WINDOWED, IEEE, SUM_BY_DOT, False)
    else:
        t_full = t_start
    for start in range(t_full, s_hi, BN):
        o_n, m_n, b_k, b_v = _key_tile(k_pages, v_pages, p_table, start, s_lo, s_hi, i_g, stride_kv_p, stride_kv_s,
                                       stride_kv_h, PAGE, HD, BD, BN, True)
        b_max, b_sum, b_acc = _rows_over_keys(b_q, b_k, b_v, o_t, m_m, o_n, m_n, ctx, t_mask, T, scale, window,
                                              b_max, b_sum, b_acc, MODE, WINDOWED, IEEE, SUM_BY_DOT, True)
    part_base = (i_lg.to(tl.int64) * SPLITS + i_s) * R
    _store_rows(out + i_l * stride_o_l, part_out, part_lse, first, i_g, stride_o_t, stride_o_h, part_base, b_max,
                b_sum, b_acc, live, T, REP, HD, BD, BM, SPLIT)


@triton.jit(do_not_specialize=["T", "R", "SPLITS"])
def combine_kernel(part_out, part_lse, out, slot_ids, context_lens, n_rows, stride_o_l, stride_o_t, stride_o_h, T,
                   NKV, R, split_keys, SPLITS, REP: tl.constexpr, HD: tl.constexpr, BD: tl.constexpr,
                   BM: tl.constexpr):
    """out = sum_s exp(lse_s) o_s / sum_s exp(lse_s) over the splits of one (lane, kv head, row tile), in
    split order, up to the last split holding one of the lane's keys: the capacity's other splits have lse
    -inf, weight 0 and no output rows, and adding their zeros changes no bit, so a long table costs a short
    lane nothing here (a loop over all SPLITS, 128 at 32k or more, was ~0.1 ms per layer at one lane)."""
    i_lg, i_m = tl.program_id(0), tl.program_id(1)
    i_l = (i_lg // NKV).to(tl.int64)
    i_g = i_lg % NKV
    slot = tl.load(slot_ids + i_l)
    kv_end = tl.where(slot >= 0, tl.load(context_lens + i_l) + tl.load(n_rows + i_l), 0)
    live = tl.minimum(tl.cdiv(kv_end, split_keys), SPLITS)
    o_m = i_m * BM + tl.arange(0, BM)
    o_t = o_m // REP
    o_d = tl.arange(0, BD)
    m_r = o_t < T
    base = i_lg.to(tl.int64) * SPLITS * R
    b_top = tl.full([BM], float("-inf"), tl.float32)
    for s in range(live):
        b_top = tl.maximum(b_top, tl.load(part_lse + base + s * R + o_m, mask=m_r, other=float("-inf")))
    b_top = tl.where(b_top == float("-inf"), 0.0, b_top)
    b_num = tl.zeros([BM, BD], dtype=tl.float32)
    b_den = tl.zeros([BM], dtype=tl.float32)
    for s in range(live):
        b_w = tl.exp(tl.load(part_lse + base + s * R + o_m, mask=m_r, other=float("-inf")) - b_top)
        b_part = tl.load(part_out + (base + s * R + o_m)[:, None] * BD + o_d[None, :],
                         mask=(m_r & (b_w > 0))[:, None], other=0.0)  # an empty split wrote no output rows
        b_num += b_w[:, None] * b_part
        b_den += b_w
    b_o = b_num / tl.where(b_den > 0, b_den, 1.0)[:, None]
    p_o = (out + i_l * stride_o_l + o_t[:, None].to(tl.int64) * stride_o_t
           + (i_g * REP + o_m % REP)[:, None] * stride_o_h + o_d[None, :])
    tl.store(p_o, b_o.to(out.dtype.element_ty), mask=m_r[:, None] & (o_d < HD)[None, :])


class Tile(NamedTuple):
    """A launch's tiles: `rows` query rows per program (BM), `keys` per key tile (BN), pipeline `stages`,
    `warps`; `sync_mma` compiles the products on mma.sync whatever the height (else Triton takes wgmma
    for 64 rows on Hopper); `sum_by_dot` sums each row's softmax weights by a product with ones."""
    rows: int
    keys: int
    stages: int
    warps: int
    sync_mma: bool = False
    sum_by_dot: bool = False
    unmasked_first: bool = True  # whole tiles of committed keys walked first, without masks
    max_registers: int | None = None  # ptxas's cap per thread (occupancy: 65,536 per SM / (32 x warps x cap))


def tiles(head_dim: int, split: bool = True, rows: int = 1, pairs: int | None = None) -> Tile:
    """The tiles of a call of `rows` query rows per lane (T x rep) over `pairs` (lane, kv head) pairs (None:
    many; at most FEW_PAIRS: 16-row tiles whatever the height).

    Split calls (decode rows, verify blocks and trees, the drafter's block) must give a row the same bits
    whatever block it sits in (module docstring), and both heights below do: each row's products are
    mma.sync's (m16n8k16, k in order) and its softmax row sum is a product with ones, not a reduction in
    the warps' layout (a verify block's rows equal the same rows decoded alone, to the bit, on the H200:
    tests/test_ops_attention.py). Up to 16 rows (a decode row of the 9B shape is 4): one 16-row tile in
    four warps, which wastes least on a short block (16 lanes x 32k keys, 9B layer: 0.52 ms, 1.03x the
    byte roofline; in eight warps 0.70: 182 registers a thread hold an SM per program, four warps' 255
    let two programs share it). More rows (a 16-row verify block is 64): 64-row tiles in four warps, each
    warp 16 rows over the whole key tile (16 x 32k keys: 0.98 ms, 1.95x, against 1.43 in eight warps,
    1.27 on wgmma, 1.68 as four 16-row tiles of one program sharing each key tile, the scheme before;
    H200, `bench attention --key-tiles`, docs/benchmarks.md). Unsplit calls (prefill chunks after committed keys: their rows fill the GPU
    alone, and no other kind of row is compared with theirs, README) take 64-row tiles on wgmma. Keys:
    tiles of 64 in a 2-stage cp.async pipeline for heads wider than 128 (16 lanes x 128k keys 8.46 ms
    with 16-key tiles, 4.74 ms with 64); narrower heads 32 keys, 3 stages."""
    BN, stages = (32, 3) if head_dim <= 128 else (64, 2)
    warps = 4 if head_dim <= 128 else 8
    if not split:
        return Tile(64, BN, stages, warps)
    if rows <= 16 or (pairs is not None and pairs <= FEW_PAIRS):
        return Tile(16, BN, stages, 4, sum_by_dot=True)
    return Tile(64, BN, stages, 4, sync_mma=True, sum_by_dot=True)


def key_tile_of(key_tile: tuple, head_dim: int, split: bool, rows: int) -> Tile:
    """bench attention's tile sweep: ([BM,] BN, stages[, flags]) as a Tile; flags "dotsum" (sum_by_dot),
    "v2" (sync_mma and sum_by_dot), "wN" (N warps), "rN" (at most N registers a thread), "onepass" (every
    key tile masked, not unmasked_first). Unflagged tiles sum in the layout's order on the height's own
    instructions."""
    default = tiles(head_dim, split, rows)
    flags = [t for t in key_tile if isinstance(t, str)]
    sizes = [t for t in key_tile if not isinstance(t, str)]
    BM, BN, stages = sizes if len(sizes) == 3 else (default.rows, *sizes)
    def numbered(letter, otherwise):
        return next((int(f[1:]) for f in flags if f[:1] == letter and f[1:].isdigit()), otherwise)
    return Tile(BM, BN, stages, numbered("w", default.warps), sync_mma="v2" in flags,
                sum_by_dot=bool({"dotsum", "v2"} & set(flags)), unmasked_first="onepass" not in flags,
                max_registers=numbered("r", default.max_registers))


def split_keys_for(max_keys: int) -> int:
    """Keys per split for a table of `max_keys` positions: about MAX_SPLITS pieces of its capacity (a
    power of two, at least MIN_SPLIT_KEYS), so one lane's long context spreads over many programs while
    short contexts stay one piece. A function of the capacity alone (batch invariance)."""
    floor_pow2 = 1 << max(int(max_keys).bit_length() - 1, 0)
    return max(MIN_SPLIT_KEYS, floor_pow2 // MAX_SPLITS)


@contextlib.contextmanager
def _mma_sync(on: bool):
    """Compiles inside use mma.sync for every tile height: Triton's DISABLE_MMA_V3, an environment
    variable read at compile time and part of its disk cache's key (the kernel's SYNC_MMA constexpr keeps
    the two builds apart in its in-memory cache). Set only around the launch; a kernel another thread
    compiles meanwhile would take mma.sync too - slower, never wrong."""
    if not on:
        yield
        return
    old = os.environ.get("DISABLE_MMA_V3")
    os.environ["DISABLE_MMA_V3"] = "1"
    try:
        yield
    finally:
        if old is None:
            del os.environ["DISABLE_MMA_V3"]
        else:
            os.environ["DISABLE_MMA_V3"] = old


def paged_attention_fwd(q, key_pages, value_pages, block_tables, slot_ids, context_lens, n_rows, scale: float,
                        mode: str, tree_mask, window: int | None, split_keys: int, out: torch.Tensor,
                        key_tile: tuple[int, ...] | None = None, split: bool = True) -> torch.Tensor:
    L, T, nh, hd = q.shape
    nkv = key_pages.shape[2]
    rep = nh // nkv
    R = T * rep
    tile = tiles(hd, split, R, L * nkv) if key_tile is None else key_tile_of(key_tile, hd, split, R)
    splits = triton.cdiv(block_tables.shape[1] * key_pages.shape[1], split_keys)
    BD = triton.next_power_of_2(hd)
    if splits > 1:
        part_out = torch.empty(L * nkv * splits * R, BD, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(L * nkv * splits * R, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused
    grid = (triton.cdiv(R, tile.rows), L * nkv, splits)
    with _mma_sync(tile.sync_mma):
        paged_attention_kernel[grid](
            q, key_pages, value_pages, block_tables, slot_ids, context_lens, n_rows,
            q if tree_mask is None else tree_mask, out, part_out, part_lse,
            q.stride(0), q.stride(1), q.stride(2), *key_pages.stride()[:3],
            block_tables.stride(0), out.stride(0), out.stride(1), out.stride(2),
            T, nkv, scale, window or 0, R, split_keys, splits,
            PAGE=key_pages.shape[1], REP=rep, HD=hd, BD=BD, BM=tile.rows, BN=tile.keys, MODE=_MODE_IDS[mode],
            WINDOWED=window is not None, SPLIT=splits > 1, IEEE=q.dtype == torch.float32,
            SUM_BY_DOT=tile.sum_by_dot, SYNC_MMA=tile.sync_mma, UNMASKED_FIRST=tile.unmasked_first, num_warps=tile.warps, num_stages=tile.stages,
            maxnreg=tile.max_registers,
        )
    if splits > 1:
        # (a row's merge is its own: the combine's row tiles need not be the attention's)
        combine_kernel[(L * nkv, triton.cdiv(R, 64))](part_out, part_lse, out, slot_ids, context_lens, n_rows,
                                                      out.stride(0), out.stride(1), out.stride(2), T, nkv, R,
                                                      split_keys, splits, REP=rep, HD=hd, BD=BD, BM=64, num_warps=4)
    return out


def paged_attention(q: torch.Tensor, key_pages: torch.Tensor, value_pages: torch.Tensor, block_tables: torch.Tensor,
                    slot_ids: torch.Tensor, context_lens: torch.Tensor, n_rows: torch.Tensor | None = None, *,
                    scale: float, mode: str = "causal", tree_mask: torch.Tensor | None = None,
                    window: int | None = None, max_pages: int | None = None, split: bool = True,
                    split_keys: int | None = None, key_tile: tuple[int, ...] | None = None) -> torch.Tensor:
    """naive.paged_attention_ref reading the pages in place (same arguments; `max_pages` is not needed:
    each lane reads up to its own length). split_keys: keys per flash-decoding split, a multiple of 64
    (None: `split_keys_for` the table's capacity; with `split` False the whole table, one piece: no
    partial results and no combine, for calls with rows enough to fill the GPU - prefill chunks - on
    64-row tiles: `tiles`).
    key_tile: (keys per tile, pipeline stages), or (query rows per tile, keys per tile, stages), instead of
    `tiles`' choice, for timing other tiles; trailing flags (`key_tile_of`): "dotsum" sums each row's
    softmax weights by a product with ones, "v2" does too on mma.sync at any height, "w4" launches 4 warps."""
    L, T, nh, hd = q.shape
    P, page_size, nkv, hd_k = key_pages.shape
    if value_pages.shape != key_pages.shape or hd_k != hd or nh % nkv:
        raise ValueError(f"q {tuple(q.shape)}, key_pages {tuple(key_pages.shape)} and value_pages "
                         f"{tuple(value_pages.shape)} do not fit: [L, T, nh, hd] and [P, page, nkv, hd], nh % nkv == 0")
    if key_pages.stride(-1) != 1 or value_pages.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("q and the pages need unit stride over head_dim")
    if value_pages.stride() != key_pages.stride():
        raise ValueError(f"key and value pages need one layout, got strides {key_pages.stride()} and "
                         f"{value_pages.stride()}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if (mode == "tree") != (tree_mask is not None):
        raise ValueError("tree_mask goes with mode 'tree', and only with it")
    if mode == "tree" and (tree_mask.shape != (L, T, T) or window is not None):
        raise ValueError(f"tree_mask must be [{L}, {T}, {T}] (and trees take no window), got {tuple(tree_mask.shape)}")
    for name, t in (("slot_ids", slot_ids), ("context_lens", context_lens)):
        if t.shape != (L,):
            raise ValueError(f"{name} must be [{L}], got {tuple(t.shape)}")
    n_rows = torch.full_like(context_lens, T) if n_rows is None else n_rows
    capacity = block_tables.shape[1] * page_size
    split_keys = split_keys or (split_keys_for(capacity) if split else -(-capacity // 64) * 64)
    if split_keys % 64:
        raise ValueError(f"split_keys must be a multiple of 64, got {split_keys}")
    out = torch.empty_like(q)
    if L == 0 or T == 0:
        return out
    mask = None if tree_mask is None else tree_mask.to(torch.int8).contiguous()
    # the kernel reads the per-lane vectors at unit stride: a strided view (the models pass a column of
    # the positions as context_lens) would give lane l another lane's entry
    lanes = [t.long().contiguous() for t in (slot_ids, context_lens, n_rows)]
    return paged_attention_fwd(q, key_pages, value_pages, block_tables.contiguous(), *lanes,
                               scale, mode, mask, window, split_keys, out, key_tile, split)
