"""DFlash drafter: module, block-parallel training, teacher-forced acceptance, export in z-lab's format.

The drafter is a stack of Qwen3 decoder layers without embedding or head of its own: a block
`[anchor, MASK x (B-1)]` is embedded with the frozen target's embedding, every layer attends to the
block (bidirectionally) and to context rows made from target hidden states, and slot k is read
out through the target's lm_head as the token at anchor + k.

Context rows: `hidden_norm(fc(concat_i h_i))` where h_i is the output of target decoder layer i for
i in `target_layer_ids` (HF `hidden_states[i + 1]`). Each layer projects them with its own k_proj /
v_proj (k_norm and RoPE at the rows' own positions, no norm on V); the block rows go through the
layer's input_layernorm first.

Training runs M blocks per sequence in one forward: the queries are the M*B block rows, the keys
are the T context rows followed by the M*B block rows, and a boolean mask lets block m see context
rows j < anchor_m and the rows of block m only. The parameter names equal those of
`dflash.model.DFlashDraftModel`, so the exported folder loads there.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from deltaflash.models.checkpoint import Checkpoint
from deltaflash.models.dflash import RMSNorm  # Qwen3's plain `w * x / rms(x)`, normalised in fp32
from deltaflash.train.corpus import heldout_windows, packed_batches
from deltaflash.train.loop import LoopOptions, LoopResult, Metric, autocast, run_loop
from deltaflash.train.shapes import DrafterShape


def default_gamma(block_size: int) -> float:
    """Decay of the slot loss weights exp(-(k-1)/gamma): 7 for blocks of 16 (DFlash), scaled with B otherwise."""
    return 7.0 * block_size / 16


# ----------------------------------------------------------------------------------------------
# Module
# ----------------------------------------------------------------------------------------------

def rope_tables(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [N, 1, L, head_dim] fp32 for integer `positions` [N, L] (full-width RoPE)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim
    inv_freq = 1.0 / theta ** exponents
    angles = positions.float()[..., None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)[:, None]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return x * cos.to(x.dtype) + torch.cat([-second, first], dim=-1) * sin.to(x.dtype)


class DraftAttention(nn.Module):
    def __init__(self, shape: DrafterShape):
        super().__init__()
        h, d = shape.hidden_size, shape.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = shape.num_attention_heads, shape.num_key_value_heads, d
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, shape.rms_norm_eps)
        self.k_norm = RMSNorm(d, shape.rms_norm_eps)

    def forward(self, block: torch.Tensor, context: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                mask: torch.Tensor | None) -> torch.Tensor:
        """block [N, Q, H] (normed), context [N, C, H]; rope over the C + Q key positions; mask [N, 1, Q, C+Q]."""
        n, q_len, _ = block.shape
        keys_in = torch.cat([context, block], dim=1)
        q = self.q_norm(self.q_proj(block).view(n, q_len, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(keys_in).view(n, -1, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(keys_in).view(n, -1, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = rope
        q = apply_rope(q, cos[:, :, -q_len:], sin[:, :, -q_len:])
        k = apply_rope(k, cos, sin)
        groups = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        dtype = v.dtype  # the norms return fp32 under autocast, v_proj bf16
        out = F.scaled_dot_product_attention(q.to(dtype), k.to(dtype), v, attn_mask=mask, scale=self.head_dim ** -0.5)
        return self.o_proj(out.transpose(1, 2).reshape(n, q_len, -1))


class DraftMLP(nn.Module):
    def __init__(self, shape: DrafterShape):
        super().__init__()
        self.gate_proj = nn.Linear(shape.hidden_size, shape.intermediate_size, bias=False)
        self.up_proj = nn.Linear(shape.hidden_size, shape.intermediate_size, bias=False)
        self.down_proj = nn.Linear(shape.intermediate_size, shape.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self, shape: DrafterShape):
        super().__init__()
        self.self_attn = DraftAttention(shape)
        self.mlp = DraftMLP(shape)
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)

    def forward(self, h, context, rope, mask):
        h = h + self.self_attn(self.input_layernorm(h), context, rope, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class Drafter(nn.Module):
    def __init__(self, shape: DrafterShape):
        super().__init__()
        self.shape = shape
        self.layers = nn.ModuleList(DraftLayer(shape) for _ in range(shape.num_layers))
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.fc = nn.Linear(len(shape.target_layer_ids) * shape.hidden_size, shape.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        for module in self.modules():  # HF's Qwen3 initialisation
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, block_embeds: torch.Tensor, target_features: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """Final-normed hidden [N, Q, H] of the block rows.

        block_embeds [N, Q, H]: target embeddings of the block tokens; target_features [N, C, n*H]:
        concatenated target hidden states of the context rows; positions [N, C+Q]: context positions
        then block positions; mask [N, 1, Q, C+Q] bool (None: every row sees everything).
        """
        context = self.hidden_norm(self.fc(target_features))
        rope = rope_tables(positions, self.shape.head_dim, self.shape.rope_theta)
        h = block_embeds
        for layer in self.layers:
            h = layer(h, context, rope, mask)
        return self.norm(h)


# ----------------------------------------------------------------------------------------------
# Blocks: many per sequence in one forward
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Blocks:
    """M blocks of size B over N sequences of T tokens.

    anchors [N, M] (1 <= a <= T-B); block_ids [N, M*B] (anchor token, then mask ids);
    positions [N, T + M*B]; mask [N, 1, M*B, T + M*B] bool.
    """

    anchors: torch.Tensor
    block_ids: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor


def sample_anchors(num_seqs: int, seq_len: int, num_blocks: int, block_size: int,
                   generator: torch.Generator) -> torch.Tensor:
    """[N, M] distinct sorted anchors per row, uniform over [1, T-B] (so every slot has a label)."""
    choices = seq_len - block_size
    if num_blocks > choices:
        raise ValueError(f"{num_blocks} blocks of {block_size} do not fit distinct anchors in sequences of {seq_len}")
    scores = torch.rand(num_seqs, choices, generator=generator)
    return scores.argsort(dim=1)[:, :num_blocks].sort(dim=1).values + 1


def make_blocks(tokens: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int) -> Blocks:
    n, seq_len = tokens.shape
    num_blocks = anchors.shape[1]
    device = tokens.device
    slots = torch.arange(block_size, device=device)
    block_ids = torch.full((n, num_blocks, block_size), mask_token_id, dtype=tokens.dtype, device=device)
    block_ids[:, :, 0] = tokens.gather(1, anchors)
    block_positions = (anchors[:, :, None] + slots).flatten(1)
    positions = torch.cat([torch.arange(seq_len, device=device).expand(n, -1), block_positions], dim=1)
    sees_context = torch.arange(seq_len, device=device) < anchors[:, :, None]  # [N, M, T]
    sees_context = sees_context[:, :, None].expand(-1, -1, block_size, -1).reshape(n, num_blocks * block_size, seq_len)
    block_of_row = torch.arange(num_blocks, device=device).repeat_interleave(block_size)
    sees_block = (block_of_row[:, None] == block_of_row[None, :]).expand(n, -1, -1)
    mask = torch.cat([sees_context, sees_block], dim=2)[:, None]
    return Blocks(anchors=anchors, block_ids=block_ids.flatten(1), positions=positions, mask=mask)


def target_features(target, tokens: torch.Tensor, layer_ids: tuple[int, ...],
                    with_logits: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenated outputs of target layers `layer_ids` [N, T, n*H], and the logits [N, T, V] if asked."""
    out = target(input_ids=tokens, use_cache=False, output_hidden_states=True, logits_to_keep=0 if with_logits else 1)
    features = torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)
    return features, out.logits if with_logits else None


