"""`deltaflash bench e2e --reference`: the demo pair at concurrency 1 in transformers (`generate`,
greedy) and z-lab's `dflash_generate` (transformers models), beside deltaflash's own concurrency-1
points. dflash is not lossless on Qwen3.5 targets, so the tokens of its output that differ from
deltaflash target-only greedy are counted (position by position, plus any length difference)."""

from __future__ import annotations

import time

import torch


def reference(args, workload, result: dict) -> dict:
    if workload.name != "demo":
        raise SystemExit("--reference runs on the demo workload (--workload demo)")
    from transformers import Qwen3_5ForCausalLM

    try:
        from dflash.model import DFlashDraftModel, dflash_generate
    except ImportError as exc:
        raise SystemExit(f"--reference needs z-lab's dflash package (pip install its wheel): {exc}") from exc

    device = torch.device(args.device) if args.device else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target_dir, draft_dir = workload.meta["target"], workload.meta["draft"]
    hf = Qwen3_5ForCausalLM.from_pretrained(target_dir, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    draft = DFlashDraftModel.from_pretrained(draft_dir, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    stop = list(hf.config.eos_token_id if isinstance(hf.config.eos_token_id, list) else [hf.config.eos_token_id])
    n_new = workload.params.max_new_tokens
    plain = workload.engine("target-only")
    greedy = [c.token_ids for c in plain.generate(workload.prompts, workload.params)[0]]

    def hf_generate(ids):
        out = hf.generate(ids, max_new_tokens=n_new, do_sample=False, eos_token_id=stop, pad_token_id=stop[0])
        return out[0, ids.shape[1]:].tolist()

    def dflash(ids):
        if device.type != "cuda":  # its return_stats timing calls torch.cuda.synchronize
            return dflash_generate(draft, hf, ids, n_new, stop, block_size=workload.block_size)[0, ids.shape[1]:].tolist(), []
        out = dflash_generate(draft, hf, ids, n_new, stop, block_size=workload.block_size, return_stats=True)
        return out.output_ids[0, out.num_input_tokens:].tolist(), out.acceptance_lengths

    rows = {"transformers_generate": [0, 0.0, 0, []], "dflash_generate": [0, 0.0, 0, []]}  # tokens, s, differing, acc
    with torch.inference_mode():
        warm = torch.tensor([workload.prompts[0]], device=device)
        hf_generate(warm), dflash(warm)
        for prompt, expected in zip(workload.prompts, greedy):
            ids = torch.tensor([prompt], device=device)
            for name in rows:
                _sync(device)
                t0 = time.perf_counter()
                tokens, acc = (hf_generate(ids), None) if name == "transformers_generate" else dflash(ids)
                _sync(device)
                row = rows[name]
                row[0] += len(tokens)
                row[1] += time.perf_counter() - t0
                row[2] += differing_tokens(tokens, expected)
                row[3] += acc or []
    out = {name: {"tokens": t, "seconds": s, "tokens_per_s": t / s, "tokens_differing_from_target_only_greedy": d,
                  **({"mean_accepted_length": sum(a) / len(a)} if a else {})}
           for name, (t, s, d, a) in rows.items()}
    ours = {p["mode"]: p for p in result["points"] if p["concurrency"] == 1}
    for mode, point in ours.items():
        out[f"deltaflash_{mode}_c1"] = {"tokens_per_s": point["tokens_per_s"],
                                        "mean_accepted_length": point["mean_accepted_length"]}
    if "spec" in ours:
        spec = ours["spec"]["tokens_per_s"]
        out["ratios"] = {f"deltaflash_spec_c1_over_{name}": spec / out[name]["tokens_per_s"] for name in rows}
    out["note"] = ("single sequence each; tokens/s = output tokens / wall seconds over all prompts, "
                   f"{dtype} on {device.type}")
    print("\nreference at concurrency 1 (same demo pair, same prompts):")
    for name, row in out.items():
        print(f"  {name}: {row}")
    return out


def differing_tokens(tokens: list[int], expected: list[int]) -> int:
    """Positions where the two differ, plus the length difference."""
    return sum(a != b for a, b in zip(tokens, expected)) + abs(len(tokens) - len(expected))


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
