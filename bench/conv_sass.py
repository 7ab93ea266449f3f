"""What the prefill conv kernel issues per output element: registers and SASS opcodes of
`conv_extend_kernel` compiled for sm_90 on this machine (no GPU needed: Triton's ptxas and nvdisasm),
at the 9B shape's 2048-token prefill (q, k, v heads, K = 4 taps) with the JIT's alignment hints.

Usage: python bench/conv_sass.py [32x1 16x4x2 ...] [--main-path]   (row tile x warps [x rows a loop step]; default
    ROW_TILE x NUM_WARPS x STEP)
A kernel that walks its rows one at a time (HEAD's) is counted by its row loop's body per element. Older ones
(a 2D tile of rows, every instruction once): the kernel of rows K-1 on (FIRST=False: the whole grid but rows
[0, K-1)), and of rows [0, K-1) with the history (FIRST=True, its own small launch). CONV_PY=path compiles that extend.py instead (an older one: `git show
REV:deltaflash/ops/conv/extend.py > /tmp/extend.py`); for a kernel of one launch (before FIRST), --main-path takes
the first row tile's branches (the history, the new history) out: what every other row tile ran.

A static count, not a GPU measurement: the H200's time per layer comes from `bench/tune_conv.py`.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from verify_registers import compile_sm90, loop_body, opcode, ptxas_report, sass  # noqa: E402

from deltaflash.ops.conv.extend import NUM_WARPS, ROW_TILE, STEP  # noqa: E402

FIRST_TILE_ONLY = ("if i_t * BT < K - 1:", "if i_t == 0:")  # the branches only row tile 0 takes


def load_kernel(path: str, main_path: bool):
    """conv_extend_kernel from an extend.py; main_path: with FIRST_TILE_ONLY's branches compiled out."""
    source = Path(path).read_text()
    if main_path:
        for branch in FIRST_TILE_ONLY:
            source = source.replace(branch, "if False:")
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(source)  # (Triton reads a kernel's source from its file)
    spec = importlib.util.spec_from_file_location("extend_under_test", f.name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.conv_extend_kernel


conv_extend_kernel = load_kernel(os.environ.get("CONV_PY", str(Path(__file__).parents[1] / "deltaflash/ops/conv/extend.py")),
                                 "--main-path" in sys.argv)

POINTERS = dict(rows="*bf16", history="*bf16", slots="*i64", weight="*bf16", n_rows="*i64", out="*bf16",
                k_out="*bf16", v_out="*bf16", new_history="*bf16")
UNIT = ("stride_r_c", "stride_h_t", "stride_w_t")  # strides of 1, which the JIT specialises
SHOWN = ("LDG", "STG", "LDS", "STS", "FFMA", "FMUL", "FADD", "MUFU", "FCHK", "CALL", "PRMT", "SEL", "BAR")


def compile_conv(row_tile: int, num_warps: int, first: bool = False, step: int = 1):
    consts = dict(K=4, BT=row_tile, BC=128, BK=4, HEADS=True, **{name: 1 for name in UNIT})
    if "STEP" in conv_extend_kernel.arg_names:
        consts["STEP"] = step
    if "REP" in conv_extend_kernel.arg_names:  # an extend.py from before q / k went out once per key head
        consts["REP"] = 2
    if "FIRST" in conv_extend_kernel.arg_names:
        consts["FIRST"] = first
    return compile_sm90(conv_extend_kernel, POINTERS, consts, "eps", num_warps, fp_fusion=False)


if __name__ == "__main__":
    configs = [a for a in sys.argv[1:] if not a.startswith("--")] or [f"{ROW_TILE}x{NUM_WARPS}x{STEP}", "16x4"]
    print(f"{os.environ.get('CONV_PY', 'this tree')}{', the other row tiles path' if '--main-path' in sys.argv else ''}")
    if "FIRST" in conv_extend_kernel.arg_names:
        configs = [(c, False) for c in configs] + [("4x1", True)]  # (_launch's first launch: BK rows, one warp)
    else:
        configs = [(c, False) for c in configs]
    for config, first in configs:
        row_tile, num_warps, step = (*map(int, config.split("x")), 1)[:3]
        kernel = compile_conv(row_tile, num_warps, first, step)
        with tempfile.TemporaryDirectory() as tmp:
            regs = ptxas_report(kernel, Path(tmp))
            instructions, labels = sass(kernel, Path(tmp))
        per_thread = row_tile * 128 / (num_warps * 32)  # output elements of one thread (one key head's 128 channels)
        ops = Counter(opcode(i) for i in instructions)
        groups = Counter()
        for op, n in ops.items():
            groups[op.split(".")[0]] += n
        loads = ", ".join(f"{op} {n}" for op, n in sorted(ops.items()) if op.startswith("LDG"))
        if "FIRST" in conv_extend_kernel.arg_names:  # a 2D tile of rows: every instruction runs once
            count = f"{len(instructions)} SASS instructions for {per_thread:.0f} elements a thread " \
                    f"({len(instructions) / per_thread:.0f} per element)"
        else:  # a row at a time: the loop body runs once a row
            body = len(loop_body(instructions, labels))
            row = 128 * step / (num_warps * 32)
            count = f"{len(instructions)} SASS instructions, {body} in the row loop for {row:.0f} elements a " \
                    f"thread ({body / row:.0f} per element, the division's slow path included)"
        print(f"{config}{' (rows [0, K-1), the history)' if first else ''}: {regs}; {count}; "
              + " ".join(f"{g} {groups[g]}" for g in SHOWN) + f"; loads: {loads}")
