"""Drafter side of issue 3 against the oracle, z-lab's `dflash` package, on random tiny drafters (CPU fp32).

Each oracle drafter is a `DFlashDraftModel` / `DFlash2DraftModel` saved with `save_pretrained`
and loaded back with `load_drafter`; its single full-context forward is the reference for our
incremental DraftContextCache + batched `propose` path.
"""

import json

import pytest
import torch
from dflash import model as oracle
from safetensors.torch import load_file, save_file
from torch.nn import functional as F
from transformers import Qwen3Config

from deltaflash.cache.draft_context import DraftContextCache
from deltaflash.errors import (
    CheckpointError,
    DrafterMismatchError,
    MissingTensorError,
    TensorShapeError,
    UnknownLayerTypeError,
    UnsupportedModelError,
)
from deltaflash.models.dflash import load_drafter
from deltaflash.models.vocab import Vocab
from deltaflash.core.request import SamplingParams
from deltaflash.speculative.draft import draft_hidden, propose
from deltaflash.speculative.sampling import LaneSampling, sampling_probs

V, H, TARGET_LAYERS, TAPS = 96, 32, 8, [1, 4, 7]
ATOL = 1e-5


def oracle_config(variant: str = "dflash", knobs_in: str = "dflash_config", **top) -> Qwen3Config:
    knobs = dict(block_size=5, mask_token_id=3, target_layer_ids=TAPS, input_embedding_scale=1.5,
                 output_multiplier=0.7, final_logit_softcapping=3.0)
    if variant == "dflash2":
        knobs.update(conv_kernel_size=3, conv_group_size=8, selector_rank=8, selector_top_k=6)
    fields = dict(vocab_size=V, hidden_size=H, intermediate_size=48, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_target_layers=TARGET_LAYERS,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000.0})
    fields.update({"dflash_config": knobs} if knobs_in == "dflash_config" else knobs)
    fields.update(top)
    return Qwen3Config(**fields)


