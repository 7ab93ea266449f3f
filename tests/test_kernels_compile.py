"""The prefill conv, the chunked rule's gate inputs, SwiGLU, attention output gate, K/V write, RoPE, residual-norm, GDN verify, one-launch state commit, tree K/V move, tree build
greedy tree walk, vocabulary top-k, ancestor mask and skinny GEMM kernels compile for the H200 (sm_90) on a machine without a GPU. The CPU tests run the kernels
under TRITON_INTERPRET=1, which executes them as Python and accepts code the compiler rejects (a variable redefined
with another shape inside an `if`): this catches that before a GPU run does."""

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from deltaflash.ops.activation.sigmoid_gate import sigmoid_gate_kernel
    from deltaflash.ops.activation.silu_mul import silu_mul_kernel
    from deltaflash.ops.attention.kv_write import write_kv_kernel
    from deltaflash.ops.attention.tree_rows import move_tree_rows_kernel
    from deltaflash.ops.conv.extend import conv_extend_kernel
    from deltaflash.ops.gdn.commit import state_commit_kernel
    from deltaflash.ops.gdn.prefill_gates import prefill_gates_kernel
    from deltaflash.ops.gdn.verify import gdn_verify_kernel
    from deltaflash.ops.gemm.skinny import skinny_linear_kernel, splitk_sum_kernel
    from deltaflash.ops.norm.rms_norm import rms_norm_kernel
    from deltaflash.ops.rope.rotary import rope_kernel
    from deltaflash.ops.tree.ancestors import ancestor_mask_kernel
    from deltaflash.ops.tree.build import ranked_tree_kernel
    from deltaflash.ops.tree.topk import chunk_top_k_kernel, merge_top_k_kernel
    from deltaflash.ops.tree.greedy_walk import greedy_walk_kernel

    for dtype in ("bf16", "fp32"):
        pointers = dict(rows=f"*{dtype}", history=f"*{dtype}", slots="*i64", weight=f"*{dtype}", n_rows="*i64",
                        out=f"*{dtype}", k_out=f"*{dtype}", v_out=f"*{dtype}", new_history=f"*{dtype}", eps="fp32")
        for heads, step in ((False, 1), (True, 1), (True, 2)):  # plain conv; q / k / v heads, 1 or 2 rows a step
            consts = dict(K=4, BT=32, BC=128, BK=4, HEADS=heads, STEP=step)
            signature = {n: pointers.get(n, "constexpr" if n in consts else "i32") for n in conv_extend_kernel.arg_names}
            kernel = triton.compile(ASTSource(conv_extend_kernel, signature, consts), target=GPUTarget("cuda", 90, 32),
                                    options=dict(num_warps=4, enable_fp_fusion=False))
            assert ".entry conv_extend_kernel" in kernel.asm["ptx"]
        consts = dict(H=32, BLOCK_H=32, ROWS=32, MASKED=True)
        signature = {n: "constexpr" if n in consts else "*i1" if n == "valid_ptr" else "*fp32" if n == "beta_ptr"
                     else f"*{dtype}" if n.endswith("_ptr") else "i32" for n in prefill_gates_kernel.arg_names}
        kernel = triton.compile(ASTSource(prefill_gates_kernel, signature, consts), target=GPUTarget("cuda", 90, 32),
                                options=dict(num_warps=1))
        assert ".entry prefill_gates_kernel" in kernel.asm["ptx"]
        signature = dict(gate=f"*{dtype}", up=f"*{dtype}", out=f"*{dtype}", stride_g="i64", stride_u="i64", I="i32",
                         BI="constexpr")
        kernel = triton.compile(ASTSource(silu_mul_kernel, signature, dict(BI=1024)), target=GPUTarget("cuda", 90, 32),
                                options=dict(num_warps=4))
        assert ".entry silu_mul_kernel" in kernel.asm["ptx"]
        signature = {n: f"*{dtype}" if n in ("x", "gate", "out") else "constexpr" if n in ("HD", "BF") else
                     "i64" if n.startswith("stride") else "i32" for n in sigmoid_gate_kernel.arg_names}
        kernel = triton.compile(ASTSource(sigmoid_gate_kernel, signature, dict(HD=256, BF=1024)),
                                target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, enable_fp_fusion=False))
        assert ".entry sigmoid_gate_kernel" in kernel.asm["ptx"]  # (libdevice's expf has its own fma)
        signature = {n: "*i64" if n == "rows" else f"*{dtype}" if n in ("key_cache", "value_cache", "keys", "values")
                     else "constexpr" if n in ("HD", "D", "BD") else "i64" if n.startswith("stride") else "i32"
                     for n in write_kv_kernel.arg_names}
        kernel = triton.compile(ASTSource(write_kv_kernel, signature, dict(HD=256, D=1024, BD=1024)),
                                target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
        assert ".entry write_kv_kernel" in kernel.asm["ptx"]
        signature = {n: f"*{dtype}" if n in ("x", "cos", "sin", "out") else "constexpr" if n in ("BH", "BD") else
                     "i64" if n.startswith("stride") else "i32" for n in rope_kernel.arg_names}
        kernel = triton.compile(ASTSource(rope_kernel, signature, dict(BH=16, BD=256)),
                                target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, enable_fp_fusion=False))
        assert ".entry rope_kernel" in kernel.asm["ptx"] and "fma" not in kernel.asm["ptx"]  # no contraction
        for consts in (dict(D=4096, BD=4096, GATED=False, RESIDUAL=True, PLAIN=False, BR=1),  # residual add + norm
                       dict(D=128, BD=128, GATED=True, RESIDUAL=False, PLAIN=False, BR=16)):  # GDN's gated norm
            signature = {n: "constexpr" if n in consts else "fp32" if n == "eps" else "i64" if n.startswith("stride")
                         else "i32" if n in ("G_H", "X_H", "R") else f"*{dtype}" for n in rms_norm_kernel.arg_names}
            kernel = triton.compile(ASTSource(rms_norm_kernel, signature, consts), target=GPUTarget("cuda", 90, 32),
                                    options=dict(num_warps=8))
            assert ".entry rms_norm_kernel" in kernel.asm["ptx"]
    # both commits; then the conv commit alone (the replay's pointers stand in from the conv part: state_commit_fwd)
    for consts, state in ((dict(W=16, K=128, V=128, BK=128, BV=32, NV=32, V_TILES=4, KC=4, BC=256, C_TILES=32), "fp32"),
                          (dict(W=16, K=16, V=16, BK=16, BV=16, NV=1, V_TILES=1, KC=4, BC=256, C_TILES=32), "bf16")):
        pointers = dict(recurrent_state=f"*{state}", replay_log=f"*{state}", conv_history="*bf16", windows="*bf16",
                        state_slot_ids="*i64", accepted_nodes="*i64", accepted_len="*i64")
        signature = {n: pointers.get(n, "constexpr" if n in consts else "i64" if n.startswith("stride") else "i32")
                     for n in state_commit_kernel.arg_names}
        kernel = triton.compile(ASTSource(state_commit_kernel, signature, consts), target=GPUTarget("cuda", 90, 32),
                                options=dict(num_warps=4, num_stages=1, enable_fp_fusion=False))
        assert ".entry state_commit_kernel" in kernel.asm["ptx"]
        if state == "fp32":  # the replay's update is verify.decay_update: a rounded decay, then one explicit FMA
            assert "fma.rn.f32" in kernel.asm["ptx"]
    for dtype, consts in (("bf16", dict(PAGE=16, D=1024, BD=1024)), ("fp32", dict(PAGE=4, D=10, BD=16))):  # tree K/V moves
        pointers = dict(key_cache=f"*{dtype}", value_cache=f"*{dtype}", block_tables="*i32", slot_ids="*i64",
                        start="*i64", nodes="*i64", rows="*i64")
        signature = {n: pointers.get(n, "constexpr" if n in consts else "i64" if n.startswith("stride") else "i32")
                     for n in move_tree_rows_kernel.arg_names}
        kernel = triton.compile(ASTSource(move_tree_rows_kernel, signature, consts), target=GPUTarget("cuda", 90, 32),
                                options=dict(num_warps=4))
        assert ".entry move_tree_rows_kernel" in kernel.asm["ptx"]
    # the chain kernel and the tree kernel (a program per root-to-leaf path); the fused route's gates and the
    # unfused route's (GATES_GIVEN); verify.BuildOptions off and on (FMA contraction, q / k widened at load)
    for trees, gates_given, build in ((False, False, False), (True, False, False), (False, True, True), (True, True, True)):
        consts = dict(HK=16, HV=32, K=128, V=128, W=16, BK=128, BV=16, BW=16, TREES=trees, GATES_GIVEN=gates_given,
                      WIDEN_AT_LOAD=build)
        pointers = dict(q="*bf16", k="*bf16", v="*bf16", a="*bf16", b="*bf16", A_log="*fp32", dt_bias="*fp32",
                        recurrent_state="*fp32", state_slot_ids="*i32", parents="*i64", o="*bf16", replay_log="*fp32",
                        scale="fp32")
        signature = {n: pointers.get(n, "constexpr" if n in consts else "i64")
                     for n in gdn_verify_kernel.arg_names}
        kernel = triton.compile(ASTSource(gdn_verify_kernel, signature, consts), target=GPUTarget("cuda", 90, 32),
                                options=dict(num_warps=4, num_stages=1, enable_fp_fusion=build))
        assert ".entry gdn_verify_kernel" in kernel.asm["ptx"]
    signature = {n: "constexpr" if n == "BN" else "*i1" if n == "valid" else "i32" if n in ("N", "D") else
                 "i64" if n.startswith("stride") else "*i64" for n in greedy_walk_kernel.arg_names}
    kernel = triton.compile(ASTSource(greedy_walk_kernel, signature, dict(BN=16)), target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=1))
    assert ".entry greedy_walk_kernel" in kernel.asm["ptx"]
    consts = dict(EPS=1e-6, BF=32, BN=16)
    signature = {n: "constexpr" if n in consts else "*fp32" if n == "log_p" else "i32" if n in ("D", "K", "M") else
                 "i64" if n.startswith("stride") else "*i64" for n in ranked_tree_kernel.arg_names}
    kernel = triton.compile(ASTSource(ranked_tree_kernel, signature, consts), target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=1))
    assert ".entry ranked_tree_kernel" in kernel.asm["ptx"]
    signature = dict(parents="*i64", out="*i8", stride_p="i64", N="i32", BN="constexpr")
    kernel = triton.compile(ASTSource(ancestor_mask_kernel, signature, dict(BN=16)), target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=1))
    assert ".entry ancestor_mask_kernel" in kernel.asm["ptx"]
    signature = dict(x="*fp32", out_v="*fp32", out_i="*i64", stride_x="i64", V="i32", S="i32", K="constexpr",
                     BLOCK="constexpr")
    kernel = triton.compile(ASTSource(chunk_top_k_kernel, signature, dict(K=4, BLOCK=8192)),
                            target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8))
    assert ".entry chunk_top_k_kernel" in kernel.asm["ptx"]
    signature = dict(cand_v="*fp32", cand_i="*i64", out_v="*fp32", out_i="*i64", C="i32", K="constexpr", BC="constexpr")
    kernel = triton.compile(ASTSource(merge_top_k_kernel, signature, dict(K=4, BC=128)),
                            target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    assert ".entry merge_top_k_kernel" in kernel.asm["ptx"]
    # the skinny GEMM: bf16 rows at 16 (mma.sync) and 64 (wgmma), fp32 IEEE, direct and partial sums; the split sum
    for dtype, bm, partial, ieee in (("bf16", 16, False, False), ("bf16", 64, True, False), ("fp32", 16, True, True)):
        consts = dict(PARTIAL=partial, HAS_BIAS=True, IEEE=ieee, EVEN_K=not partial, BM=bm, BN=64, BK=128)
        pointers = dict(x=f"*{dtype}", w=f"*{dtype}", bias=f"*{dtype}", out=f"*{dtype}", part="*fp32")
        signature = {n: pointers.get(n, "constexpr" if n in consts else "i32") for n in skinny_linear_kernel.arg_names}
        kernel = triton.compile(ASTSource(skinny_linear_kernel, signature, consts), target=GPUTarget("cuda", 90, 32),
                                options=dict(num_warps=4, num_stages=3))
        assert ".entry skinny_linear_kernel" in kernel.asm["ptx"]
    signature = dict(part="*fp32", bias="*bf16", out="*bf16", M="i32", N="i32", stride_om="i32", SPLIT="constexpr",
                     HAS_BIAS="constexpr", BLOCK="constexpr")
    kernel = triton.compile(ASTSource(splitk_sum_kernel, signature, dict(SPLIT=3, HAS_BIAS=True, BLOCK=1024)),
                            target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    assert ".entry splitk_sum_kernel" in kernel.asm["ptx"]
    print("compiled")
""")


@pytest.mark.timeout(600)
def test_the_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]