def block_logits(drafter: Drafter, target, blocks: Blocks, features: torch.Tensor) -> torch.Tensor:
    """Draft logits [N, M, B-1, V] of slots 1..B-1 (slot 0 holds the known anchor)."""
    n, num_blocks = blocks.anchors.shape
    embeds = target.get_input_embeddings()(blocks.block_ids)
    hidden = drafter(embeds, features, blocks.positions, blocks.mask)
    hidden = hidden.view(n, num_blocks, drafter.shape.block_size, -1)[:, :, 1:]
    return target.get_output_embeddings()(hidden)


def slot_labels(tokens: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """[N, M, B-1]: token at anchor + k for slot k = 1..B-1."""
    offsets = torch.arange(1, block_size, device=tokens.device)
    return tokens.gather(1, (anchors[:, :, None] + offsets).flatten(1)).view(*anchors.shape, block_size - 1)


def slot_weights(block_size: int, gamma: float, device: torch.device) -> torch.Tensor:
    """[B-1] loss weights exp(-(k-1)/gamma) of slots k = 1..B-1, normalised to sum 1."""
    weights = torch.exp(-torch.arange(block_size - 1, device=device, dtype=torch.float32) / gamma)
    return weights / weights.sum()


def block_loss(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Slot-weighted cross-entropy of logits [N, M, B-1, V] against labels [N, M, B-1]."""
    ce = F.cross_entropy(logits.flatten(0, 2).float(), labels.flatten(), reduction="none").view(labels.shape)
    return (ce.mean(dim=(0, 1)) * weights).sum()


# ----------------------------------------------------------------------------------------------
# Training and teacher-forced acceptance
# ----------------------------------------------------------------------------------------------

def train_drafter(drafter: Drafter, target, train_tokens: torch.Tensor, heldout_tokens: torch.Tensor, *,
                  options: LoopOptions, seq_len: int, batch_size: int, blocks_per_seq: int, gamma: float,
                  label_source: str, seed: int, device: torch.device, eval_tokens: int) -> LoopResult:
    """Trains `drafter` against the frozen `target` (both on `device`); leaves it at its best held-out
    mean accepted length (`LoopResult.best_value`, see `teacher_forced_acceptance`).

    label_source "data": slot k learns the corpus token at anchor + k (the DFlash recipe);
    "target": it learns the target's greedy token there given the true prefix.
    """
    if label_source not in ("data", "target"):
        raise ValueError(f"label_source {label_source!r}: expected 'data' or 'target'")
    shape = drafter.shape
    drafter.to(device).train()
    target.to(device).eval().requires_grad_(False)
    batches = packed_batches(train_tokens, seq_len, batch_size, seed)
    anchor_rng = torch.Generator().manual_seed(seed + 1)
    weights = slot_weights(shape.block_size, gamma, device)
    windows = heldout_windows(heldout_tokens, seq_len, eval_tokens)

    def step_loss(step: int) -> torch.Tensor:
        tokens = next(batches).to(device, non_blocking=True)
        anchors = sample_anchors(tokens.shape[0], seq_len, blocks_per_seq, shape.block_size, anchor_rng).to(device)
        with torch.no_grad(), autocast(device):
            features, logits = target_features(target, tokens, shape.target_layer_ids, label_source == "target")
        if logits is None:
            labels = slot_labels(tokens, anchors, shape.block_size)
        else:  # the target's greedy token at anchor + k is its argmax at anchor + k - 1
            labels = slot_labels(logits.argmax(-1), anchors - 1, shape.block_size)
        with autocast(device):
            draft = block_logits(drafter, target, make_blocks(tokens, anchors, shape.block_size, shape.mask_token_id),
                                 features)
        return block_loss(draft, labels, weights)

    metric = Metric("held-out mean accepted", lambda: sum(teacher_forced_acceptance(drafter, target, windows, device)),
                    maximize=True)
    return run_loop(drafter, step_loss, options, device, metric, desc="draft")


@torch.no_grad()
def teacher_forced_acceptance(drafter: Drafter, target, windows: torch.Tensor, device: torch.device,
                              batch_size: int = 16) -> tuple[float, ...]:
    """Fraction of blocks whose greedy draft is accepted through slot k, for k = 1..B-1.

    Blocks are anchored every B positions of each held-out window; slot k counts when the draft
    argmax equals the target argmax after the true prefix (anchor + k - 1) at slots 1..k. Their sum
    is the mean number of accepted draft tokens per block (the round also gains one bonus token).
    """
    shape = drafter.shape
    was_training = drafter.training
    drafter.eval()
    seq_len = windows.shape[1]
    anchors = torch.arange(1, seq_len - shape.block_size + 1, shape.block_size, device=device)
    accepted = torch.zeros(shape.block_size - 1, device=device)
    for chunk in windows.split(batch_size):
        tokens = chunk.to(device)
        chunk_anchors = anchors.expand(tokens.shape[0], -1)
        with autocast(device):
            features, logits = target_features(target, tokens, shape.target_layer_ids, with_logits=True)
            blocks = make_blocks(tokens, chunk_anchors, shape.block_size, shape.mask_token_id)
            draft = block_logits(drafter, target, blocks, features).argmax(-1)
        greedy = slot_labels(logits.argmax(-1), chunk_anchors - 1, shape.block_size)
        accepted += (draft == greedy).int().cumprod(dim=-1).sum(dim=(0, 1)).float()
    drafter.train(was_training)
    return tuple((accepted / (windows.shape[0] * anchors.numel())).tolist())


# ----------------------------------------------------------------------------------------------
# Export in z-lab's DFlash format
# ----------------------------------------------------------------------------------------------

def export_drafter(drafter: Drafter, out_dir: Path) -> None:
    """config.json + model.safetensors (bf16), the layout of `DFlashDraftModel.save_pretrained`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    drafter.shape.hf_config().save_pretrained(out_dir)
    state = {name: t.detach().to("cpu", torch.bfloat16).contiguous() for name, t in drafter.state_dict().items()}
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})


def load_drafter(folder: Path, device: torch.device) -> Drafter:
    """An exported drafter in fp32, in eval mode; its weights read through models/checkpoint.py (a damaged
    file is a one-line CheckpointError naming it)."""
    folder = Path(folder)
    shape = DrafterShape.from_hf_config(json.loads((folder / "config.json").read_text()))
    drafter = Drafter(shape)
    checkpoint = Checkpoint(folder)
    drafter.load_state_dict(checkpoint.read(checkpoint.tensors, torch.float32, "cpu", desc="drafter", progress=False))
    return drafter.to(device).eval()
