"""Each kind of bad checkpoint fails fast with its typed error, naming the file / tensor / field."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from deltaflash.errors import (CheckpointError, MissingTensorError, TensorShapeError, UnknownLayerTypeError,
                               UnsupportedModelError)
from deltaflash.models.loader import load_model
from tests.checkpoints import build_hf_model, save_checkpoint


@pytest.fixture()
def folder(tmp_path):
    return save_checkpoint(build_hf_model("dense_gqa"), tmp_path / "ckpt")


def _edit_tensors(folder, edit):
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _edit_config(folder, edit):
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    edit(cfg)
    path.write_text(json.dumps(cfg))


def test_missing_tensor(folder):
    _edit_tensors(folder, lambda t: t.pop("model.layers.2.linear_attn.A_log"))
    with pytest.raises(MissingTensorError, match=r"model\.layers\.2\.linear_attn\.A_log.*model\.safetensors"):
        load_model(folder, device="cpu", progress=False)


def test_missing_untied_lm_head(folder):
    _edit_tensors(folder, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(MissingTensorError, match="lm_head.weight"):
        load_model(folder, device="cpu", progress=False)


def test_wrong_shape(folder):
    def shrink(t):
        t["model.layers.3.self_attn.k_proj.weight"] = torch.zeros(16, 64)
    _edit_tensors(folder, shrink)
    with pytest.raises(TensorShapeError, match=r"model\.safetensors.*k_proj\.weight.*\(16, 64\).*\(32, 64\)"):
        load_model(folder, device="cpu", progress=False)


def test_unsupported_model_type(folder):
    _edit_config(folder, lambda c: c.update(model_type="llama"))
    with pytest.raises(UnsupportedModelError, match=r"config\.json.*'llama'"):
        load_model(folder, device="cpu", progress=False)


def test_unknown_layer_type(folder):
    _edit_config(folder, lambda c: c["layer_types"].__setitem__(1, "mamba"))
    with pytest.raises(UnknownLayerTypeError, match=r"layer_types\[1\] = 'mamba'"):
        load_model(folder, device="cpu", progress=False)


def test_no_weights(folder):
    (folder / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_model(folder, device="cpu", progress=False)


def test_index_names_absent_shard(tmp_path):
    folder = save_checkpoint(build_hf_model("dense_gqa"), tmp_path / "sharded", max_shard_size="40KB")
    victim = sorted(folder.glob("model-*.safetensors"))[0]
    victim.unlink()
    with pytest.raises(CheckpointError, match=victim.name):
        load_model(folder, device="cpu", progress=False)


def test_missing_config(tmp_path):
    with pytest.raises(CheckpointError, match="config.json"):
        load_model(tmp_path, device="cpu", progress=False)
