"""Registers, spills and the row loop's instructions of the chain-only GDN verify kernel per tile,
compiled for sm_90 without a GPU.

Usage: python bench/verify_registers.py [8x1 16x1 32x1 16x4 ...] [--fp-fusion] [--widen-at-load]
(BV x num_warps; CPU is enough; the flags are verify.BuildOptions)

Compiles `gdn_verify_kernel` at the 9B shape (dk = dv 128, nk 16, nv 32, W 16) through Triton's sm_90
target, runs ptxas -v on the PTX and counts the SASS instructions (nvdisasm) of the row loop - the
largest backward branch - by opcode: a static measure of the work per row and thread, not a timing.
VERIFY_PY=path compiles another verify.py's kernel (its constexprs must be this one's, or LOG_BK / GATES_GIVEN).
"""

import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource


def load_kernel(path: str):
    """gdn_verify_kernel from a verify.py (VERIFY_PY: e.g. an older one, `git show REV:deltaflash/ops/gdn/verify.py`)."""
    spec = importlib.util.spec_from_file_location("verify_under_test", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up)
    spec.loader.exec_module(module)
    return module.gdn_verify_kernel


gdn_verify_kernel = load_kernel(os.environ.get("VERIFY_PY", str(Path(__file__).parents[1] / "deltaflash/ops/gdn/verify.py")))

POINTERS = dict(q="*bf16", k="*bf16", v="*bf16", a="*bf16", b="*bf16", A_log="*fp32", dt_bias="*fp32",
                recurrent_state="*fp32", state_slot_ids="*i64", parents="*i64", o="*bf16", replay_log="*fp32")
UNIT_STRIDES = ("stride_q_d", "stride_k_d", "stride_v_d", "stride_a_h", "stride_b_h", "stride_s_v", "stride_p_w")
SHOWN = ("FFMA", "FMUL", "FADD", "SHFL", "LDG", "STG", "LDS", "STS", "BAR", "LDL", "STL", "PRMT")


def compile_verify(bv: int, num_warps: int, fp_fusion: bool, widen_at_load: bool = False):
    consts = dict(HK=16, HV=32, K=128, V=128, W=16, BK=128, BV=bv, BW=16, TREES=False,
                  **{name: 1 for name in UNIT_STRIDES})
    consts.update({name: value for name, value in (("GATES_GIVEN", False), ("LOG_BK", 7),
                                                   ("WIDEN_AT_LOAD", widen_at_load))
                   if name in gdn_verify_kernel.arg_names})
    return compile_sm90(gdn_verify_kernel, POINTERS, consts, "scale", num_warps, fp_fusion)


def compile_sm90(kernel, pointers: dict[str, str], consts: dict, float_arg: str | None, num_warps: int,
                 fp_fusion: bool, num_stages: int = 1, unaligned: tuple[str, ...] = ()):
    """`kernel` compiled for sm_90 as the JIT would launch it at the 9B shape: `pointers` typed, `consts`
    constexpr, `float_arg` fp32, every other argument i32; every pointer 16-byte aligned and every integer a
    multiple of 16 but those `unaligned` (the kernel's do_not_specialize arguments; without these hints
    Triton picks other layouts: the figures would not be the launched kernel's)."""
    signature = {name: pointers.get(name, "constexpr" if name in consts else "fp32" if name == float_arg else "i32")
                 for name in kernel.arg_names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
               if (signature[name].startswith("*") or signature[name] == "i32") and name not in unaligned}
    return triton.compile(ASTSource(kernel, signature, consts, aligned), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages, enable_fp_fusion=fp_fusion,
                                       enable_reflect_ftz=False))


def ptxas_report(kernel, tmp: Path) -> str:
    ptx = tmp / "verify.ptx"
    ptx.write_text(kernel.asm["ptx"])
    out = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", str(ptx), "-o", str(tmp / "v.cubin")],
                         capture_output=True, text=True, check=True).stderr
    return ", ".join(re.findall(r"Used \d+ registers|\d+ bytes spill stores|\d+ bytes spill loads", out))


def sass(kernel, tmp: Path) -> tuple[list[str], dict[str, int]]:
    """(the kernel's SASS instructions in order, each branch label's index among them), by nvdisasm."""
    cubin = tmp / "k.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    text = subprocess.run([str(Path(get_ptxas(90).path).parent / "nvdisasm"), str(cubin)],
                          capture_output=True, text=True, check=True).stdout
    instructions, labels = [], {}
    for line in text.splitlines():
        if m := re.match(r"^\s*(\.L_x_\d+):", line):
            labels[m.group(1)] = len(instructions)
        elif m := re.match(r"^\s*/\*[0-9a-f]{4,}\*/\s+(.*?);", line):
            instructions.append(m.group(1).strip())
    return instructions, labels


def opcode(instruction: str) -> str:
    """The opcode of one SASS instruction, its predicate skipped (LDG.E.U16, FFMA, ...)."""
    return instruction.split()[1] if instruction.startswith("@") else instruction.split()[0]


def loop_body(instructions: list[str], labels: dict[str, int]) -> list[str]:
    """The instructions from the target of the largest backward branch to the branch (`sass`'s output)."""
    loop = (0, -1)
    for i, ins in enumerate(instructions):
        m = re.search(r"BRA\s+`?\(?(\.L_x_\d+)", ins)
        if m and labels.get(m.group(1), i + 1) <= i and i - labels[m.group(1)] > loop[1] - loop[0]:
            loop = (labels[m.group(1)], i)
    return instructions[loop[0]:loop[1] + 1]


def row_loop_ops(kernel, tmp: Path) -> tuple[int, Counter]:
    """(instructions, opcode counts) of the kernel's loop body (`loop_body`)."""
    body = loop_body(*sass(kernel, tmp))
    return len(body), Counter(opcode(ins).split(".")[0] for ins in body)


if __name__ == "__main__":
    fp_fusion, widen_at_load = "--fp-fusion" in sys.argv, "--widen-at-load" in sys.argv
    configs = [a for a in sys.argv[1:] if not a.startswith("--")] or ["8x1", "16x1", "32x1", "16x4"]
    print(f"FMA contraction {'on' if fp_fusion else 'off'}, q and k widened {'at load' if widen_at_load else 'after broadcast'}; "
          "row loop: SASS instructions per row and thread")
    for config in configs:
        kernel = compile_verify(*map(int, config.split("x")), fp_fusion, widen_at_load)
        with tempfile.TemporaryDirectory() as tmp:
            regs = ptxas_report(kernel, Path(tmp))
            n, ops = row_loop_ops(kernel, Path(tmp))
        fp32 = ops["FFMA"] + ops["FMUL"] + ops["FADD"]
        print(f"{config:5s} {regs}; row loop {n} instructions, fp32 {fp32}: "
              + " ".join(f"{op} {ops[op]}" for op in SHOWN))
