"""`deltaflash bench kernels`: one GDN layer's verify (Qwen3.5-9B shape) on the fused route, the
unfused route and fla-core, and the replay commit, each against its byte roofline, in one run.
Kernel times are device times from CUDA-graph replay (`graph_ms`: the engine replays its rounds from
graphs); the unfused route is timed as eager calls (as it runs), and the commit also as an eager call
(host launch included)."""

from __future__ import annotations

import torch

from deltaflash.bench.common import copy_bandwidth_gbs, graph_ms, machine, print_table, time_ms, write_json
from deltaflash.core.batch import CommitPlan
from deltaflash.ops.kernels import reference_kernels, triton_kernels


def layer_inputs(L: int, W: int, slots: int, nk=16, nv=32, dk=128, dv=128, K=4, G=1, seed=0):
    """A GDN layer's verify inputs: a [L, W, C+z+2nv] bf16 projection (qkv, a, b are views of it),
    a slot pool of `slots` (lanes read permuted slots), chain parents."""
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(seed)
    C = 2 * nk * dk + nv * dv
    proj = torch.randn(L, W, C + nv * dv + 2 * nv, device=dev, generator=g).to(torch.bfloat16)
    qkv, a, b = proj[..., :C], proj[..., -2 * nv:-nv], proj[..., -nv:]
    state = 0.1 * torch.randn(slots, G, nv, dk, dv, device=dev, generator=g)
    history = torch.randn(slots, G, C, K - 1, device=dev, generator=g).to(torch.bfloat16)
    slot_ids = torch.randperm(slots, device=dev, generator=g)[:L]
    parents = (torch.arange(W, device=dev) - 1).expand(L, W).contiguous()
    return dict(qkv=qkv, a=a, b=b, state=state, history=history, slot_ids=slot_ids, parents=parents,
                conv_w=torch.randn(C, K, device=dev, generator=g).to(torch.bfloat16),
                A_log=torch.rand(nv, device=dev, generator=g).log(), dt_bias=torch.rand(nv, device=dev, generator=g),
                dims=(nk, nv, dk, dv, C, K))


def split_qkv(x, nk, nv, dk, dv):
    q, k, v = x.split([nk * dk, nk * dk, nv * dv], dim=-1)
    return q.unflatten(-1, (nk, dk)), k.unflatten(-1, (nk, dk)), v.unflatten(-1, (nv, dv))


def verify_route(ops, t):
    nk, nv, dk, dv, C, K = t["dims"]
    out, window = ops.conv_tree_step(t["qkv"], t["history"][:, 0], t["slot_ids"], t["parents"], t["conv_w"])
    q, k, v = split_qkv(out, nk, nv, dk, dv)
    return ops.gdn_verify(q, k, v, t["a"], t["b"], t["A_log"], t["dt_bias"], t["state"][:, 0], t["slot_ids"],
                          t["parents"], chains=True)  # chain drafts: the kernel verify rounds run


def fla_route(t, conv_out):
    """fla-core's fused recurrent kernel with in-kernel gates on states gathered through the slot ids."""
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    nk, nv, dk, dv, C, K = t["dims"]
    q, k, v = split_qkv(conv_out, nk, nv, dk, dv)
    states = t["state"][t["slot_ids"], 0]  # the gather fla needs: it has no slot map
    return fused_recurrent_gated_delta_rule(
        q, k, v, g=t["a"], beta=t["b"], scale=dk ** -0.5, initial_state=states, output_final_state=False,
        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=t["A_log"], dt_bias=t["dt_bias"],
        use_beta_sigmoid_in_kernel=True)


def verify_bytes(L, W, dims) -> tuple[int, int]:
    """(conv step bytes, GDN verify bytes): each input read once, each output written once."""
    nk, nv, dk, dv, C, K = dims
    conv = L * C * (K - 1) * 2 + L * W * C * 2 + L * W * C * 2 + L * C * (K - 1 + W) * 2 + C * K * 2
    gdn = L * nv * dk * dv * 4 + L * W * C * 2 + L * W * 2 * nv * 2 + L * W * nv * dv * 2 + L * W * nv * (1 + dk + dv) * 4
    return conv, gdn


