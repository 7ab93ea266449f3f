"""Tiny random Qwen3.5 checkpoints written the way real ones are, for tests (no hub access)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

DENSE_GQA = dict(  # nv / nk = 2, untied
    vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=16, linear_value_head_dim=16, tie_word_embeddings=False,
)
DENSE_TIED = dict(  # nv = nk, tied embeddings, 2 attention layers
    vocab_size=80, hidden_size=48, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
    num_key_value_heads=1, head_dim=24, linear_num_key_heads=2, linear_num_value_heads=2,
    linear_key_head_dim=8, linear_value_head_dim=12, tie_word_embeddings=True,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
)
MOE = dict(
    vocab_size=96, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=48, tie_word_embeddings=False,
)


def build_hf_model(kind: str, seed: int = 0, **overrides):
    """A random transformers model (fp32, eval) with every weight, norms included, perturbed."""
    from transformers import (Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig,
                              Qwen3_5TextConfig)

    torch.manual_seed(seed)
    spec = {"dense_gqa": DENSE_GQA, "dense_tied": DENSE_TIED, "moe": MOE}[kind] | overrides
    if kind == "moe":
        model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**spec))
    else:
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**spec))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:  # norms, A_log, dt_bias: make a (1 + w) vs w mix-up visible
                p.add_(0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.08)
    return model.eval()


def save_checkpoint(model, folder: Path, layout: str = "causal_lm", max_shard_size: str | None = None) -> Path:
    """layout 'causal_lm': model.* keys as Qwen3_5ForCausalLM saves them.
    layout 'conditional': model.language_model.* keys, config nested under text_config, plus
    model.visual.* and mtp.* tensors the loader must skip (as released multimodal checkpoints)."""
    folder = Path(folder)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    if layout == "causal_lm":
        return folder
    for f in folder.glob("*.safetensors"):
        tensors = load_file(str(f))
        renamed = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
                   for k, v in tensors.items()}
        save_file(renamed, str(f), metadata={"format": "pt"})
    index = folder / "model.safetensors.index.json"
    extra = {"model.visual.patch_embed.proj.weight": torch.randn(4, 3), "mtp.fc.weight": torch.randn(5, 5)}
    save_file(extra, str(folder / "extras.safetensors"), metadata={"format": "pt"})
    if index.is_file():
        data = json.loads(index.read_text())
        wm = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
              for k, v in data["weight_map"].items()}
        wm.update({k: "extras.safetensors" for k in extra})
        data["weight_map"] = wm
        index.write_text(json.dumps(data))
    text = json.loads((folder / "config.json").read_text())
    moe = text["model_type"].startswith("qwen3_5_moe")
    outer = {
        "architectures": ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5_moe" if moe else "qwen3_5",
        "text_config": text,
        "vision_config": {"depth": 1},
        "tie_word_embeddings": text.get("tie_word_embeddings", False),
    }
    (folder / "config.json").write_text(json.dumps(outer))
    return folder


def make_tokenizer(folder: Path, vocab_size: int) -> None:
    """A tiny byte-level BPE tokenizer with a chat template, saved in Hugging Face format."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(["def hello(world):\n    return world + 1\n"] * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}<assistant>{% endif %}")
    fast.save_pretrained(str(folder))
