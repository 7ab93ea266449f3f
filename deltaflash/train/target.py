"""The demo target: a small Qwen3.5 hybrid (GDN + gated attention) trained as a causal LM.

Built with transformers' `Qwen3_5ForCausalLM`, which runs the GDN layers on fla's kernels when
`fla` imports and on its torch reference otherwise (always on CPU here).
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

from deltaflash.train.corpus import heldout_windows, packed_batches
from deltaflash.train.loop import LoopOptions, LoopResult, Metric, autocast, run_loop, seed_everything
from deltaflash.train.shapes import TargetShape
from deltaflash.train.tokenizer import TOKENIZER_FILES, SpecialIds


def target_config(shape: TargetShape, vocab_size: int, ids: SpecialIds) -> Qwen3_5TextConfig:
    return Qwen3_5TextConfig(
        vocab_size=vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        layer_types=["full_attention" if (i + 1) % shape.full_attention_interval == 0 else "linear_attention"
                     for i in range(shape.num_layers)],
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,
        linear_num_key_heads=shape.linear_num_key_heads,
        linear_num_value_heads=shape.linear_num_value_heads,
        linear_key_head_dim=shape.linear_head_dim,
        linear_value_head_dim=shape.linear_head_dim,
        max_position_embeddings=shape.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=[ids.endoftext, ids.im_end],
        pad_token_id=ids.endoftext,
    )


def build_target(shape: TargetShape, vocab_size: int, ids: SpecialIds, seed: int) -> Qwen3_5ForCausalLM:
    seed_everything(seed)
    return Qwen3_5ForCausalLM(target_config(shape, vocab_size, ids))


def lm_loss(model: Qwen3_5ForCausalLM, tokens: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over [N, T] `tokens` (T-1 predictions per row), fp32."""
    logits = model(input_ids=tokens, use_cache=False).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())


@torch.no_grad()
def heldout_loss(model: Qwen3_5ForCausalLM, windows: torch.Tensor, device: torch.device, batch_size: int = 32) -> float:
    """Mean next-token cross-entropy (nats) over [n, T] held-out `windows`."""
    was_training = model.training
    model.eval()
    total = 0.0
    for chunk in windows.split(batch_size):
        with autocast(device):
            total += lm_loss(model, chunk.to(device)).item() * chunk.shape[0]
    model.train(was_training)
    return total / windows.shape[0]


def train_target(model: Qwen3_5ForCausalLM, train_tokens: torch.Tensor, heldout_tokens: torch.Tensor, *,
                 options: LoopOptions, seq_len: int, batch_size: int, seed: int, device: torch.device,
                 eval_tokens: int) -> LoopResult:
    """Causal-LM training on packed windows of `train_tokens`; leaves the model on `device` at its best
    held-out loss (`LoopResult.best_value`)."""
    model.to(device).train()
    batches = packed_batches(train_tokens, seq_len, batch_size, seed)
    windows = heldout_windows(heldout_tokens, seq_len, eval_tokens)

    def step_loss(step: int) -> torch.Tensor:
        with autocast(device):
            return lm_loss(model, next(batches).to(device, non_blocking=True))

    metric = Metric("held-out loss", lambda: heldout_loss(model, windows, device), maximize=False)
    return run_loop(model, step_loss, options, device, metric, desc="target")


def export_target(model: Qwen3_5ForCausalLM, tokenizer_dir: Path, out_dir: Path) -> None:
    """bf16 safetensors + config.json + generation_config.json + the tokenizer files."""
    out_dir = Path(out_dir)
    copy.deepcopy(model).to(device="cpu", dtype=torch.bfloat16).save_pretrained(out_dir)
    for name in TOKENIZER_FILES:
        shutil.copyfile(Path(tokenizer_dir) / name, out_dir / name)


def load_target(folder: Path, device: torch.device) -> Qwen3_5ForCausalLM:
    """An exported target in fp32 (autocast gives bf16 compute on CUDA), frozen, in eval mode."""
    model = Qwen3_5ForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True).to(device)
    return model.eval().requires_grad_(False)
