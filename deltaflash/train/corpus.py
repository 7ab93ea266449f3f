"""The running interpreter's standard library as a training corpus.

Files: every `.py` under `sysconfig.get_paths()["stdlib"]` that decodes as UTF-8 and parses,
minus third-party packages, bytecode caches, the codec tables of `encodings/` and the one-string
`pydoc_data/` (the test suite stays: it is ordinary Python and doubles the data).
Split: a file is held out when a SHA-256 of its relative path falls in the first `heldout_fraction`
of the hash range, so the split does not depend on which other files exist.
Order: sorted relative paths; every later stage (tokenizer, packing) is deterministic from here.
"""

from __future__ import annotations

import ast
import hashlib
import sysconfig
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

HELDOUT_FRACTION = 0.05
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "encodings", "pydoc_data"})


@dataclass(frozen=True)
class Corpus:
    """Source files of one split: `paths[i]` (relative, POSIX) holds `texts[i]`; paths sorted."""

    paths: tuple[str, ...]
    texts: tuple[str, ...]

    @property
    def num_bytes(self) -> int:
        return sum(len(t.encode()) for t in self.texts)


@dataclass(frozen=True)
class CorpusSplit:
    train: Corpus
    heldout: Corpus


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(rel_path: str, fraction: float = HELDOUT_FRACTION) -> bool:
    """Stable across machines and runs: depends on the relative path only."""
    digest = hashlib.sha256(rel_path.encode()).digest()
    return int.from_bytes(digest[:8], "big") < fraction * 2**64


def _candidate_paths(root: Path) -> list[str]:
    paths = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if not EXCLUDED_DIRS.intersection(rel.parts[:-1]):
            paths.append(rel.as_posix())
    return sorted(paths)


def _read_source(path: Path) -> str | None:
    """The file's text, or None when it is not UTF-8 or not valid Python (deliberately broken test inputs)."""
    try:
        text = path.read_bytes().decode("utf-8")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # invalid escape sequences and the like
            ast.parse(text)
    except (UnicodeDecodeError, SyntaxError, ValueError):
        return None
    return text


def load_split(root: Path | None = None, max_files: int | None = None,
               heldout_fraction: float = HELDOUT_FRACTION) -> CorpusSplit:
    """The corpus split into train and held-out files.

    `max_files` keeps an evenly strided subset of the sorted candidates (for tests); the held-out
    share of the subset stays about `heldout_fraction`.
    """
    root = stdlib_root() if root is None else Path(root)
    candidates = _candidate_paths(root)
    if max_files is not None and len(candidates) > max_files:
        stride = len(candidates) / max_files
        candidates = [candidates[int(i * stride)] for i in range(max_files)]
    parts: dict[bool, tuple[list[str], list[str]]] = {False: ([], []), True: ([], [])}
    for rel in candidates:
        text = _read_source(root / rel)
        if text is not None and text.strip():
            paths, texts = parts[is_heldout(rel, heldout_fraction)]
            paths.append(rel)
            texts.append(text)
    train, heldout = (Corpus(tuple(p), tuple(t)) for p, t in (parts[False], parts[True]))
    if not train.paths or not heldout.paths:
        raise ValueError(f"{root}: corpus split has {len(train.paths)} train and {len(heldout.paths)} held-out files; "
                         "both must be non-empty (raise max_files)")
    return CorpusSplit(train=train, heldout=heldout)


def heldout_prompts(split: CorpusSplit, count: int, num_lines: int = 12) -> list[str]:
    """The first `num_lines` lines of the first `count` held-out files that are longer than that."""
    prompts = []
    for text in split.heldout.texts:
        lines = text.splitlines(keepends=True)
        if len(lines) > 2 * num_lines:
            prompts.append("".join(lines[:num_lines]))
        if len(prompts) == count:
            break
    return prompts


def encode_corpus(tokenizer, corpus: Corpus, eos_id: int) -> torch.Tensor:
    """One token stream [N] int64: each file's tokens followed by `eos_id`, files in corpus order.

    `tokenizer` is a `tokenizers.Tokenizer` (its batch encoder runs on all cores).
    """
    encodings = tokenizer.encode_batch(list(corpus.texts), add_special_tokens=False)
    eos = np.array([eos_id], dtype=np.int64)
    pieces = [part for enc in encodings for part in (np.asarray(enc.ids, dtype=np.int64), eos)]
    return torch.from_numpy(np.concatenate(pieces))


def token_streams(tokenizer, eos_id: int, max_files: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The train and held-out token streams of the corpus (see `load_split`, `encode_corpus`)."""
    split = load_split(max_files=max_files)
    return encode_corpus(tokenizer, split.train, eos_id), encode_corpus(tokenizer, split.heldout, eos_id)


def packed_batches(tokens: torch.Tensor, seq_len: int, batch_size: int, seed: int) -> Iterator[torch.Tensor]:
    """Endless [batch_size, seq_len] int64 batches of contiguous windows of `tokens`.

    Each epoch starts the window grid at a random offset in [0, seq_len) and visits the windows
    in a random order; the whole sequence is a function of `seed`.
    """
    generator = torch.Generator().manual_seed(seed)
    while True:
        offset = int(torch.randint(seq_len, (), generator=generator))
        num_windows = (tokens.numel() - offset) // seq_len
        if num_windows < batch_size:
            raise ValueError(f"token stream of {tokens.numel()} tokens gives {num_windows} windows of {seq_len}; "
                             f"a batch needs {batch_size}")
        windows = tokens[offset:offset + num_windows * seq_len].view(num_windows, seq_len)
        order = torch.randperm(num_windows, generator=generator)
        for start in range(0, num_windows - batch_size + 1, batch_size):
            yield windows[order[start:start + batch_size]]


def heldout_windows(tokens: torch.Tensor, seq_len: int, max_tokens: int | None = None) -> torch.Tensor:
    """The held-out stream cut into consecutive [n, seq_len] windows (at most `max_tokens` tokens)."""
    num_windows = tokens.numel() // seq_len
    if max_tokens is not None:
        num_windows = min(num_windows, max(1, max_tokens // seq_len))
    if num_windows == 0:
        raise ValueError(f"held-out stream of {tokens.numel()} tokens is shorter than one window of {seq_len}")
    return tokens[:num_windows * seq_len].view(num_windows, seq_len)
