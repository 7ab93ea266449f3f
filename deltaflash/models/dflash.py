"""DFlash / DFlash2 block-diffusion drafter in plain torch (reference path: CPU fp32, CUDA bf16).

Shapes: H hidden, T taps (target layers read), n / nk query / kv heads, hd head dim, L lanes,
B block size, C context rows, V vocabulary. The drafter owns no embedding and no lm_head.

- Context row of the token at position p (DraftContextCache computes it once, when p commits):
  c = hidden_norm(fc(cat_t target_hidden_t[p]))                      [T*H] -> [H]
  per layer: k = rope(k_norm(k_proj(c)), p), v = v_proj(c)            [nk, hd] each
- Block: h = target_embed([anchor, MASK x (B-1)]) * input_embedding_scale at positions
  anchor_pos + 0..B-1. Per layer: h += attn(norm1(h)); h += mlp(norm2(h)). Output norm(h).
  attn: queries from the block; keys / values = [context rows | block rows] (paged: the block's K/V
  are written beside the context for the call, cache/draft_context.py); q_norm / k_norm per
  head, RoPE on q and k. Full layers: every context row and the whole block (no causal mask).
  Windowed layers: query_pos - key_pos < W (and key_pos - query_pos < W when not causal);
  causal layers: key_pos <= query_pos. `DraftConfig.causal` / `sliding_windows` say which.
- DFlash2, around attention and around the MLP: a grouped dynamic causal conv over block slots,
  y[b] = sum_t (base[t] + dyn[b, t, group]) * x[b - t]  (x[b < 0] = 0: no context history),
  where dyn = kernel_projection(norm1(h)) (resp. norm2) holds the kernel before (index 0) and after
  (index 1) the wrapped sub-block.
- logits = (h @ lm_head^T) * output_multiplier; then cap * tanh(logits / cap) when capped.
RMSNorm is Qwen3's plain one: w * (x * rsqrt(mean(x^2) + eps)), normalised in fp32.
Parameter names are the checkpoint's own; the DFlash2 codebooks are bare parameters [V, rank].
"""

from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from deltaflash.cache.draft_context import DraftContext
from deltaflash.errors import (
    CheckpointError,
    DrafterMismatchError,
    MissingTensorError,
    TensorShapeError,
    UnsupportedModelError,
)
from deltaflash.models.checkpoint import Checkpoint
from deltaflash.models.vocab import Vocab
from deltaflash.models.dflash_config import DraftConfig, read_draft_config


