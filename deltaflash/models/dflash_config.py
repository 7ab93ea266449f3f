"""`DraftConfig`: a DFlash / DFlash2 drafter described once, from its folder's config.json.

Where each field is read (the conventions of z-lab's `dflash` checkpoints):
- drafter knobs (`block_size`, `mask_token_id`, `target_layer_ids`, `input_embedding_scale`,
  `output_multiplier`, `final_logit_softcapping`, DFlash2 `conv_*` / `selector_*`): inside
  `dflash_config` when the key is there, else at the top level (null means absent: the default);
- the decoder shape and attention pattern (`layer_types`, `sliding_window`, `use_sliding_window`,
  `is_causal`, RoPE): top level only, with the meaning `transformers.Qwen3Config` gives them.
`target_layer_ids` and `mask_token_id` are never guessed: a checkpoint without them is refused.
"""

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deltaflash.errors import CheckpointError, UnknownLayerTypeError, UnsupportedModelError

ARCHITECTURES = {"DFlashDraftModel": "dflash", "DFlash2DraftModel": "dflash2"}
_ABSENT = object()


@dataclass(frozen=True)
class DraftConfig:
    """Everything the drafter's math depends on. Per-layer tuples have `num_layers` entries.

    sliding_windows[i]: None = layer i sees every context row; W = it sees keys with
        query_pos - key_pos < W (and key_pos - query_pos < W when the layer is not causal).
    causal[i]: block queries see only block keys at positions <= their own.
    rope_linear_factor: positions are divided by it ("linear" RoPE scaling); 1.0 = plain RoPE.
    vocab_size: None when config.json states none (then the target's vocabulary is assumed).
    conv_* / selector_*: DFlash2 only (0 for DFlash).
    """

    variant: str  # "dflash" or "dflash2"
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    attention_bias: bool
    rope_theta: float
    rope_linear_factor: float
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    sliding_windows: tuple[int | None, ...]
    causal: tuple[bool, ...]
    vocab_size: int | None = None
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_top_k: int = 0
    selector_rank: int = 0

    @property
    def num_taps(self) -> int:
        """How many target hidden states are concatenated into one context row."""
        return len(self.target_layer_ids)


def read_draft_config(folder: Path) -> DraftConfig:
    """Parse `folder/config.json`; raises CheckpointError subclasses naming the bad field."""
    path = Path(folder) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no config.json in the drafter folder") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: cannot read it as JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: expected a JSON object at the top level")
    return resolve_draft_config(raw, source=str(path))


