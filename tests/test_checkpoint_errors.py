"""Each kind of bad checkpoint fails fast with its typed error, naming the file / tensor / field."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from deltaflash.errors import (CheckpointError, MissingTensorError, TensorShapeError, UnknownLayerTypeError,
                               UnsupportedModelError)
from deltaflash.models.checkpoint import INDEX, Checkpoint
from deltaflash.models.dflash import load_drafter
from deltaflash.models.loader import load_model
from tests.checkpoints import build_hf_model, save_checkpoint
from tests.spec_pairs import save_drafter

REPO = Path(__file__).resolve().parents[1]


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


# ---------------------------------------------------------------- damaged files, target and drafter alike


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A target folder, its drafter folder and the target's config; tests damage copies of them."""
    root = tmp_path_factory.mktemp("pristine")
    target = save_checkpoint(build_hf_model("dense_gqa"), root / "target")
    cfg = load_model(target, device="cpu", progress=False).cfg
    return target, save_drafter(root / "draft", cfg), cfg


@pytest.fixture()
def pair(pristine, tmp_path):
    target, draft, _ = pristine
    return shutil.copytree(target, tmp_path / "target"), shutil.copytree(draft, tmp_path / "draft")


def _load_drafter(draft, cfg):
    return load_drafter(draft, target_hidden_size=cfg.hidden_size, target_vocab_size=cfg.vocab_size,
                        target_num_layers=cfg.num_layers, dtype=torch.float32, device="cpu")


def _shard(folder):
    """Split model.safetensors into two shards named by an index, as large checkpoints are saved."""
    whole = folder / "model.safetensors"
    tensors = load_file(whole)
    whole.unlink()
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2:]), 1):
        shard = f"model-0000{i}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, folder / shard, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, shard))
    (folder / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder / INDEX


# Each damage returns the file the error must name.
def truncated(folder):  # cut inside the tensor data, as an interrupted download leaves it
    path = folder / "model.safetensors"
    os.truncate(path, path.stat().st_size - 100)
    return path


def garbage_header(folder):
    path = folder / "model.safetensors"
    with path.open("r+b") as f:
        f.seek(8)  # past the header length: the JSON header itself
        f.write(b"garbage!")
    return path


def directory_shard(folder):
    path = folder / "model.safetensors"
    path.unlink()
    path.mkdir()
    return path


def broken_link(folder):
    path = folder / "model.safetensors"
    path.unlink()
    path.symlink_to(folder / "moved-away.safetensors")
    return path


def corrupt_index(folder):
    index = _shard(folder)
    index.write_text('{"weight_map": {"fc.weight": ')
    return index


def index_without_weight_map(folder):
    index = _shard(folder)
    index.write_text(json.dumps({"weight_map": ["model-00001-of-00002.safetensors"]}))
    return index


def index_names_absent_shard(folder):
    index = _shard(folder)
    (folder / "model-00002-of-00002.safetensors").unlink()
    return index


def duplicate_across_shards(folder):
    _shard(folder)
    first, second = folder / "model-00001-of-00002.safetensors", folder / "model-00002-of-00002.safetensors"
    tensors = load_file(second) | dict([next(iter(load_file(first).items()))])
    save_file(tensors, second, metadata={"format": "pt"})
    return second


DAMAGES = [truncated, garbage_header, directory_shard, broken_link, corrupt_index, index_without_weight_map,
           index_names_absent_shard, duplicate_across_shards]


@pytest.mark.parametrize("damage", DAMAGES, ids=lambda d: d.__name__)
@pytest.mark.parametrize("which", ["target", "draft"])
def test_damaged_file_is_a_checkpoint_error_naming_it(pristine, pair, which, damage):
    target, draft = pair
    named = damage(target if which == "target" else draft)
    with pytest.raises(CheckpointError, match=re.escape(str(named))) as caught:
        load_model(target, device="cpu", progress=False)
        _load_drafter(draft, pristine[2])
    assert type(caught.value) is CheckpointError and "\n" not in str(caught.value)


@pytest.mark.parametrize("damage", [truncated, corrupt_index], ids=lambda d: d.__name__)
@pytest.mark.parametrize("which", ["target", "draft"])
def test_cli_reports_a_damaged_file_in_one_line_with_exit_2(pair, which, damage):
    target, draft = pair
    named = damage(target if which == "target" else draft)
    proc = subprocess.run([sys.executable, "-m", "deltaflash", "generate", "--model", str(target), "--draft", str(draft),
                           "--prompt-ids", "1,2,3", "--device", "cpu", "--max-new-tokens", "2", "--json"],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("deltaflash: error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert str(named) in proc.stderr


@pytest.mark.parametrize("which", ["target", "draft"])
def test_shape_mismatch_is_reported_before_any_tensor_data_is_read(pristine, pair, which, monkeypatch):
    target, draft = pair
    folder, stored, wrong = ((target, "model.layers.3.self_attn.k_proj.weight", torch.zeros(16, 64)) if which == "target"
                             else (draft, "fc.weight", torch.zeros(3, 5)))
    reads = []  # folders whose tensor data was read, in order
    read = Checkpoint.read
    monkeypatch.setattr(Checkpoint, "read", lambda self, *a, **kw: reads.append(self.folder) or read(self, *a, **kw))
    load_model(target, device="cpu", progress=False)
    _load_drafter(draft, pristine[2])
    assert reads == [target, draft]  # both loaders read their tensor data through the helper
    _edit_tensors(folder, lambda t: t.update({stored: wrong}))
    with pytest.raises(TensorShapeError, match=rf"model\.safetensors: tensor '{re.escape(stored)}' has shape"):
        load_model(target, device="cpu", progress=False) if which == "target" else _load_drafter(draft, pristine[2])
    assert reads == [target, draft]


def test_file_changed_after_its_header_was_read(folder):
    checkpoint = Checkpoint(folder)
    path = truncated(folder)
    with pytest.raises(CheckpointError, match=re.escape(str(path))):
        checkpoint.read(checkpoint.tensors, torch.float32, "cpu", desc="reading", progress=False)


def test_tensor_torch_cannot_convert_names_file_and_tensor(folder):
    # stored as F4 with the [64] shape config.json implies; torch has no F4 -> float32 copy
    _edit_tensors(folder, lambda t: t.update({"model.norm.weight": torch.zeros(32, dtype=torch.float4_e2m1fn_x2)}))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'model\.norm\.weight' cannot be read as"):
        load_model(folder, device="cpu", progress=False)
