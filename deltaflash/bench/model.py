"""`deltaflash bench model`: prefill and batched decode of a Qwen3.5-9B-shaped model (random bf16
weights) as ratios to the weight-read limit, side by side with transformers on the same weights; and
time to first token through an engine at the serve defaults against transformers' forward and the
compute limit (weight read, or prefill FLOPs at the measured bf16 GEMM rate, whichever is longer)."""

from __future__ import annotations

import dataclasses

import torch

from deltaflash.bench.common import (
    copy_bandwidth_gbs, machine, matmul_tflops, print_table, share_of_device, time_ms, write_json,
)
from deltaflash.cache.slots import SlotPool
from deltaflash.core.batch import ExtendBatch
from deltaflash.core.request import SamplingParams
from deltaflash.models.random_init import qwen35_9b_config, random_model, weight_bytes
from deltaflash.ops.kernels import reference_kernels, triton_kernels


def transformers_twin(model):
    """transformers' Qwen3_5ForCausalLM sharing our parameter tensors (no copy)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    c = model.cfg
    hf_cfg = Qwen3_5TextConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim, linear_num_key_heads=c.linear_num_key_heads,
        linear_num_value_heads=c.linear_num_value_heads, linear_key_head_dim=c.linear_key_head_dim,
        linear_value_head_dim=c.linear_value_head_dim, layer_types=list(c.layer_types),
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta,
                         "partial_rotary_factor": c.rotary_dim / c.head_dim},
        tie_word_embeddings=c.tie_word_embeddings, attn_implementation="sdpa",
    )
    with torch.device("meta"):
        hf = Qwen3_5ForCausalLM(hf_cfg)
    state = {(k if k == "lm_head.weight" else "model." + k): v for k, v in model.state_dict().items()}
    hf.load_state_dict(state, assign=True, strict=True)
    device = model.embed_tokens.weight.device
    hf.model.rotary_emb = type(hf.model.rotary_emb)(config=hf_cfg).to(device)
    return hf.eval()


@torch.inference_mode()
def run(args) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = qwen35_9b_config(args.layers)
    model = random_model(cfg, torch.bfloat16, device)
    total_bytes, read_bytes = weight_bytes(model)
    bw = copy_bandwidth_gbs(device)
    limit_ms = read_bytes / (bw * 1e9) * 1e3
    hf = transformers_twin(model) if not args.no_transformers else None
    rows = []
    gen = torch.Generator(device="cpu").manual_seed(0)
    kernels = triton_kernels() if device.type == "cuda" else reference_kernels()

    # prefill of one prompt
    T = args.prefill_tokens
    pool = SlotPool(cfg, max(args.decode_batches), T + args.context + 64, torch.bfloat16, device)
    prompt = torch.randint(0, cfg.vocab_size, (T,), generator=gen).tolist()

    def ours_prefill():
        pool.reset(0)
        model.extend(ExtendBatch.build([(0, 0, prompt)], device), pool, kernels)

    ids = torch.tensor([prompt], device=device)
    row = {"phase": f"prefill {T}", "deltaflash_ms": time_ms(ours_prefill, 2, 5)}
    if hf is not None:
        row["transformers_ms"] = time_ms(lambda: hf(ids, use_cache=False, logits_to_keep=1), 2, 5)
    rows.append(row)

    # batched decode: B sequences at different positions, one row each
    for B in args.decode_batches:
        slots = list(range(B))
        lens = [args.context - i for i in range(B)]
        for s, n in zip(slots, lens):
            pool.reset(s)
            prompt_s = torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist()
            model.extend(ExtendBatch.build([(s, 0, prompt_s)], device), pool, kernels)

        def ours_decode():
            batch = ExtendBatch.build([(s, pool.lengths[s], [7]) for s in slots], device)
            model.extend(batch, pool, kernels)

        row = {"phase": f"decode B={B}", "deltaflash_ms": time_ms(ours_decode, 3, 10)}
        if hf is not None:
            from transformers import DynamicCache

            cache = DynamicCache(config=hf.config)
            hf(torch.randint(0, cfg.vocab_size, (B, args.context), device=device), past_key_values=cache,
               use_cache=True, logits_to_keep=1)
            step_ids = torch.full((B, 1), 7, device=device)
            row["transformers_ms"] = time_ms(
                lambda: hf(step_ids, past_key_values=cache, use_cache=True), 3, 10)
            del cache
        rows.append(row)

    for r in rows:
        r["weight_read_ms"] = limit_ms
        r["deltaflash_x_limit"] = r["deltaflash_ms"] / limit_ms
        if "transformers_ms" in r:
            r["transformers_x_limit"] = r["transformers_ms"] / limit_ms
            r["speedup_vs_transformers"] = r["transformers_ms"] / r["deltaflash_ms"]
    print(f"weights: {total_bytes / 1e9:.2f} GB total, {read_bytes / 1e9:.2f} GB read per forward "
          f"(all but the embedding table); copy bandwidth {bw:.0f} GB/s -> weight-read limit {limit_ms:.2f} ms")
    print_table("Qwen3.5-9B shape, random bf16 weights (ratios: measured / weight-read limit)", rows)
    result = {"machine": machine(), "weight_bytes": total_bytes, "weight_read_bytes": read_bytes,
              "copy_bandwidth_gbs": bw, "weight_read_limit_ms": limit_ms, "rows": rows}
    if args.ttft_tokens:
        del pool
        result["ttft"] = ttft_rows(model, hf, args.ttft_tokens, limit_ms, gen)
    write_json(args.json, result)
    return result


def prefill_flops(cfg, tokens: int, read_bytes: int, last_row_weights: int = 0) -> float:
    """One prompt's prefill FLOPs: every read weight (bf16) once per token except the lm_head (its last row
    only), plus causal attention (2 T^2 head_dim per head and layer); the GDN layers' chunked recurrence is
    left out (a small share at these shapes). last_row_weights: the weights of the last layer the last row
    alone needs (`last_row_weights`), counted once as the lm_head is - and, if that layer attends, one query's
    attention for it - the least a first token takes (the engine skips the rest); 0: the whole forward."""
    lm_head = cfg.vocab_size * cfg.hidden_size
    weights = read_bytes // 2 - lm_head - last_row_weights
    attention_layers = len(cfg.attn_layer_ids)
    last_attends = last_row_weights and cfg.num_layers - 1 in cfg.attn_layer_ids
    attention = 2 * tokens * cfg.num_heads * cfg.head_dim * ((attention_layers - last_attends) * tokens + 2 * last_attends)
    return 2 * weights * tokens + 2 * (lm_head + last_row_weights) + attention


def last_row_weights(model) -> int:
    """Weights of the last layer that only each prompt's last row needs (Qwen35Model.extend computes that row
    alone past the layer's K/V or GDN state): its MLP and, in an attention layer, the query / gate and output
    projections."""
    layer = model.layers[-1]
    count = sum(p.numel() for p in layer.mlp.parameters())
    return count if layer.is_gdn else count + layer.self_attn.q_proj.weight.numel() + layer.self_attn.o_proj.weight.numel()


def ttft_rows(model, hf, lengths, limit_ms: float, gen) -> list[dict]:
    """Time to first token of one prompt per length: our engine at the serve defaults (slots, the
    model's max_model_len, step and idle budgets, page pools by memory - the two engines share the
    device: a prompt at an idle engine goes in chunks of the idle budget, graphs where a chunk fits one), the same in
    chunks of the step budget (what a prompt arriving beside running streams gets), transformers' forward
    of the prompt (last row's logits, argmax), and the compute limit. The prefix cache is off in both engines: each
    timing prefills its whole prompt (a repeat would start from the state kept by the one before)."""
    from deltaflash.engine.config import EngineConfig
    from deltaflash.engine.engine import Engine

    cfg, device = model.cfg, model.embed_tokens.weight.device
    _, read_bytes = weight_bytes(model)
    rate = matmul_tflops(device)
    config = EngineConfig(prefix_cache=0)
    engine = Engine(model, None, None, dataclasses.replace(
        config, gpu_memory_utilization=share_of_device(device, 2, config.gpu_memory_utilization)))
    budget_chunks = Engine(model, None, None, dataclasses.replace(
        config, idle_prefill_tokens=1, gpu_memory_utilization=share_of_device(device, 1, config.gpu_memory_utilization)))
    params = SamplingParams(max_new_tokens=1, ignore_eos=True)
    rows = []
    for n in lengths:
        prompt = torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist()
        compute_ms, least_ms = (max(limit_ms, prefill_flops(cfg, n, read_bytes, last) / (rate * 1e12) * 1e3)
                                for last in (0, last_row_weights(model)))
        row = {"prompt_tokens": n, "deltaflash_ms": time_ms(lambda: engine.generate([prompt], params), 1, 3),
               "budget_chunks_ms": time_ms(lambda: budget_chunks.generate([prompt], params), 1, 3),
               "compute_limit_ms": compute_ms, "last_row_limit_ms": least_ms}
        if hf is not None:
            ids = torch.tensor([prompt], device=device)
            row["transformers_ms"] = time_ms(lambda: hf(ids, use_cache=False, logits_to_keep=1).logits.argmax(-1), 1, 3)
            row["speedup_vs_transformers"] = row["transformers_ms"] / row["deltaflash_ms"]
        row["deltaflash_x_limit"] = row["deltaflash_ms"] / compute_ms
        row["deltaflash_x_last_row_limit"] = row["deltaflash_ms"] / least_ms
        rows.append(row)
    print(f"bf16 GEMM rate {rate:.0f} TFLOP/s (measured); engine: {engine.config.max_slots} slots, max_model_len "
          f"{engine.config.max_model_len}, idle prefill budget "
          f"{engine.config.idle_prefill_tokens} tokens (budget_chunks: the step budget's "
          f"{engine.config.max_num_batched_tokens}), prefill graphs {engine.config.prefill_graphs}")
    print_table("time to first token, one prompt (ratios: deltaflash / compute limit - the whole forward's FLOPs - "
                "and / last_row_limit - the last layer past its K/V for the last row alone, what the engine runs)", rows)
    return rows


def register(sub) -> None:
    p = sub.add_parser("model", help="prefill / batched decode of the 9B shape vs transformers and the weight-read limit")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--prefill-tokens", type=int, default=2048)
    p.add_argument("--context", type=int, default=512, help="tokens already in each sequence at decode")
    p.add_argument("--decode-batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--ttft-tokens", type=int, nargs="*", default=[64, 256, 1024, 2048, 8192, 32768],
                   help="prompt lengths of the time-to-first-token table (none: skip it)")
    p.add_argument("--no-transformers", action="store_true")
    p.add_argument("--json", default=None, help="write results here")
    p.set_defaults(func=run)
