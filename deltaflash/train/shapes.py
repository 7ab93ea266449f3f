"""Sizes of the demo pair. Plain dataclasses, so `deltaflash` can build its command line from their
defaults without importing torch or transformers."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TargetShape:
    """Sizes of the target; every `full_attention_interval`-th layer is gated attention, the rest GDN."""

    hidden_size: int = 256
    num_layers: int = 8
    full_attention_interval: int = 4
    intermediate_size: int = 384
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_head_dim: int = 64  # dk = dv
    max_position_embeddings: int = 4096


@dataclass(frozen=True)
class DrafterShape:
    """A drafter for a target with `num_target_layers` layers of width `hidden_size`."""

    hidden_size: int
    vocab_size: int
    num_target_layers: int
    target_layer_ids: tuple[int, ...]
    block_size: int
    mask_token_id: int
    num_layers: int = 3
    intermediate_size: int = 384
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096

    def hf_config(self):
        """The `transformers.Qwen3Config` that `DFlashDraftModel` is built from (saved as config.json)."""
        from transformers import Qwen3Config

        config = Qwen3Config(
            architectures=["DFlashDraftModel"],
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=False,
            num_target_layers=self.num_target_layers,
            block_size=self.block_size,
            dflash_config={"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)},
        )
        config.dtype = "bfloat16"  # the dtype of the exported weights
        return config

    @classmethod
    def from_hf_config(cls, raw: dict) -> DrafterShape:
        knobs = raw.get("dflash_config") or {}

        def knob(name: str):  # z-lab reads dflash_config first, then the top level
            return knobs.get(name, raw.get(name))

        rope = raw.get("rope_parameters") or {}
        return cls(
            hidden_size=raw["hidden_size"],
            vocab_size=raw["vocab_size"],
            num_target_layers=raw["num_target_layers"],
            target_layer_ids=tuple(knob("target_layer_ids")),
            block_size=int(knob("block_size")),
            mask_token_id=int(knob("mask_token_id")),
            num_layers=raw["num_hidden_layers"],
            intermediate_size=raw["intermediate_size"],
            num_attention_heads=raw["num_attention_heads"],
            num_key_value_heads=raw["num_key_value_heads"],
            head_dim=raw["head_dim"],
            rms_norm_eps=raw["rms_norm_eps"],
            rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
            max_position_embeddings=raw["max_position_embeddings"],
        )


def default_target_layer_ids(num_target_layers: int, count: int) -> tuple[int, ...]:
    """`count` distinct layers spread evenly from layer 1 to layer L-3 (the middle layer when count is 1)."""
    if count == 1:
        return (num_target_layers // 2,)
    if count > num_target_layers - 1:
        raise ValueError(f"{count} context layers do not fit a target of {num_target_layers} layers")
    first, last = 1, max(num_target_layers - 3, count)
    return tuple(round(first + i * (last - first) / (count - 1)) for i in range(count))
