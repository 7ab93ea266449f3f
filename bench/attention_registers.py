"""Registers, spills and shared memory of the paged attention kernel per tile, compiled for sm_90
without a GPU (Triton's sm_90 target, then ptxas -v on the PTX).

The compile is given what Triton's launcher tells the compiler at run time: every pointer and every
integer argument that is a multiple of 16 (strides, the page size, the split) is marked divisible by 16.
Without those marks the compiler cannot prove 16-byte alignment: it emits 2-byte loads and no cp.async
pipeline, and the counts are not the kernel's (at BN 16 it reported 222 registers; the kernel as launched
uses 142 and pipelines its K/V loads with cp.async).

Usage: python bench/attention_registers.py   (CPU is enough)

Shapes of the 9B target (16 query / 4 kv heads of 256, bf16) at decode (1 row) and verify (16 rows)
and of the demo pair's (hd 64), every mask mode, with and without key-range splits.
"""

import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource

from deltaflash.ops.attention.paged import _mma_sync, key_tile_of, paged_attention_kernel, tiles

POINTERS = dict(q="*bf16", k_pages="*bf16", v_pages="*bf16", block_tables="*i32", slot_ids="*i64",
                context_lens="*i64", n_rows="*i64", tree_mask="*i8", out="*bf16", part_out="*fp32", part_lse="*fp32")
FLOATS = ("scale",)
DIVISIBLE = set(POINTERS) | {"stride_q_l", "stride_q_t", "stride_q_h", "stride_kv_p", "stride_kv_s", "stride_kv_h",
                             "stride_bt", "stride_o_l", "stride_o_t",
                             "stride_o_h", "split_keys"}


def report(T: int, rep: int, hd: int, mode: int, splits: int, key_tile: tuple[int, ...] | None = None) -> str:
    tile = tiles(hd, splits > 1, T * rep) if key_tile is None else key_tile_of(key_tile, hd, splits > 1, T * rep)
    BM, BN, stages = tile.rows, tile.keys, tile.stages
    options = dict(num_warps=tile.warps, num_stages=stages, maxnreg=tile.max_registers)
    consts = dict(PAGE=16, REP=rep, HD=hd, BD=triton.next_power_of_2(hd), BM=BM, BN=BN, MODE=mode, WINDOWED=False,
                  SPLIT=splits > 1, IEEE=False, SUM_BY_DOT=tile.sum_by_dot, SYNC_MMA=tile.sync_mma,
                  UNMASKED_FIRST=tile.unmasked_first)
    names = paged_attention_kernel.arg_names
    signature = {name: POINTERS.get(name, "constexpr" if name in consts else "fp32" if name in FLOATS else "i64")
                 for name in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names) if name in DIVISIBLE}
    with _mma_sync(tile.sync_mma):
        kernel = triton.compile(ASTSource(paged_attention_kernel, signature, consts, attrs),
                                target=GPUTarget("cuda", 90, 32), options=options)
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "attention.ptx"
        ptx.write_text(kernel.asm["ptx"])
        out = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", str(ptx), "-o", str(Path(tmp) / "a.cubin")],
                             capture_output=True, text=True, check=True).stderr
    found = ", ".join(re.findall(r"Used \d+ registers|\d+ bytes spill stores|\d+ bytes spill loads", out))
    ptx_text = kernel.asm["ptx"]
    piped = "cp.async pipeline" if "cp.async" in ptx_text else "no cp.async"
    mma = "wgmma" if "wgmma" in ptx_text else "mma.sync" if "mma.sync" in ptx_text else "no tensor-core op"
    return f"BM {BM} BN {BN} stages {stages} warps {tile.warps}: {found}, {kernel.metadata.shared} bytes shared, {piped}, {mma}"


if __name__ == "__main__":
    for name, T, rep, hd in (("9B decode", 1, 4, 256), ("9B verify W16", 16, 4, 256), ("demo verify W8", 8, 2, 64)):
        for mode, label in ((0, "causal"), (2, "tree")):
            for splits in (1, 8):
                print(f"{name:15s} {label:6s} splits {splits}: {report(T, rep, hd, mode, splits)}")
    for key_tile in ((32, 3), (64, 3), (64, 64, 2), (16, 64, 2, "dotsum"), (64, 64, 2, "v2", "w4", "onepass")):  # other tiles bench attention --key-tiles times
        print(f"9B verify W16   causal splits 8: {report(16, 4, 256, 0, 8, key_tile)}")