@torch.inference_mode()
def run(args) -> dict:
    bw = copy_bandwidth_gbs("cuda")
    fused, unfused = triton_kernels(), reference_kernels()
    W, rows, commit_rows = args.width, [], []
    for L in args.lanes:
        t = layer_inputs(L, W, slots=max(2 * L, 8))
        conv_out = fused.conv_tree_step(t["qkv"], t["history"][:, 0], t["slot_ids"], t["parents"], t["conv_w"])[0]
        conv_b, gdn_b = verify_bytes(L, W, t["dims"])
        f_ms = graph_ms(lambda: verify_route(fused, t))
        u_ms = time_ms(lambda: verify_route(unfused, t), 2, 5)  # eager: torch ops and the verify kernel over gathered copies
        fla_ms = graph_ms(lambda: fla_route(t, conv_out))
        gdn_ms = graph_ms(lambda: fused.gdn_verify(*split_qkv(conv_out, *t["dims"][:4]), t["a"], t["b"], t["A_log"],
                                                  t["dt_bias"], t["state"][:, 0], t["slot_ids"], t["parents"],
                                                  chains=True))
        roof = (conv_b + gdn_b) / (bw * 1e9) * 1e3
        rows.append({"lanes": L, "fused_ms": f_ms, "unfused_ms": u_ms, "unfused/fused": u_ms / f_ms,
                     "fused_gdn_ms": gdn_ms, "fla_gdn_ms": fla_ms, "fla/fused_gdn": fla_ms / gdn_ms,
                     "roofline_ms": roof, "fused/roofline": f_ms / roof,
                     "fused_gdn/roofline": gdn_ms / (gdn_b / (bw * 1e9) * 1e3)})

        # the state commit: replay and conv history of all GDN layers (24 in the 9B model), `accepted` rows per
        # lane, one launch
        G, acc = args.gdn_layers, args.accepted
        nk, nv, dk, dv, C, K = t["dims"]
        pool = torch.randn(max(2 * L, 8), G, nv, dk, dv, device="cuda") * 0.1
        log = torch.randn(G, L, W, nv, 1 + dk + dv, device="cuda") * 0.01
        history = torch.randn(pool.shape[0], G, C, K - 1, device="cuda", dtype=torch.bfloat16)
        windows = torch.randn(G, L, C, K - 1 + W, device="cuda", dtype=torch.bfloat16)
        plan = CommitPlan.chain(t["slot_ids"], torch.full((L,), acc, device="cuda"), W, slot_ids_host=(),
                                accepted_len_host=(), start_host=())

        def commit():  # the kernels' commit: the caller (cache/commit.py) validated the plan
            fused.commit_state(pool, log, history, windows, plan)

        c_ms, eager_ms = graph_ms(commit), time_ms(commit, 5, 20)
        c_bytes = 2 * L * G * nv * dk * dv * 4 + L * G * acc * nv * (1 + dk + dv) * 4 + L * G * C * (K - 1) * 2 * 2
        c_roof = c_bytes / (bw * 1e9) * 1e3
        commit_rows.append({"lanes": L, "gdn_layers": G, "accepted_rows": acc, "commit_ms": c_ms,
                            "roofline_ms": c_roof, "commit/roofline": c_ms / c_roof,
                            "eager_call_ms": eager_ms})
    print(f"copy bandwidth {bw:.0f} GB/s (read + write)")
    print_table(f"GDN verify, one layer (nk 16, nv 32, dk 128, conv channels 8192, W {W}); routes include the conv step",
                rows)
    print_table("state commit: replay + conv history (all GDN layers, one launch)", commit_rows)
    result = {"machine": machine(), "copy_bandwidth_gbs": bw, "width": W, "verify": rows, "commit": commit_rows}
    write_json(args.json, result)
    return result


def register(sub) -> None:
    p = sub.add_parser("kernels", help="verify-route kernels vs unfused, fla-core and the byte roofline (CUDA)")
    p.add_argument("--lanes", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--gdn-layers", type=int, default=24)
    p.add_argument("--accepted", type=int, default=8, help="rows committed per lane in the commit benchmark")
    p.add_argument("--json", default=None)
    p.set_defaults(func=run)