class RMSNorm(nn.Module):
    """`op` (x, weight, eps): the kernel set's plain_rms_norm (DFlashDrafter.use_kernels); None: torch's ops."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.op: Callable | None = None

    def forward(self, x: Tensor) -> Tensor:
        if self.op is not None:
            return self.op(x, self.weight, self.eps)
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def rope_tables(positions: Tensor, config: DraftConfig, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos, sin [*positions.shape, hd] for RoPE over the full head dim (angles in fp32)."""
    hd = config.head_dim
    exponents = torch.arange(0, hd, 2, dtype=torch.float32, device=positions.device) / hd
    inv_freq = 1.0 / (config.rope_theta**exponents) / config.rope_linear_factor
    angles = positions.float()[..., None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [..., heads, hd] rotated by cos / sin [..., hd] (shared over heads)."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


class DraftAttention(nn.Module):
    def __init__(self, c: DraftConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=c.attention_bias)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.rope: Callable = apply_rope  # (x, cos, sin): DFlashDrafter.use_kernels

    def keys_values(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """x [..., H] -> k (normed, rotated), v: [..., nk, hd]."""
        k = self.k_norm(self.k_proj(x).unflatten(-1, (self.kv_heads, self.head_dim)))
        return self.rope(k, cos, sin), self.v_proj(x).unflatten(-1, (self.kv_heads, self.head_dim))

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, context: DraftContext, layer: int,
                window: int | None, causal: bool) -> Tensor:
        """x [L, B, H]; cos / sin [L, B, hd]; the block attends to its lanes' context and to itself."""
        q = self.q_norm(self.q_proj(x).unflatten(-1, (self.heads, self.head_dim)))
        q = self.rope(q, cos, sin)
        k, v = self.keys_values(x, cos, sin)
        out = context.attention(layer, q.contiguous(), k, v, window, causal)  # [L, B, n, hd]
        return self.o_proj(out.flatten(-2))


class DraftMLP(nn.Module):
    def __init__(self, c: DraftConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class GroupedDynamicConv(nn.Module):
    """DFlash2 conv: base_kernel [2, taps, H]; kernel_projection H -> 2 * taps * G (G = H / group)."""

    def __init__(self, hidden: int, taps: int, group_size: int) -> None:
        super().__init__()
        self.taps, self.groups = taps, hidden // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, taps, hidden))
        self.kernel_projection = nn.Linear(hidden, 2 * taps * self.groups, bias=False)

    def dynamic_kernels(self, x: Tensor) -> Tensor:
        """x [L, B, H] -> per-slot kernels [L, B, 2, taps, G] (index 0: before, 1: after)."""
        return self.kernel_projection(x).unflatten(-1, (2, self.taps, self.groups))

    def convolve(self, x: Tensor, dynamic: Tensor, which: int) -> Tensor:
        """Causal conv over block slots of x [L, B, H] with kernels dynamic [L, B, taps, G]."""
        lanes, block, hidden = x.shape
        grouped = x.view(lanes, block, self.groups, -1)  # [L, B, G, H/G]
        out = torch.zeros_like(grouped)
        for t in range(self.taps):
            shifted = F.pad(grouped, (0, 0, 0, 0, t, 0))[:, :block]  # x[b - t]
            base = self.base_kernel[which, t].view(self.groups, -1).to(x.dtype)
            out = torch.addcmul(out + base * shifted, dynamic[:, :, t, :, None], shifted)
        return out.view(lanes, block, hidden)


class DraftLayer(nn.Module):
    def __init__(self, c: DraftConfig) -> None:
        super().__init__()
        self.self_attn, self.mlp = DraftAttention(c), DraftMLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        dflash2 = c.variant == "dflash2"
        taps, group = c.conv_kernel_size, c.conv_group_size
        self.attention_conv = GroupedDynamicConv(c.hidden_size, taps, group) if dflash2 else None
        self.mlp_conv = GroupedDynamicConv(c.hidden_size, taps, group) if dflash2 else None

    def forward(self, h: Tensor, cos: Tensor, sin: Tensor, context: DraftContext, layer: int,
                window: int | None, causal: bool) -> Tensor:
        """h [L, B, H] -> [L, B, H]."""
        def attend(x: Tensor) -> Tensor:
            return self.self_attn(x, cos, sin, context, layer, window, causal)

        h = h + _conv_wrapped(self.attention_conv, self.input_layernorm(h), attend)
        return h + _conv_wrapped(self.mlp_conv, self.post_attention_layernorm(h), self.mlp)


def _conv_wrapped(conv: GroupedDynamicConv | None, x: Tensor, inner: Callable[[Tensor], Tensor]) -> Tensor:
    """inner(x), or for DFlash2 conv_after(inner(conv_before(x))) with kernels taken from x."""
    if conv is None:
        return inner(x)
    dynamic = conv.dynamic_kernels(x)
    return conv.convolve(inner(conv.convolve(x, dynamic[:, :, 0], 0)), dynamic[:, :, 1], 1)


class CandidateSelector(nn.Module):
    """DFlash2 pairwise scorer: codebooks [V, rank] (bare, as stored), hidden_projection H -> rank."""

    def __init__(self, c: DraftConfig, vocab_size: int) -> None:
        super().__init__()
        self.top_k = c.selector_top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, c.selector_rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, c.selector_rank))
        self.hidden_projection = nn.Linear(c.hidden_size, c.selector_rank, bias=False)


