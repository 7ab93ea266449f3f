"""Figures of an exported pair on held-out stdlib files: target loss and teacher-forced acceptance."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from deltaflash.train.corpus import encode_corpus, heldout_windows, load_split
from deltaflash.train.draft import load_drafter, teacher_forced_acceptance
from deltaflash.train.target import heldout_loss, load_target
from deltaflash.train.tokenizer import load_tokenizer, special_ids


@dataclass(frozen=True)
class Evaluation:
    """heldout_loss in nats/token; acceptance[k-1]: share of blocks accepted through draft slot k
    (their sum is the mean accepted draft length; a greedy round commits one bonus token more)."""

    heldout_tokens: int
    heldout_loss: float
    acceptance: tuple[float, ...] | None


def format_acceptance(acceptance: tuple[float, ...]) -> str:
    per_slot = " ".join(f"{a:.3f}" for a in acceptance)
    accepted = sum(acceptance)
    return (f"acceptance by slot 1..{len(acceptance)}: {per_slot} | "
            f"mean accepted {accepted:.2f}, tokens/round {accepted + 1:.2f}")


def evaluate_folders(target_dir: Path, draft_dir: Path | None, device: torch.device, seq_len: int = 512,
                     eval_tokens: int | None = None, max_files: int | None = None) -> Evaluation:
    """Loads the exported folders (bf16 weights, fp32 compute; bf16 autocast on CUDA) and measures them."""
    tokenizer = load_tokenizer(target_dir)
    tokens = encode_corpus(tokenizer, load_split(max_files=max_files).heldout, special_ids(tokenizer).endoftext)
    windows = heldout_windows(tokens, seq_len, eval_tokens)
    target = load_target(target_dir, device)
    acceptance = None
    if draft_dir is not None:
        acceptance = teacher_forced_acceptance(load_drafter(draft_dir, device), target, windows, device)
    return Evaluation(heldout_tokens=windows.numel(), heldout_loss=heldout_loss(target, windows, device),
                      acceptance=acceptance)
