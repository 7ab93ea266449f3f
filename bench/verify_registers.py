"""Registers and spills of the chain-only GDN verify kernel per tile, compiled for sm_90 without a GPU.

Usage: python bench/verify_registers.py [8x1 16x1 32x1 16x4 ...]   (BV x num_warps; CPU is enough)

Compiles `gdn_verify_kernel` at the 9B shape (dk = dv 128, nk 16, nv 32, W 16) through Triton's
sm_90 target and runs ptxas -v on the PTX; docs/benchmarks.md quotes its counts.
"""

import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource

from deltaflash.ops.gdn.verify import gdn_verify_kernel

POINTERS = dict(q="*bf16", k="*bf16", v="*bf16", a="*bf16", b="*bf16", A_log="*fp32", dt_bias="*fp32",
                recurrent_state="*fp32", state_slot_ids="*i64", parents="*i64", o="*bf16", replay_log="*fp32")
UNIT_STRIDES = ("stride_q_d", "stride_k_d", "stride_v_d", "stride_s_v", "stride_p_w")


def ptxas_report(bv: int, num_warps: int) -> str:
    consts = dict(HK=16, HV=32, K=128, V=128, W=16, BK=128, BV=bv, BW=16, LOG_BK=7, TREES=False,
                  **{name: 1 for name in UNIT_STRIDES})
    signature = {name: POINTERS.get(name, "constexpr" if name in consts else "fp32" if name == "scale" else "i32")
                 for name in gdn_verify_kernel.arg_names}
    kernel = triton.compile(ASTSource(gdn_verify_kernel, signature, consts), target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=num_warps, num_stages=1, enable_fp_fusion=False,
                                         enable_reflect_ftz=False))
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "verify.ptx"
        ptx.write_text(kernel.asm["ptx"])
        out = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", str(ptx), "-o", str(Path(tmp) / "v.cubin")],
                             capture_output=True, text=True, check=True).stderr
    return ", ".join(re.findall(r"Used \d+ registers|\d+ bytes spill stores|\d+ bytes spill loads", out))


if __name__ == "__main__":
    for config in sys.argv[1:] or ["8x1", "16x1", "32x1", "16x4"]:
        print(config, ptxas_report(*map(int, config.split("x"))))
