"""The two implementations of every op the models run, as one frozen set each.

- `triton`: the fused Triton kernels (verify route, replay / conv commit, prefill conv, norms, SwiGLU
  activation, RoPE, MoE experts, paged attention). CUDA;
  on CPU they run only under TRITON_INTERPRET=1, in their tests.
- `reference`: the unfused route (ops/*/naive.py), op by op in torch - except, on a GPU, the GDN
  recurrence (verify and replay commit): a kernel sharing the fused kernel's row arithmetic, so the
  two routes stay bit-identical there (ops/gdn/README.md); on CPU it is pure torch too.

Which set an engine runs is decided once, in EngineConfig (DELTAFLASH_NO_FUSED_KERNELS=1 selects the
reference set on CUDA), and passed to every forward; no layer reads the environment. Signatures: the
op folders' READMEs. The commit ops take a validated `CommitPlan` (cache/commit.py validates it on the
host first), so neither set syncs with the host to commit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from deltaflash.core.batch import CommitPlan, ancestor_mask

KERNEL_SETS = ("triton", "reference")


@dataclass(frozen=True)
class Kernels:
    """One route's ops, by what they compute; each entry's call signature is in its comment."""

    name: str
    # (x, weight, eps)
    zero_centered_rms_norm: Callable
    # (o, z, weight, eps)
    gated_rms_norm: Callable
    # (x, weight, eps): the drafter's norms, w * rmsnorm(x)
    plain_rms_norm: Callable
    # (x, y, weight, eps) -> (x + y, zero-centered norm of it): the residual add and the next norm
    add_rms_norm: Callable
    # (rows, conv_history, slots, weight, n_rows, nk, nv, dk) -> (q, k, v): prefill, history in place
    conv_extend_heads: Callable
    # (rows, conv_history, slot_ids, parents, weight, *, out=, window_out=)
    conv_tree_step: Callable
    # (q, k, v, a, b, A_log, dt_bias, state, slot_ids, parents, *, out=, replay_log_out=, chains=)
    gdn_verify: Callable
    # (recurrent_state, replay_log, conv_history, windows, plan): replay + conv commit
    commit_state: Callable
    # (x, topk_weights, topk_ids, gate_up_proj, down_proj)
    moe_experts: Callable
    # (gate, up) -> silu(gate) * up: SwiGLU's activation
    silu_mul: Callable
    # (x, gate) [L, T, h, hd] -> x * sigmoid(gate) [L, T, h * hd]: gated attention's output gate
    sigmoid_gate: Callable
    # (x, cos, sin) -> x with its first rd dims rotated (partial RoPE)
    rope: Callable
    # (q, key_pages, value_pages, block_tables, slot_ids, context_lens, n_rows, *, scale, mode, tree_mask,
    #  window, max_pages)
    paged_attention: Callable
    # (key_cache, value_cache, block_tables, slot_ids, start, nodes, rows): a tree commit's K/V moves
    move_tree_rows: Callable
    # (key_cache, value_cache, rows, keys, values): one layer's new K/V into its pages
    write_kv: Callable
    # (tree, greedy_next, depth_limit) -> (path [L, D], last [L]): greedy acceptance
    greedy_tree_walk: Callable
    # (log_p, tokens, anchors, budget) -> (tokens, parents, depth, rank, order): DFlash trees
    build_ranked_tree: Callable
    # (x [..., V] float32, k) -> (values, indices) [..., k]: best first, ties in index order
    vocab_top_k: Callable
    # (parents [L, N]) -> [L, N, N] bool: m is n or an ancestor of n (tree verify rows)
    ancestor_mask: Callable
    # (q, k, v, scale, fixed_shape): causal attention of a prefill chunk that starts its sequences, over its
    # own K/V (ops/attention/dense.py: the same function in both sets). None: such chunks read pages as well
    # (a batch-invariant engine: the paged kernel's tiles do not follow the shape)
    prefill_attention: Callable | None = None

    @property
    def fused(self) -> bool:
        return self.name == "triton"


def plan_lanes(plan: CommitPlan) -> list[tuple[int, int, int, tuple[int, ...]]]:
    """(lane, slot, accepted_len, accepted node path) of every lane with rows to commit, from host data."""
    lanes = []
    for lane, (slot, n) in enumerate(zip(plan.slot_ids_host, plan.accepted_len_host)):
        if slot >= 0 and n > 0:
            path = tuple(range(n)) if plan.chain_host else plan.accepted_nodes_host[lane][:n]
            lanes.append((lane, slot, n, path))
    return lanes


def _commit_state_ref(state, log, history, windows, plan: CommitPlan) -> None:
    """The reference commit: the replay, then the conv history, of every lane the plan commits. On a
    GPU the replay is the fused commit's own update (ops/gdn/commit.py), as verify's recurrence is."""
    from deltaflash.ops.conv.naive import conv_lanes_ref
    from deltaflash.ops.gdn.naive import replay_lanes_ref

    lanes = plan_lanes(plan)
    if state.is_cuda:
        from deltaflash.ops.gdn.commit import state_commit_fwd

        state_commit_fwd(state, log, None, None, plan.slot_ids.contiguous(), plan.accepted_nodes,
                         plan.accepted_len.contiguous())
    else:
        replay_lanes_ref(state, log, lanes)
    conv_lanes_ref(history, windows, lanes)


def _gdn_verify_unfused(*args, out=None, replay_log_out=None, chains=False):
    """The reference set's GDN verify: the pure-torch reference on CPU; on a GPU, torch for the gathers
    and gates and the verify kernel's recurrence (ops/gdn/verify.gdn_verify_unfused)."""
    if args[0].is_cuda:
        from deltaflash.ops.gdn.verify import gdn_verify_unfused

        return gdn_verify_unfused(*args, out=out, replay_log_out=replay_log_out, chains=chains)
    from deltaflash.ops.gdn.naive import gdn_verify_ref

    return _writing_into(gdn_verify_ref, "out", "replay_log_out")(*args, out=out, replay_log_out=replay_log_out,
                                                                   chains=chains)


