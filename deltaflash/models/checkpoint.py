"""The one reader of safetensors checkpoints, for the target and the drafter alike.

A loader opens a `Checkpoint` (lists the files, reads every header: names, shapes, dtypes, no data),
checks names and shapes against the model it builds, and only then calls `read`. Every failure to
list, open, parse or read a file is a CheckpointError naming the file (and tensor).

safetensors 0.8 validates a file when it opens it: a truncated file or a corrupt header raises
SafetensorError there ("incomplete metadata, file not fully covered", "invalid JSON in header", ...),
never later from get_tensor (tensor data is memory-mapped: a file cut short *while* open kills the
process with SIGBUS, which no reader can catch). A directory or a broken link raises OSError.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from tqdm.auto import tqdm

from deltaflash.errors import CheckpointError

INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's header entry: the file that holds it, its shape and safetensors dtype ('BF16', ...)."""

    file: Path
    shape: tuple[int, ...]
    dtype: str


def shard_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint: those the index names when there is one, else *.safetensors."""
    index = folder / INDEX
    if index.exists() or index.is_symlink():
        return _indexed_files(index)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no *.safetensors file (and no {INDEX})")
    return files


def _indexed_files(index: Path) -> list[Path]:
    """The shards `index`'s weight_map names, each checked to be present in the folder."""
    expected = "expected a JSON object whose 'weight_map' maps tensor names to shard file names"
    try:
        raw = json.loads(index.read_text())
    except OSError as exc:
        raise CheckpointError(f"{index}: cannot be read ({exc.strerror or exc})") from exc
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise CheckpointError(f"{index}: not valid JSON ({exc}); {expected}") from exc
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict) or not weight_map or not all(isinstance(v, str) for v in weight_map.values()):
        found = "no 'weight_map'" if weight_map is None else f"'weight_map' is {_short(json.dumps(weight_map))}"
        raise CheckpointError(f"{index}: {found}; {expected}")
    files = sorted({index.parent / name for name in weight_map.values()})
    for file in files:
        if not (file.exists() or file.is_symlink()):
            raise CheckpointError(f"{index}: names shard '{file.name}', which is not in {index.parent}")
    return files


def read_header(file: Path) -> dict[str, TensorInfo]:
    """Every tensor's name, shape and dtype from `file`'s header; no tensor data is read."""
    if file.is_dir():
        raise CheckpointError(f"{file}: is a directory, expected a safetensors file")
    if file.is_symlink() and not file.exists():
        raise CheckpointError(f"{file}: is a broken symbolic link (to {os.readlink(file)})")
    try:
        with safe_open(file, framework="pt", device="cpu") as handle:
            slices = {name: handle.get_slice(name) for name in handle.keys()}
            return {name: TensorInfo(file, tuple(s.get_shape()), s.get_dtype()) for name, s in slices.items()}
    except (SafetensorError, OSError) as exc:
        raise _unreadable(file, exc) from exc


def _unreadable(file: Path, exc: Exception) -> CheckpointError:
    if isinstance(exc, SafetensorError):
        return CheckpointError(f"{file}: not a readable safetensors file, truncated or corrupt ({_short(exc)})")
    return CheckpointError(f"{file}: cannot be opened ({_short(exc.strerror or exc)})")


def _short(thing) -> str:
    """One line of at most 120 characters (the CLI prints an error as one line)."""
    text = " ".join(str(thing).split())
    return text if len(text) <= 120 else text[:117] + "..."


class Checkpoint:
    """A checkpoint folder's files and tensor headers; only `read` touches tensor data."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.files = shard_files(self.folder)
        self.tensors: dict[str, TensorInfo] = {}  # stored name -> header entry, in file then header order
        for file in self.files:
            for name, info in read_header(file).items():
                if name in self.tensors:
                    raise CheckpointError(
                        f"{file}: tensor '{name}' is also in {self.tensors[name].file}; expected it in one file")
                self.tensors[name] = info

    def read(self, names: Iterable[str], dtype: torch.dtype, device, *, desc: str,
             progress: bool | None = True, select: Callable[[str], tuple[int, torch.Tensor] | None] | None = None,
             ) -> dict[str, torch.Tensor]:
        """{stored name: tensor as `dtype` on `device`} for `names`, one file open at a time.

        progress None: a bar only when stderr is a terminal. select(name): (dim, sorted indices) to read
        only those rows of the tensor along dim (a tensor-parallel rank's share: the rest is never read),
        or None for all of it."""
        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self.tensors[name].file, []).append(name)
        tensors: dict[str, torch.Tensor] = {}
        disable = None if progress is None else not progress
        for file in tqdm(sorted(by_file), desc=desc, unit="shard", disable=disable):
            try:  # safe_open validates the file again: one changed since its header was read fails here
                handle = safe_open(file, framework="pt", device="cpu")
            except (SafetensorError, OSError) as exc:
                raise _unreadable(file, exc) from exc
            with handle:
                for name in by_file[file]:
                    rows = select(name) if select is not None else None
                    tensors[name] = (_read_tensor(handle, file, name, dtype, device) if rows is None
                                     else _read_rows(handle, file, name, *rows, dtype, device))
        return tensors


def _read_rows(handle, file: Path, name: str, dim: int, index: torch.Tensor, dtype: torch.dtype, device) -> torch.Tensor:
    """The rows `index` (sorted) of a tensor along `dim`, read as runs of consecutive rows (the rest of the
    tensor stays on disk)."""
    index = index.tolist()
    runs, start = [], 0
    for i in range(1, len(index) + 1):
        if i == len(index) or index[i] != index[i - 1] + 1:
            runs.append((index[start], index[i - 1] + 1))
            start = i
    try:
        stored = handle.get_slice(name)
        lead = (slice(None),) * dim
        parts = [stored[lead + (slice(a, b),)] for a, b in runs]
        return torch.cat(parts, dim=dim).to(device=device, dtype=dtype)
    except torch.OutOfMemoryError:
        raise
    except Exception as exc:
        raise CheckpointError(f"{file}: tensor '{name}' cannot be read as {dtype} ({type(exc).__name__}: "
                              f"{_short(exc)})") from exc


def _read_tensor(handle, file: Path, name: str, dtype: torch.dtype, device) -> torch.Tensor:
    """One tensor as dtype on device; a stored dtype torch cannot convert (F4, ...) fails here."""
    try:
        return handle.get_tensor(name).to(device=device, dtype=dtype)
    except torch.OutOfMemoryError:
        raise  # the device is too small: not a checkpoint fault
    except Exception as exc:
        raise CheckpointError(f"{file}: tensor '{name}' cannot be read as {dtype} ({type(exc).__name__}: "
                              f"{_short(exc)})") from exc
