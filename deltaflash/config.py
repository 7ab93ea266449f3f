"""Model and engine configuration, resolved once from a checkpoint folder and then frozen."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from deltaflash.errors import CheckpointError, UnknownLayerTypeError, UnsupportedModelError

SUPPORTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass(frozen=True)
class ModelConfig:
    """The text stack of a Qwen3.5 checkpoint (dense or MoE).

    GDN layers: nk key heads and nv value heads of dk / dv dims, a depthwise causal conv of
    `conv_kernel` taps over the qkv channels (`conv_channels` = 2*nk*dk + nv*dv).
    Attention layers: `num_heads` query heads (q_proj rows are per head [q | gate]), `num_kv_heads`
    key/value heads of `head_dim`, RoPE on the first `rotary_dim` dims.
    """

    model_type: str
    hidden_size: int
    vocab_size: int
    layer_types: tuple[str, ...]
    rms_norm_eps: float
    tie_word_embeddings: bool
    # gated attention
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    attention_bias: bool
    # gated delta net
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    conv_kernel: int
    # feed-forward: dense SwiGLU, or MoE when num_experts > 0
    intermediate_size: int
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    max_position_embeddings: int = 32768
    eos_token_ids: tuple[int, ...] = ()
    # tensor parallelism: the embedding and lm_head of one rank hold vocab_size / vocab_shards rows
    # (models/vocab.py; vocab_size stays the whole vocabulary's)
    vocab_shards: int = 1

    @property
    def vocab_rows(self) -> int:
        return self.vocab_size // self.vocab_shards

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def gdn_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    @property
    def attn_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    @property
    def conv_channels(self) -> int:
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + self.linear_num_value_heads * self.linear_value_head_dim

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> "ModelConfig":
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"{source}: model_type {model_type!r} is not supported; expected one of {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        text = raw.get("text_config") or raw  # ConditionalGeneration configs nest the text stack
        if text is not raw and text.get("model_type", model_type) not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"{source}: text_config.model_type {text.get('model_type')!r} is not a Qwen3.5 text stack"
            )

        def need(key: str):
            if key not in text:
                raise CheckpointError(f"{source}: missing required field {key!r}")
            return text[key]

        num_layers = int(need("num_hidden_layers"))
        layer_types = text.get("layer_types")
        if layer_types is None:
            interval = int(text.get("full_attention_interval", 4))
            layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]
        if len(layer_types) != num_layers:
            raise CheckpointError(f"{source}: layer_types has {len(layer_types)} entries, expected num_hidden_layers={num_layers}")
        for i, kind in enumerate(layer_types):
            if kind not in LAYER_TYPES:
                raise UnknownLayerTypeError(f"{source}: layer_types[{i}] = {kind!r}; expected one of {', '.join(LAYER_TYPES)}")

        rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
        rope_theta = float(rope.get("rope_theta", text.get("rope_theta", 10000.0)))
        partial = float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 1.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "mrope"):
            raise UnsupportedModelError(f"{source}: rope_type {rope_type!r} is not supported; expected 'default'")
        hidden = int(need("hidden_size"))
        num_heads = int(need("num_attention_heads"))
        head_dim = int(text.get("head_dim") or hidden // num_heads)
        eos = raw.get("eos_token_id", text.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        moe = "num_experts" in text and int(text.get("num_experts") or 0) > 0
        tie = raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        return cls(
            model_type=model_type,
            hidden_size=hidden,
            vocab_size=int(need("vocab_size")),
            layer_types=tuple(layer_types),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(tie),
            num_heads=num_heads,
            num_kv_heads=int(need("num_key_value_heads")),
            head_dim=head_dim,
            rotary_dim=int(head_dim * partial),
            rope_theta=rope_theta,
            attention_bias=bool(text.get("attention_bias", False)),
            linear_num_key_heads=int(need("linear_num_key_heads")),
            linear_num_value_heads=int(need("linear_num_value_heads")),
            linear_key_head_dim=int(need("linear_key_head_dim")),
            linear_value_head_dim=int(need("linear_value_head_dim")),
            conv_kernel=int(text.get("linear_conv_kernel_dim", 4)),
            intermediate_size=int(text.get("intermediate_size") or 0),
            num_experts=int(text.get("num_experts") or 0) if moe else 0,
            num_experts_per_tok=int(text.get("num_experts_per_tok") or 0) if moe else 0,
            moe_intermediate_size=int(text.get("moe_intermediate_size") or 0) if moe else 0,
            shared_expert_intermediate_size=int(text.get("shared_expert_intermediate_size") or 0) if moe else 0,
            max_position_embeddings=int(text.get("max_position_embeddings", 32768)),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> "ModelConfig":
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise CheckpointError(f"{path}: not found; expected a Hugging Face checkpoint folder with config.json")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{path}: invalid JSON ({exc})") from exc
        cfg = cls.from_dict(raw, source=str(path))
        gen = Path(folder) / "generation_config.json"
        if not cfg.eos_token_ids and gen.is_file():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            if eos is not None:
                from dataclasses import replace

                cfg = replace(cfg, eos_token_ids=tuple(eos) if isinstance(eos, list) else (int(eos),))
        return cfg
