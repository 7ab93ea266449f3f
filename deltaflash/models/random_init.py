"""Random weights for a config, straight on the device (benchmarks of real shapes, no checkpoint)."""

from __future__ import annotations

import dataclasses
import math

import torch

from deltaflash.config import ModelConfig
from deltaflash.models.qwen3_5 import Qwen35Model


COPY_EMBED_RMS = 100.0  # per element; what the layers add to the residual stream stays within a few units


def random_model(cfg: ModelConfig, dtype: torch.dtype, device, seed: int = 0, copying: bool = False) -> Qwen35Model:
    """Matrices ~ N(0, 1/fan_in), norms ~ 0 (+noise), A_log = log U(1, 16), dt_bias = 1.

    Greedy decoding of such a model is chaotic in bf16: its top logits are near ties, so the
    rounding differences between a 1-row decode and a 16-row verify flip the argmax within a few
    tokens, and no recorded continuation survives a second run. `copying=True` makes it stable:
    embedding rows of rms COPY_EMBED_RMS dominate the residual stream and the lm_head is the
    embedding (untied copy), so the greedy next token is the current one, by a margin of about
    sqrt(hidden_size) standard deviations (an estimate from the construction). Every kernel still
    runs on the same shapes, so speed is unchanged; only the values differ.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.device("meta"):
        model = Qwen35Model(cfg)
    state = {}
    for name, p in model.state_dict().items():
        t = torch.empty(p.shape, dtype=dtype, device=device)
        if name.endswith("A_log"):
            t.uniform_(1.0, 16.0, generator=gen).log_()
        elif name.endswith("dt_bias"):
            t.fill_(1.0)
        elif p.ndim == 1:
            t.normal_(0.0, 0.1, generator=gen)
        else:
            t.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]), generator=gen)
        state[name] = t
    if copying:
        embed = state["embed_tokens.weight"]
        embed.mul_(COPY_EMBED_RMS / embed.float().pow(2).mean(-1, keepdim=True).sqrt().to(dtype))
        if not cfg.tie_word_embeddings:
            state["lm_head.weight"] = embed / COPY_EMBED_RMS
    model.load_state_dict(state, assign=True, strict=True)
    del state  # the merge frees each part's tensor as it re-homes it
    return model.merge_projections().eval()


def qwen35_9b_config(num_layers: int = 32) -> ModelConfig:
    """The Qwen3.5-9B text stack's shapes."""
    return ModelConfig(
        model_type="qwen3_5_text", hidden_size=4096, vocab_size=248320,
        layer_types=tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_layers)),
        rms_norm_eps=1e-6, tie_word_embeddings=False, num_heads=16, num_kv_heads=4, head_dim=256,
        rotary_dim=64, rope_theta=1e7, attention_bias=False, linear_num_key_heads=16, linear_num_value_heads=32,
        linear_key_head_dim=128, linear_value_head_dim=128, conv_kernel=4, intermediate_size=12288,
        max_position_embeddings=262144,
    )


def qwen35_27b_config(num_layers: int = 64) -> ModelConfig:
    """The Qwen3.5-27B text stack's shapes (the most used DFlash target): the 9B's layer kinds, wider."""
    return dataclasses.replace(qwen35_9b_config(num_layers), hidden_size=5120, num_heads=24,
                               linear_num_value_heads=48, intermediate_size=17408)


def toy_config(num_layers: int = 4) -> ModelConfig:
    """A few-MB model of the 9B's layer kinds, to try a benchmark's script on the CPU."""
    return dataclasses.replace(qwen35_9b_config(num_layers), hidden_size=128, vocab_size=512, num_heads=4,
                               num_kv_heads=2, head_dim=32, rotary_dim=16, linear_num_key_heads=4,
                               linear_num_value_heads=8, linear_key_head_dim=32, linear_value_head_dim=32,
                               intermediate_size=256, max_position_embeddings=4096)


SHAPES = {"9b": qwen35_9b_config, "27b": qwen35_27b_config, "toy": toy_config}  # name -> config(num_layers)


def weight_bytes(model: Qwen35Model) -> tuple[int, int]:
    """(all parameter bytes, bytes one forward reads: all but the embedding table)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.embed_tokens.weight
    read = total - (0 if model.cfg.tie_word_embeddings else embed.numel() * embed.element_size())
    return total, read