def _writing_into(fn: Callable, *out_names: str) -> Callable:
    """A reference op returning a tuple, given the fused op's keyword outputs (`out_names`, one per
    result): results are copied into the outputs that are given. Other keywords (the `chains` hint)
    pass through to the reference."""

    def op(*args, **kwargs):
        outs = {name: kwargs.pop(name, None) for name in out_names}
        results = fn(*args, **kwargs)
        return tuple(r if outs.get(name) is None else outs[name].copy_(r) for r, name in zip(results, out_names))

    return op


def reference_kernels() -> Kernels:
    from deltaflash.ops.activation.naive import sigmoid_gate_ref, silu_mul_ref
    from deltaflash.ops.attention.dense import causal_block_attention
    from deltaflash.ops.attention.naive import move_tree_rows_ref, paged_attention_ref, write_kv_ref
    from deltaflash.ops.conv.extend import conv_extend_heads_ref
    from deltaflash.ops.conv.naive import conv_tree_step_ref
    from deltaflash.ops.moe.naive import moe_experts_ref
    from deltaflash.ops.norm.naive import (
        add_rms_norm_ref,
        gated_rms_norm_ref,
        plain_rms_norm_ref,
        zero_centered_rms_norm_ref,
    )
    from deltaflash.ops.rope.naive import apply_rope_ref
    from deltaflash.ops.tree.naive import build_ranked_tree_ref, row_top_k
    from deltaflash.ops.tree.naive import greedy_walk as greedy_walk_ref

    return Kernels(
        name="reference",
        zero_centered_rms_norm=zero_centered_rms_norm_ref,
        gated_rms_norm=gated_rms_norm_ref,
        plain_rms_norm=plain_rms_norm_ref,
        add_rms_norm=add_rms_norm_ref,
        conv_extend_heads=conv_extend_heads_ref,
        conv_tree_step=_writing_into(conv_tree_step_ref, "out", "window_out"),
        gdn_verify=_gdn_verify_unfused,
        commit_state=_commit_state_ref,
        moe_experts=moe_experts_ref,
        silu_mul=silu_mul_ref,
        sigmoid_gate=sigmoid_gate_ref,
        rope=apply_rope_ref,
        paged_attention=paged_attention_ref,
        move_tree_rows=move_tree_rows_ref,
        write_kv=write_kv_ref,
        greedy_tree_walk=greedy_walk_ref,
        build_ranked_tree=build_ranked_tree_ref,
        vocab_top_k=row_top_k,
        ancestor_mask=ancestor_mask,
        prefill_attention=causal_block_attention,
    )


def triton_kernels() -> Kernels:
    from deltaflash.ops.tree.ancestors import ancestor_mask as ancestor_mask_kernel
    from deltaflash.ops.tree.build import ranked_tree
    from deltaflash.ops.tree.topk import row_top_k
    from deltaflash.ops.tree.greedy_walk import greedy_walk
    from deltaflash.ops.activation.sigmoid_gate import sigmoid_gate
    from deltaflash.ops.activation.silu_mul import silu_mul
    from deltaflash.ops.attention.dense import causal_block_attention
    from deltaflash.ops.attention.paged import paged_attention
    from deltaflash.ops.attention.kv_write import write_kv
    from deltaflash.ops.attention.tree_rows import move_tree_rows
    from deltaflash.ops.conv.extend import conv_extend_heads
    from deltaflash.ops.conv.tree_step import conv_tree_step
    from deltaflash.ops.gdn.commit import state_commit
    from deltaflash.ops.gdn.verify import gdn_verify
    from deltaflash.ops.moe.fused_moe import fused_moe_experts
    from deltaflash.ops.norm.rms_norm import add_rms_norm, gated_rms_norm, plain_rms_norm, zero_centered_rms_norm
    from deltaflash.ops.rope.rotary import apply_rope

    def commit_state(state, log, history, windows, plan: CommitPlan):  # the plan was validated on the host
        state_commit(state, log, history, windows, plan.slot_ids, plan.accepted_nodes, plan.accepted_len,
                     validate=False)

    return Kernels(
        name="triton",
        zero_centered_rms_norm=zero_centered_rms_norm,
        gated_rms_norm=gated_rms_norm,
        plain_rms_norm=plain_rms_norm,
        add_rms_norm=add_rms_norm,
        conv_extend_heads=conv_extend_heads,
        conv_tree_step=conv_tree_step,
        gdn_verify=gdn_verify,
        commit_state=commit_state,
        moe_experts=fused_moe_experts,
        silu_mul=silu_mul,
        sigmoid_gate=sigmoid_gate,
        rope=apply_rope,
        paged_attention=paged_attention,
        move_tree_rows=move_tree_rows,
        write_kv=write_kv,
        greedy_tree_walk=greedy_walk,
        build_ranked_tree=ranked_tree,
        vocab_top_k=row_top_k,
        ancestor_mask=ancestor_mask_kernel,
        prefill_attention=causal_block_attention,
    )


def kernels_named(name: str) -> Kernels:
    if name not in KERNEL_SETS:
        raise ValueError(f"kernels must be one of {KERNEL_SETS}, got {name!r}")
    return triton_kernels() if name == "triton" else reference_kernels()