class DFlashDrafter(nn.Module):
    """The drafter's weights and math; `vocab_size` sizes the DFlash2 codebooks."""

    def __init__(self, config: DraftConfig, vocab_size: int) -> None:
        super().__init__()
        self.config = config
        self.fc = nn.Linear(config.num_taps * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.variant == "dflash2":
            self.candidate_selector = CandidateSelector(config, vocab_size)

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def use_kernels(self, norm: Callable | None, rope: Callable | None) -> None:
        """Every RMSNorm of the drafter runs `norm` (x, weight, eps; the kernel set's plain_rms_norm: one
        launch instead of about eight) and every RoPE `rope` (x, cos, sin; ops/rope's apply_rope with the
        whole head rotated: one launch instead of six, the same bits). None: torch's ops."""
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.op = norm
            elif isinstance(module, DraftAttention):
                module.rope = rope or apply_rope

    def project_context(self, tap_features: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """tap_features [N, T*H], positions [N] -> context k, v [N, num_layers, nk, hd]."""
        rows = self.hidden_norm(self.fc(tap_features.to(self.dtype)))
        cos, sin = rope_tables(positions, self.config, rows.dtype)
        pairs = [layer.self_attn.keys_values(rows, cos, sin) for layer in self.layers]
        return torch.stack([k for k, _ in pairs], 1), torch.stack([v for _, v in pairs], 1)

    def forward(self, block_embeds: Tensor, block_positions: Tensor, context: DraftContext) -> Tensor:
        """block_embeds [L, B, H], block_positions [L, B] -> normed block hidden states [L, B, H]."""
        cos, sin = rope_tables(block_positions, self.config, block_embeds.dtype)
        h = block_embeds
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, context, i, self.config.sliding_windows[i], self.config.causal[i])
        return self.norm(h)

    def logits(self, hidden: Tensor, vocab: Vocab, gather: bool = True) -> Tensor:
        """hidden [..., H] -> [..., V] through the target's lm_head (`vocab`, models/vocab.py), times the
        multiplier, then the optional softcap (gather False: this rank's vocabulary share of them)."""
        logits = vocab.project(hidden, gather=gather) * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap


def load_drafter(
    path: str | Path,
    *,
    target_hidden_size: int,
    target_vocab_size: int,
    target_num_layers: int,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
) -> DFlashDrafter:
    """Load a drafter folder (config.json + one or sharded safetensors) checked against its target."""
    folder = Path(path)
    config = read_draft_config(folder)
    _check_fits_target(config, folder / "config.json", target_hidden_size, target_vocab_size, target_num_layers)
    with torch.device("meta"):
        drafter = DFlashDrafter(config, vocab_size=target_vocab_size)
    expected = {name: tuple(p.shape) for name, p in drafter.named_parameters()}
    checkpoint = Checkpoint(folder)
    located = _locate_tensors(checkpoint, expected, config.variant)
    for name, shape in expected.items():
        if name not in located:
            raise MissingTensorError(f"{folder}: tensor '{name}' (shape {list(shape)}) is in no safetensors file")
    loaded = checkpoint.read(located.values(), dtype, device, desc=f"drafter {folder.name}", progress=None)
    state = {name: loaded.pop(stored) for name, stored in located.items()}
    drafter.load_state_dict(state, strict=True, assign=True)
    return drafter.eval().requires_grad_(False)


def _check_fits_target(config: DraftConfig, source: Path, hidden: int, vocab: int, num_layers: int) -> None:
    if config.hidden_size != hidden:
        raise DrafterMismatchError(
            f"{source}: hidden_size is {config.hidden_size}, expected the target's hidden size {hidden} "
            "(the drafter reads the target's embeddings and hidden states)"
        )
    if config.vocab_size is not None and config.vocab_size != vocab:
        raise DrafterMismatchError(f"{source}: vocab_size is {config.vocab_size}, expected the target's {vocab}")
    bad = [i for i in config.target_layer_ids if not 0 <= i < num_layers]
    if bad:
        raise DrafterMismatchError(
            f"{source}: target_layer_ids {list(config.target_layer_ids)} has {bad} outside the "
            f"target's layers 0..{num_layers - 1}"
        )
    if not 0 <= config.mask_token_id < vocab:
        raise DrafterMismatchError(
            f"{source}: mask_token_id {config.mask_token_id} is outside the target's vocabulary 0..{vocab - 1}"
        )


def _canonical_name(stored: str) -> str | None:
    """Checkpoint tensor name -> parameter name; None for tensors the drafter does not use."""
    name = stored.removeprefix("model.")
    if name.startswith(("embed_tokens.", "lm_head.", "rotary_emb.")):
        return None  # the target's embedding / lm_head are used; RoPE tables are recomputed
    if name.endswith("_codebook.weight"):
        name = name.removesuffix(".weight")  # codebooks may be stored with or without `.weight`
    return name


def _locate_tensors(
    checkpoint: Checkpoint, expected: dict[str, tuple[int, ...]], variant: str
) -> dict[str, str]:
    """parameter name -> stored name, after checking every stored tensor's name and shape (headers only)."""
    located: dict[str, str] = {}
    for stored, info in checkpoint.tensors.items():
        name = _canonical_name(stored)
        if name is None:
            continue
        if name not in expected:
            raise UnsupportedModelError(
                f"{info.file}: tensor '{stored}' is not a parameter of a {variant} drafter with this config.json"
            )
        if name in located:  # e.g. a codebook stored both with and without `.weight`
            first = located[name]
            raise CheckpointError(
                f"{info.file}: tensor '{stored}' duplicates '{first}' of {checkpoint.tensors[first].file}"
            )
        if info.shape != expected[name]:
            raise TensorShapeError(
                f"{info.file}: tensor '{stored}' has shape {list(info.shape)}, expected {list(expected[name])}"
            )
        located[name] = stored
    return located
