"""What the prefill conv kernel issues per output element: registers and SASS opcodes of
`conv_extend_kernel` compiled for sm_90 on this machine (no GPU needed: Triton's ptxas and nvdisasm),
at the 9B shape's 2048-token prefill (q, k, v heads, K = 4 taps) with the JIT's alignment hints.

Usage: python bench/conv_sass.py [32x4 16x4 ...]   (row tile x warps; the default tile is ROW_TILE x NUM_WARPS)

A static count, not a GPU measurement: the H200's time per layer comes from `bench/tune_conv.py`.
"""

from __future__ import annotations

import sys
import tempfile
from collections import Counter
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).parent))
from verify_registers import opcode, ptxas_report, sass  # noqa: E402

from deltaflash.ops.conv.extend import NUM_WARPS, ROW_TILE, conv_extend_kernel  # noqa: E402

POINTERS = dict(rows="*bf16", history="*bf16", weight="*bf16", n_rows="*i64", out="*bf16", k_out="*bf16",
                v_out="*bf16", new_history="*bf16")
UNIT = ("stride_r_c", "stride_h_t", "stride_w_t")  # strides of 1, which the JIT specialises
SHOWN = ("LDG", "STG", "LDS", "STS", "FFMA", "FMUL", "FADD", "MUFU", "FCHK", "CALL", "PRMT", "SEL", "BAR")


def compile_conv(row_tile: int, num_warps: int):
    consts = dict(K=4, BT=row_tile, BC=128, BK=4, HEADS=True, REP=2, **{name: 1 for name in UNIT})
    signature = {name: POINTERS.get(name, "constexpr" if name in consts else "fp32" if name == "eps" else "i32")
                 for name in conv_extend_kernel.arg_names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(conv_extend_kernel.arg_names)
               if signature[name].startswith("*") or signature[name] == "i32"}
    return triton.compile(ASTSource(conv_extend_kernel, signature, consts, aligned), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=1, enable_fp_fusion=False,
                                       enable_reflect_ftz=False))


if __name__ == "__main__":
    configs = sys.argv[1:] or [f"{ROW_TILE}x{NUM_WARPS}", "16x4"]
    for config in configs:
        row_tile, num_warps = map(int, config.split("x"))
        kernel = compile_conv(row_tile, num_warps)
        with tempfile.TemporaryDirectory() as tmp:
            regs = ptxas_report(kernel, Path(tmp))
            instructions, _ = sass(kernel, Path(tmp))
        per_thread = row_tile * 128 / (num_warps * 32)  # output elements of one thread (one key head's 128 channels)
        ops = Counter(opcode(i) for i in instructions)
        groups = Counter()
        for op, n in ops.items():
            groups[op.split(".")[0]] += n
        loads = ", ".join(f"{op} {n}" for op, n in sorted(ops.items()) if op.startswith("LDG"))
        print(f"{config}: {regs}; {len(instructions)} SASS instructions for {per_thread:.0f} elements a thread "
              f"({len(instructions) / per_thread:.0f} per element); " + " ".join(f"{g} {groups[g]}" for g in SHOWN)
              + f"; loads: {loads}")