def make_oracle(config: Qwen3Config, variant: str = "dflash", seed: int = 0):
    model = (oracle.DFlash2DraftModel if variant == "dflash2" else oracle.DFlashDraftModel)(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = 0.2 * torch.randn(p.shape, generator=g)
            p.copy_(1 + noise if name.endswith("norm.weight") else noise)
    return model.float().eval()


def save(model, folder, *, shard: bool = False, bare_codebooks: bool = False):
    model.save_pretrained(folder, max_shard_size="20KB" if shard else "1GB")
    if bare_codebooks:  # real DFlash2 checkpoints store the codebooks without `.weight`
        tensors = load_file(folder / "model.safetensors")
        renamed = {k.removesuffix(".weight") if "_codebook" in k else k: v for k, v in tensors.items()}
        save_file(renamed, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def load(folder, **overrides):
    kwargs = dict(target_hidden_size=H, target_vocab_size=V, target_num_layers=TARGET_LAYERS, dtype=torch.float32)
    return load_drafter(folder, **{**kwargs, **overrides})


@pytest.fixture
def target():
    g = torch.Generator().manual_seed(123)
    return torch.randn(V, H, generator=g), 0.3 * torch.randn(V, H, generator=g)  # embed, lm_head


def oracle_block(model, features, anchor: int, embed) -> torch.Tensor:
    """The oracle's block hidden states [B, H] for context rows at positions 0..n-1, anchor at n."""
    block = model.block_size
    ids = torch.full((1, block), model.mask_token_id)
    ids[0, 0] = anchor
    scale = float(oracle._draft_value(model.config, "input_embedding_scale", 1.0))
    with torch.no_grad():
        return model(position_ids=torch.arange(features.shape[0] + block)[None],
                     noise_embedding=F.embedding(ids, embed) * scale, target_hidden=features[None])[0]


def context_cache(drafter, num_slots: int, max_model_len: int, dtype=torch.float32) -> DraftContextCache:
    """Pages of 4 positions, so that contexts and blocks cross page boundaries."""
    c = drafter.config
    return DraftContextCache.for_slots(num_slots, max_model_len + c.block_size, page_size=4, num_layers=c.num_layers,
                                       num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, dtype=dtype, device="cpu")


def append(drafter, cache, slot_ids, positions, rows):
    """Committed rows' features -> the drafter's context K/V -> the cache."""
    keys, values = drafter.project_context(rows, positions)
    cache.append(slot_ids, positions, keys, values)


def lane_sampling(lanes: int, temperature: float, top_p: float = 1.0, top_k: int = 0, seeds=None, draws=None):
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
    return LaneSampling.build([params] * lanes, seeds or [0] * lanes, draws or [0] * lanes, "cpu")


def fill(drafter, cache, slot: int, features, chunks):
    """Append a slot's context over several rounds, each beside a NaN padding row."""
    start = 0
    for size in chunks:
        rows = torch.cat([features[start:start + size], torch.full((1, features.shape[1]), float("nan"))])
        positions = torch.tensor([*range(start, start + size), 10**6])
        append(drafter, cache, torch.tensor([slot] * size + [-1]), positions, rows)
        start += size


def features(n: int, seed: int):
    return torch.randn(n, len(TAPS) * H, generator=torch.Generator().manual_seed(seed))


def one_lane(slot, anchor, position):
    return torch.tensor([slot]), torch.tensor([anchor]), torch.tensor([position])


@pytest.mark.parametrize("variant", ["dflash", "dflash2"])
def test_incremental_context_matches_full_context_oracle(tmp_path, target, variant):
    embed, head = target
    model = make_oracle(oracle_config(variant), variant)
    drafter = load(save(model, tmp_path / "d", shard=True, bare_codebooks=False))
    cache = context_cache(drafter, 3, 40, torch.float32)
    fill(drafter, cache, 2, features(20, seed=99), [20])  # a longer previous sequence, then admission resets
    cache.reset(2)
    context = features(13, seed=1)
    fill(drafter, cache, 2, context, [6, 1, 4, 2])  # rows 13..19 of the previous sequence stay, unread

    lane = one_lane(2, 17, 13)
    ours = draft_hidden(drafter, cache, Vocab.whole(embed), *lane, block_size=5)[0]
    ref = oracle_block(model, context, 17, embed)
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)
    ref_logits = model.compute_logits(ref[1:], lambda h: F.linear(h, head))
    torch.testing.assert_close(drafter.logits(ours[1:], Vocab.whole(embed, head)), ref_logits, atol=ATOL, rtol=0)

    tokens = propose(drafter, cache, Vocab.whole(embed, head), *lane, block_size=5).tokens[0]
    if variant == "dflash":
        assert torch.equal(tokens, ref_logits.argmax(-1))
    else:
        ref_tokens, _, _ = model.propose(ref[None, 1:], torch.tensor([17]), lambda h: F.linear(h, head), 0.0)
        assert torch.equal(tokens, ref_tokens[0])


@pytest.mark.parametrize("knobs_in", ["top_level", "dflash_config"])
def test_knobs_read_from_top_level_or_dflash_config(tmp_path, target, knobs_in):
    embed, _ = target
    model = make_oracle(oracle_config("dflash", knobs_in))
    drafter = load(save(model, tmp_path / "d"))
    c = drafter.config
    assert (c.block_size, c.mask_token_id, c.target_layer_ids) == (5, 3, tuple(TAPS))
    assert (c.input_embedding_scale, c.output_multiplier, c.final_logit_softcapping) == (1.5, 0.7, 3.0)
    cache = context_cache(drafter, 1, 16, torch.float32)
    context = features(7, seed=2)
    fill(drafter, cache, 0, context, [7])
    ours = draft_hidden(drafter, cache, Vocab.whole(embed), *one_lane(0, 5, 7), block_size=5)[0]
    torch.testing.assert_close(ours, oracle_block(model, context, 5, embed), atol=ATOL, rtol=0)


def test_dflash_config_knob_wins_over_top_level(tmp_path):
    model = make_oracle(oracle_config("dflash", block_size=9, mask_token_id=11))
    drafter = load(save(model, tmp_path / "d"))
    ours = (drafter.config.block_size, drafter.config.mask_token_id)
    assert ours == (model.block_size, model.mask_token_id) == (5, 3)


@pytest.mark.parametrize("layer_types, is_causal", [
    (["sliding_attention"] * 3, None),
    (["sliding_attention"] * 3, False),
    (["sliding_attention", "full_attention", "sliding_attention"], None),
])
def test_sliding_window_layers(tmp_path, target, layer_types, is_causal):
    embed, _ = target
    config = oracle_config("dflash", use_sliding_window=True, sliding_window=4, layer_types=layer_types,
                           is_causal=is_causal)
    model = make_oracle(config, seed=3)
    drafter = load(save(model, tmp_path / "d"))
    cache = context_cache(drafter, 2, 32, torch.float32)
    context = features(11, seed=4)
    fill(drafter, cache, 1, context, [6, 3, 2])  # the window (4) is shorter than the context
    ours = draft_hidden(drafter, cache, Vocab.whole(embed), *one_lane(1, 8, 11), block_size=5)[0]
    torch.testing.assert_close(ours, oracle_block(model, context, 8, embed), atol=ATOL, rtol=0)


def test_dflash2_sampled_selector_matches_oracle(tmp_path, target, monkeypatch):
    embed, head = target
    model = make_oracle(oracle_config("dflash2"), "dflash2", seed=5)
    drafter = load(save(model, tmp_path / "d", bare_codebooks=True))
    cache = context_cache(drafter, 1, 16, torch.float32)
    context = features(8, seed=6)
    fill(drafter, cache, 0, context, [3, 5])
    ours = propose(drafter, cache, Vocab.whole(embed, head), *one_lane(0, 21, 8), block_size=5,
                   sampling=lane_sampling(1, 0.7, seeds=[7]))
    assert ours.probs.shape == ours.indices.shape == (1, 4, 6)

    ref = oracle_block(model, context, 21, embed)[None, 1:]
    candidates = model.compute_logits(ref, lambda h: F.linear(h, head)).topk(6, dim=-1, sorted=False).indices
    picks = iter(range(4))

    def follow_ours(q):  # make the oracle walk the path we sampled
        slot = next(picks)
        return (candidates[:, slot] == ours.tokens[:, slot, None]).int().argmax(-1)

    monkeypatch.setattr(oracle, "_sample_probs", follow_ours)
    with torch.no_grad():
        path, ref_candidates, ref_q = model.propose(ref, torch.tensor([21]), lambda h: F.linear(h, head), 0.7)
    assert torch.equal(path, ours.tokens)
    assert torch.equal(ref_candidates.sort(-1).values, ours.indices.sort(-1).values)
    spread = torch.zeros(1, 4, V)
    torch.testing.assert_close(spread.scatter(-1, ours.indices, ours.probs),
                               spread.scatter(-1, ref_candidates, ref_q), atol=ATOL, rtol=0)


def test_dflash_sampling_probs_match_oracle(tmp_path, target):
    embed, head = target
    drafter = load(save(make_oracle(oracle_config("dflash")), tmp_path / "d"))
    cache = context_cache(drafter, 1, 16, torch.float32)
    fill(drafter, cache, 0, features(6, seed=8), [6])
    lane = one_lane(0, 4, 6)
    logits = drafter.logits(draft_hidden(drafter, cache, Vocab.whole(embed), *lane, block_size=5)[0, 1:], Vocab.whole(embed, head))
    runs = [propose(drafter, cache, Vocab.whole(embed, head), *lane, block_size=5,
                    sampling=lane_sampling(1, 0.9, 0.8, 20, seeds=[11])) for _ in range(2)]
    torch.testing.assert_close(runs[0].probs[0], oracle._sampling_probs(logits, 0.9, 0.8, 20), atol=ATOL, rtol=0)
    assert torch.equal(runs[0].tokens, runs[1].tokens)  # one noise stream per (seed, step): reproducible
    assert (runs[0].probs[0].gather(-1, runs[0].tokens[0, :, None]) > 0).all()
    assert torch.equal(sampling_probs(logits, 0.9), oracle._sampling_probs(logits, 0.9))


@pytest.mark.parametrize("variant", ["dflash", "dflash2"])
@pytest.mark.parametrize("streams", ["seeds", "steps"])
def test_sampled_tokens_follow_q(tmp_path, target, variant, streams):
    """Lanes with different seeds, or one seed at different steps, draw independently from q."""
    embed, head = target
    drafter = load(save(make_oracle(oracle_config(variant), variant, seed=14), tmp_path / "d"))
    cache = context_cache(drafter, 1, 16, torch.float32)
    fill(drafter, cache, 0, features(5, seed=15), [5])
    lanes = 2000  # every lane drafts the same block, so slot 1 draws 2000 times from one q
    counters = {"seeds": (list(range(lanes)), None), "steps": ([16] * lanes, list(range(lanes)))}[streams]
    p = propose(drafter, cache, Vocab.whole(embed, head), torch.zeros(lanes, dtype=torch.long), torch.full((lanes,), 9),
                torch.full((lanes,), 5), 5, sampling=lane_sampling(lanes, 1.5, top_k=20, seeds=counters[0],
                                                                   draws=counters[1]))
    q = p.probs[0, 0] if p.indices is None else torch.zeros(V).scatter(-1, p.indices[0, 0], p.probs[0, 0])
    seen = torch.bincount(p.tokens[:, 0], minlength=V).float() / lanes
    assert q.max() < 0.6 and 0.5 * (seen - q).abs().sum() < 0.1  # total variation distance


@pytest.mark.parametrize("variant", ["dflash", "dflash2"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_batched_propose_equals_per_lane_runs(tmp_path, target, variant, temperature):
    embed, head = target
    drafter = load(save(make_oracle(oracle_config(variant), variant, seed=9), tmp_path / "d"))
    cache = context_cache(drafter, 4, 24, torch.float32)
    contexts = {0: features(3, seed=10), 3: features(8, seed=11), 1: features(12, seed=12)}
    for lo, hi in [(0, 5), (5, 12)]:  # slots interleaved in one append, plus a padding row
        slot_ids = [s for s, f in contexts.items() for _ in range(lo, min(hi, len(f)))] + [-1]
        positions = [p for f in contexts.values() for p in range(lo, min(hi, len(f)))] + [0]
        rows = torch.cat([f[lo:hi] for f in contexts.values()] + [torch.full((1, 3 * H), float("nan"))])
        append(drafter, cache, torch.tensor(slot_ids), torch.tensor(positions), rows)

    lanes = [(1, 40, 12), (-1, -1, 0), (0, 41, 3), (3, 42, 8)]  # (slot, anchor, anchor position)
    seeds = [20, 21, 22, 23]
    slot_ids, anchors, positions = (torch.tensor(col) for col in zip(*lanes))
    batched = [propose(drafter, cache, Vocab.whole(embed, head), slot_ids, anchors, positions, 5,
                       sampling=lane_sampling(4, temperature, seeds=seeds), max_context_len=bound)
               for bound in (None, 12)]
    hidden = draft_hidden(drafter, cache, Vocab.whole(embed), slot_ids, anchors, positions, 5)
    assert torch.isfinite(hidden).all()
    for i, lane in enumerate(lanes):
        if lane[0] < 0:
            continue
        single = propose(drafter, cache, Vocab.whole(embed, head), *one_lane(*lane), 5,
                         sampling=lane_sampling(1, temperature, seeds=[seeds[i]]))
        # fp32 rounding only: the batched lanes' SDPA sees the other lanes' masks beside its own
        torch.testing.assert_close(hidden[i], draft_hidden(drafter, cache, Vocab.whole(embed), *one_lane(*lane), 5)[0],
                                   atol=5 * ATOL, rtol=0)
        for run in batched:
            assert torch.equal(run.tokens[i], single.tokens[0])
            if temperature > 0:
                torch.testing.assert_close(run.probs[i], single.probs[0], atol=ATOL, rtol=0)


@pytest.mark.parametrize("variant", ["dflash", "dflash2"])
def test_bf16_path_as_accurate_as_oracle_bf16(tmp_path, target, variant):
    embed, _ = target
    model = make_oracle(oracle_config(variant), variant)
    drafter = load(save(model, tmp_path / "d"), dtype=torch.bfloat16)
    context = features(7, seed=13)
    exact = oracle_block(model, context, 2, embed)
    oracle_error = (oracle_block(model.bfloat16(), context.bfloat16(), 2, embed.bfloat16()) - exact).abs().max()
    cache = context_cache(drafter, 1, 16, torch.bfloat16)
    fill(drafter, cache, 0, context.bfloat16(), [7])
    ours = draft_hidden(drafter, cache, Vocab.whole(embed.bfloat16()), *one_lane(0, 2, 7), 5)[0]
    assert ours.dtype == torch.bfloat16
    assert (ours.float() - exact).abs().max() <= 2 * oracle_error.float()


# ---------------------------------------------------------------- typed errors, one each


@pytest.fixture
def saved(tmp_path):
    return save(make_oracle(oracle_config("dflash")), tmp_path / "d")


def edit_config(folder, change):
    path = folder / "config.json"
    raw = json.loads(path.read_text())
    change(raw)
    path.write_text(json.dumps(raw))


def edit_tensors(folder, change):
    tensors = load_file(folder / "model.safetensors")
    change(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def test_error_hidden_size_mismatch(saved):
    with pytest.raises(DrafterMismatchError, match=r"config.json: hidden_size is 32, expected .* 48"):
        load(saved, target_hidden_size=48)


def test_error_vocab_mismatch(saved):
    with pytest.raises(DrafterMismatchError, match=r"vocab_size is 96, expected the target's 100"):
        load(saved, target_vocab_size=100)


def test_error_tap_layer_out_of_range(saved):
    with pytest.raises(DrafterMismatchError, match=r"target_layer_ids \[1, 4, 7\] has \[7\] outside .* 0..6"):
        load(saved, target_num_layers=7)


def test_error_missing_mask_token_id(saved):
    edit_config(saved, lambda raw: raw["dflash_config"].pop("mask_token_id"))
    with pytest.raises(CheckpointError, match=r"config.json: field 'mask_token_id' is missing"):
        load(saved)


def test_error_missing_target_layer_ids(saved):
    edit_config(saved, lambda raw: raw["dflash_config"].pop("target_layer_ids"))
    with pytest.raises(CheckpointError, match=r"field 'target_layer_ids' is missing"):
        load(saved)


def test_error_missing_tensor(saved):
    edit_tensors(saved, lambda t: t.pop("layers.1.mlp.up_proj.weight"))
    with pytest.raises(MissingTensorError, match=r"tensor 'layers.1.mlp.up_proj.weight' \(shape \[48, 32\]\)"):
        load(saved)


def test_error_wrong_shape(saved):
    edit_tensors(saved, lambda t: t.update({"fc.weight": torch.zeros(32, 64)}))
    expected = r"model.safetensors: tensor 'fc.weight' has shape \[32, 64\], expected \[32, 96\]"
    with pytest.raises(TensorShapeError, match=expected):
        load(saved)


def test_error_unexpected_tensor(saved):
    edit_tensors(saved, lambda t: t.update({"confidence_proj.weight": torch.zeros(1, 32)}))
    with pytest.raises(UnsupportedModelError, match=r"tensor 'confidence_proj.weight' is not a parameter"):
        load(saved)


def test_error_unsupported_architecture(saved):
    edit_config(saved, lambda raw: raw.update(architectures=["LlamaForCausalLM"]))
    with pytest.raises(UnsupportedModelError, match=r"architectures is \['LlamaForCausalLM'\]"):
        load(saved)


def test_error_unknown_layer_type(saved):
    edit_config(saved, lambda raw: raw.update(layer_types=["full_attention", "chunked_attention", "full_attention"]))
    with pytest.raises(UnknownLayerTypeError, match=r"layer_types\[1\] is 'chunked_attention'"):
        load(saved)


def test_error_no_config(tmp_path):
    with pytest.raises(CheckpointError, match=r"config.json: no config.json"):
        load(tmp_path)


def test_error_index_names_absent_shard(tmp_path):
    folder = save(make_oracle(oracle_config("dflash")), tmp_path / "d", shard=True)
    (folder / sorted(folder.glob("*-of-*.safetensors"))[-1].name).unlink()
    with pytest.raises(CheckpointError, match=r"index.json: names shard 'model-\d+-of-\d+.safetensors'"):
        load(folder)
