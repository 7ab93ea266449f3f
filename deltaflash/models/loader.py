"""Load a Qwen3.5 text stack from a local Hugging Face folder (config.json + safetensors)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from deltaflash.config import ModelConfig
from deltaflash.errors import MissingTensorError, TensorShapeError
from deltaflash.models.checkpoint import Checkpoint
from deltaflash.models.qwen3_5 import Qwen35Model

# Text weights live under one of these prefixes; everything else (model.visual.*, mtp.*) is skipped.
_PREFIXES = ("model.language_model.", "model.")
_FUSED_EXPERTS = ("experts.gate_up_proj", "experts.down_proj")  # [E, 2I, H], [E, H, I]


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def load_model(folder: str | Path, dtype: torch.dtype | None = None, device=None,
               progress: bool = True, shard: Callable[[ModelConfig], object] | None = None) -> Qwen35Model:
    """Build the model from `folder`. Fails fast with a typed error naming the file and tensor:
    every name and shape is checked against config.json before any tensor data is read.

    shard(config) -> a tensor-parallel rank's share (parallel/tensor.py: Shard, with `config`, `rows(name)`
    and `finish(state)`): the model is that share's, and only its rows are read from the files."""
    folder = Path(folder)
    cfg = ModelConfig.from_folder(folder)
    device = torch.device(device) if device is not None else default_device()
    dtype = dtype or default_dtype(device)
    checkpoint = Checkpoint(folder)
    share = shard(cfg) if shard is not None else None
    with torch.device("meta"):
        model = Qwen35Model(share.config if share is not None else cfg)
        whole = Qwen35Model(cfg) if share is not None else model
    expected = {name: tuple(p.shape) for name, p in whole.state_dict().items()}  # what the files hold

    stored = checkpoint.tensors
    prefix = next((p for p in _PREFIXES if any(k.startswith((p + "layers.", p + "embed_tokens.")) for k in stored)),
                  "model.")

    def checkpoint_key(name: str) -> str:
        return name if name == "lm_head.weight" else prefix + name

    wanted: dict[str, tuple[int, ...]] = {}  # checkpoint key -> its shape as config.json implies
    for name, shape in expected.items():
        key = checkpoint_key(name)
        if name.endswith(_FUSED_EXPERTS) and key not in stored:
            wanted.update(_expert_parts(key, shape))
        else:
            wanted[key] = shape
    missing = [k for k in wanted if k not in stored]
    if missing:
        raise MissingTensorError(
            f"{folder}: tensor {missing[0]!r} is missing from {', '.join(f.name for f in checkpoint.files)}"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    for key, shape in wanted.items():
        if stored[key].shape != shape:
            raise TensorShapeError(f"{stored[key].file}: tensor {key!r} has shape {stored[key].shape}, "
                                   f"expected {shape} from config.json")

    select = None
    if share is not None:
        def select(key):  # a checkpoint key's share, by the model name it fills
            return share.rows(key if key == "lm_head.weight" else key[len(prefix):])
    loaded = checkpoint.read(wanted, dtype, device, desc="loading shards", progress=progress, select=select)
    state = {}
    for name in expected:  # popping each part as it is placed: one copy of the weights at peak
        key = checkpoint_key(name)
        state[name] = loaded.pop(key) if key in loaded else _stack_experts(key, cfg.num_experts, loaded)
    if share is not None:
        state = share.finish(state)
    model.load_state_dict(state, assign=True, strict=True)
    del state  # the merge then frees each part's tensor as it re-homes it: no second copy at peak
    return model.merge_projections().eval()


def _expert_parts(fused_key: str, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """The per-expert checkpoint keys (and shapes) that stack into the fused experts tensor `fused_key`."""
    base, fused = fused_key.rsplit(".", 1)
    num_experts, rows, cols = shape
    if fused == "gate_up_proj":  # [E, 2I, H] <- gate_proj, up_proj [I, H] each
        return {f"{base}.{e}.{part}.weight": (rows // 2, cols)
                for e in range(num_experts) for part in ("gate_proj", "up_proj")}
    return {f"{base}.{e}.down_proj.weight": (rows, cols) for e in range(num_experts)}  # [E, H, I]


def _stack_experts(fused_key: str, num_experts: int, loaded: dict[str, torch.Tensor]) -> torch.Tensor:
    """Pop the per-expert tensors of `fused_key` from `loaded` and stack them into its fused layout."""
    base, fused = fused_key.rsplit(".", 1)
    parts = ("gate_proj", "up_proj") if fused == "gate_up_proj" else ("down_proj",)
    return torch.stack([torch.cat([loaded.pop(f"{base}.{e}.{part}.weight") for part in parts])
                        for e in range(num_experts)])
