"""Load a Qwen3.5 text stack from a local Hugging Face folder (config.json + safetensors)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from deltaflash.config import ModelConfig
from deltaflash.errors import CheckpointError, MissingTensorError, TensorShapeError
from deltaflash.models.qwen3_5 import Qwen35Model

# Text weights live under one of these prefixes; everything else (model.visual.*, mtp.*) is skipped.
_PREFIXES = ("model.language_model.", "model.")
_EXPERT_PROJ = ("gate_proj", "up_proj", "down_proj")


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def shard_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint, from the index when there is one."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({folder / name for name in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{index}: lists shard {f.name}, which is not in {folder}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no *.safetensors files (and no model.safetensors.index.json)")
    return files


def load_model(folder: str | Path, dtype: torch.dtype | None = None, device=None,
               progress: bool = True) -> Qwen35Model:
    """Build the model from `folder`. Fails fast with a typed error naming the file and tensor."""
    folder = Path(folder)
    cfg = ModelConfig.from_folder(folder)
    device = torch.device(device) if device is not None else default_device()
    dtype = dtype or default_dtype(device)
    files = shard_files(folder)
    with torch.device("meta"):
        model = Qwen35Model(cfg)
    expected = {name: tuple(p.shape) for name, p in model.state_dict().items()}

    keys = {}  # checkpoint key -> file
    for f in files:
        with safe_open(str(f), "pt") as handle:
            for key in handle.keys():
                keys[key] = f
    prefix = next((p for p in _PREFIXES if any(k.startswith(p + "layers.") or k.startswith(p + "embed_tokens.") for k in keys)), "model.")

    def checkpoint_key(name: str) -> str:
        return name if name == "lm_head.weight" else prefix + name

    wanted: dict[str, str] = {}  # checkpoint key -> model name (or per-expert part)
    for name in expected:
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")) and checkpoint_key(name) not in keys:
            base = checkpoint_key(name).rsplit(".", 1)[0]
            parts = ("gate_proj", "up_proj") if name.endswith("gate_up_proj") else ("down_proj",)
            for e in range(cfg.num_experts):
                for part in parts:
                    wanted[f"{base}.{e}.{part}.weight"] = name
        else:
            wanted[checkpoint_key(name)] = name
    missing = [k for k in wanted if k not in keys]
    if missing:
        raise MissingTensorError(
            f"{folder}: tensor {missing[0]!r} is missing from {', '.join(f.name for f in files)}"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))

    state: dict[str, torch.Tensor] = {}
    loaded: dict[str, torch.Tensor] = {}
    for f in tqdm(files, desc="loading shards", unit="shard", disable=not progress):
        with safe_open(str(f), "pt") as handle:
            for key in handle.keys():
                if key in wanted and keys[key] == f:
                    loaded[key] = handle.get_tensor(key).to(device=device, dtype=dtype)
    for key, name in wanted.items():
        if name not in state and key == checkpoint_key(name):
            state[name] = loaded[key]
    for name in expected:
        if name not in state:  # per-expert tensors, stacked into the fused layout
            base = checkpoint_key(name).rsplit(".", 1)[0]
            if name.endswith("gate_up_proj"):
                state[name] = torch.stack([torch.cat([loaded[f"{base}.{e}.gate_proj.weight"],
                                                      loaded[f"{base}.{e}.up_proj.weight"]]) for e in range(cfg.num_experts)])
            else:
                state[name] = torch.stack([loaded[f"{base}.{e}.down_proj.weight"] for e in range(cfg.num_experts)])
    for name, shape in expected.items():
        if tuple(state[name].shape) != shape:
            key = checkpoint_key(name)
            raise TensorShapeError(
                f"{keys.get(key, folder)}: tensor {key!r} has shape {tuple(state[name].shape)}, "
                f"expected {shape} from config.json")
    model.load_state_dict(state, assign=True, strict=True)
    del state, loaded  # the merge then frees each part's tensor as it re-homes it: no second copy at peak
    return model.merge_projections().eval()