def resolve_draft_config(raw: dict[str, Any], source: str) -> DraftConfig:
    """Resolve the raw config.json dict; `source` names the file in error messages."""
    knobs = raw.get("dflash_config") or {}

    def read(name: str, cast: Callable[[Any], Any], default: Any = _ABSENT, *, knob: bool = False) -> Any:
        """A field (null = absent), converted by cast; knobs look inside dflash_config first."""
        value = knobs.get(name) if knob and name in knobs else raw.get(name)
        where = "inside 'dflash_config' or at the top level" if knob else "at the top level"
        if value is None:
            if default is _ABSENT:
                raise CheckpointError(f"{source}: field '{name}' is missing (looked {where})")
            return default
        try:
            return cast(value)
        except (TypeError, ValueError):
            raise CheckpointError(f"{source}: field '{name}' is {value!r}, expected {cast.__name__}") from None

    variant = _variant(raw, source)
    hidden, heads = read("hidden_size", int), read("num_attention_heads", int)
    layers = read("num_hidden_layers", int)
    if read("hidden_act", str, "silu") != "silu":
        raise UnsupportedModelError(f"{source}: hidden_act is {raw['hidden_act']!r}, expected 'silu'")
    windows, causal = _attention_pattern(raw, layers, source)
    theta, factor = _rope(raw, source)
    softcap = read("final_logit_softcapping", float, None, knob=True)
    extras = {}
    if variant == "dflash2":
        extras = {name: read(name, int, knob=True) for name in
                  ("conv_kernel_size", "conv_group_size", "selector_top_k", "selector_rank")}
        if extras["conv_group_size"] <= 0 or hidden % extras["conv_group_size"]:
            raise CheckpointError(
                f"{source}: conv_group_size {extras['conv_group_size']} must divide hidden_size {hidden}"
            )
    config = DraftConfig(
        variant=variant,
        hidden_size=hidden,
        intermediate_size=read("intermediate_size", int),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=read("num_key_value_heads", int, heads),
        head_dim=read("head_dim", int, hidden // heads),
        rms_norm_eps=read("rms_norm_eps", float, 1e-6),
        attention_bias=read("attention_bias", bool, False),
        rope_theta=theta,
        rope_linear_factor=factor,
        block_size=read("block_size", int, 16, knob=True),
        mask_token_id=read("mask_token_id", int, knob=True),
        target_layer_ids=read("target_layer_ids", layer_id_tuple, knob=True),
        sliding_windows=windows,
        causal=causal,
        vocab_size=read("vocab_size", int, None),
        input_embedding_scale=read("input_embedding_scale", float, 1.0, knob=True),
        output_multiplier=read("output_multiplier", float, 1.0, knob=True),
        final_logit_softcapping=softcap if softcap is not None and softcap > 0 else None,
        **extras,
    )
    if config.block_size < 1 or config.num_heads % config.num_kv_heads:
        raise CheckpointError(
            f"{source}: expected block_size >= 1 and num_attention_heads divisible by num_key_value_heads, "
            f"got {config.block_size}, {config.num_heads}, {config.num_kv_heads}"
        )
    return config


def layer_id_tuple(value: Any) -> tuple[int, ...]:
    """A non-empty list of int layer ids (ValueError otherwise)."""
    if not isinstance(value, list) or not value or not all(isinstance(i, int) for i in value):
        raise ValueError(value)
    return tuple(value)


def _variant(raw: dict[str, Any], source: str) -> str:
    names = [ARCHITECTURES[a] for a in raw.get("architectures") or [] if a in ARCHITECTURES]
    if not names:
        raise UnsupportedModelError(
            f"{source}: architectures is {raw.get('architectures')!r}, expected one of {sorted(ARCHITECTURES)}"
        )
    return names[0]


def _attention_pattern(
    raw: dict[str, Any], layers: int, source: str
) -> tuple[tuple[int | None, ...], tuple[bool, ...]]:
    """Per-layer (window, causal) as Qwen3Config + the dflash attention module resolve them."""
    window = raw.get("sliding_window") if raw.get("use_sliding_window", False) else None
    types = raw.get("layer_types")
    if types is None:
        first_windowed = int(raw.get("max_window_layers", 28))
        types = ["sliding_attention" if window is not None and i >= first_windowed else "full_attention"
                 for i in range(layers)]
    if len(types) != layers:
        raise CheckpointError(f"{source}: layer_types has {len(types)} entries, expected {layers}")
    for i, kind in enumerate(types):
        if kind not in ("full_attention", "sliding_attention"):
            raise UnknownLayerTypeError(
                f"{source}: layer_types[{i}] is {kind!r}, expected 'full_attention' or 'sliding_attention'"
            )
    is_causal = raw.get("is_causal")
    windows = tuple(int(window) if k == "sliding_attention" and window is not None else None for k in types)
    causal = tuple(k == "sliding_attention" if is_causal is None else bool(is_causal) for k in types)
    return windows, causal


def _rope(raw: dict[str, Any], source: str) -> tuple[float, float]:
    """(theta, linear factor) from `rope_parameters` (transformers 5) or `rope_theta` / `rope_scaling`."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if {"full_attention", "sliding_attention"} & set(params):
        raise UnsupportedModelError(f"{source}: per-layer-type rope_parameters are not supported")
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, 1.0
    if kind == "linear":
        return theta, float(params["factor"])
    raise UnsupportedModelError(f"{source}: rope type {kind!r} is not supported, expected 'default' or 'linear'")
