"""Tiny random target + drafter pairs for speculative decoding tests."""

from __future__ import annotations

import os

import torch
from transformers import Qwen3Config

from deltaflash.core.request import SamplingParams
from deltaflash.engine.config import EngineConfig
from deltaflash.engine.engine import Engine
from deltaflash.models.dflash import load_drafter
from deltaflash.models.loader import load_model
from tests.checkpoints import build_hf_model, save_checkpoint


# DELTAFLASH_TEST_DEVICE=cuda runs the speculative tests on a GPU (fp32, fused verify route)
DEVICE = os.environ.get("DELTAFLASH_TEST_DEVICE", "cpu")


def save_drafter(folder, target_cfg, variant: str = "dflash", seed: int = 0, block_size: int = 6,
                 taps=(0, 2), mask_token_id: int = 1, num_layers: int = 2):
    from dflash import model as oracle

    knobs = dict(block_size=block_size, mask_token_id=mask_token_id, target_layer_ids=list(taps))
    if variant == "dflash2":
        knobs.update(conv_kernel_size=3, conv_group_size=8, selector_rank=8, selector_top_k=6)
    config = Qwen3Config(
        vocab_size=target_cfg.vocab_size, hidden_size=target_cfg.hidden_size, intermediate_size=64,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_target_layers=target_cfg.num_layers, dflash_config=knobs,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(seed)
    model = (oracle.DFlash2DraftModel if variant == "dflash2" else oracle.DFlashDraftModel)(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if name.endswith("norm.weight") else 0.1 * torch.randn_like(p))
    model.float().save_pretrained(folder)
    return folder


def make_pair(tmp_path, kind: str = "dense_gqa", variant: str = "dflash", seed: int = 0, block_size: int = 6):
    target_dir = save_checkpoint(build_hf_model(kind, seed=seed), tmp_path / f"target-{kind}-{seed}")
    cfg = load_model(target_dir, device="cpu", progress=False).cfg
    draft_dir = save_drafter(tmp_path / f"draft-{variant}-{seed}", cfg, variant, seed=seed, block_size=block_size)
    return target_dir, draft_dir


def pairs_by_kind(root, kinds=("dense_gqa", "moe"), block_size: int = 4) -> dict[str, tuple]:
    """{kind: (target folder, drafter folder)} of make_pair for each target kind."""
    return {kind: make_pair(root, kind=kind, block_size=block_size) for kind in kinds}


def peaked_pair(root, vocab_size: int, variants=("dflash",), block_size: int = 4):
    """A tiny target of `vocab_size` tokens with a peaked lm_head (so p and a drafter's q differ clearly and
    a few candidates hold most of p) and drafters of `variants`: (target folder, {variant: draft folder})."""
    hf = build_hf_model("dense_gqa", seed=11, vocab_size=vocab_size)
    with torch.no_grad():
        hf.lm_head.weight.mul_(6.0)
    target = save_checkpoint(hf, root / "target")
    cfg = load_model(target, device="cpu", progress=False).cfg
    return target, {v: save_drafter(root / v, cfg, v, seed=5, block_size=block_size) for v in variants}


def engine_for(target_dir, draft_dir=None, draft_source=None, **config):
    """Speculation at the full block by default ("fixed"): the tests of load-adaptive widths ask for them.
    On a GPU the target's products run batch-invariant (cuBLAS is not: docs/benchmarks.md), so greedy
    speculative and target-only outputs are compared to the bit there too."""
    config = {"max_slots": 8, "max_model_len": 256, "speculation": "fixed", "batch_invariant": DEVICE == "cuda"} | config
    model = load_model(target_dir, device=DEVICE, dtype=torch.float32, progress=False)
    drafter = None
    if draft_dir is not None:
        drafter = load_drafter(draft_dir, target_hidden_size=model.cfg.hidden_size,
                               target_vocab_size=model.cfg.vocab_size, target_num_layers=model.cfg.num_layers,
                               dtype=torch.float32, device=DEVICE)
    return Engine(model, None, drafter, EngineConfig(**config), draft_source=draft_source)


def give_pages(engine, slot: int, tokens: int) -> None:
    """Map pages for positions 0..tokens-1 of `slot`, as the scheduler does for a sequence it admits
    (for tests that drive the model on the engine's pool directly)."""
    engine.pool.tables.map(engine.scheduler.pages.grow(slot, tokens))


def assert_greedy_equal(target_dir, batch, got, want, margin: float = 1e-3, **config) -> None:
    """Greedy outputs `got` == `want`, for runs whose prefill was scheduled differently (other chunks,
    other batch mates, preemption and recompute). On the CPU exactly. On a GPU a chunked prefill is not
    the same arithmetic as decoding those tokens (GEMMs of other shapes, the chunked GDN form), so the two
    may part at a near-tie: where they first differ, both tokens must be the target's top two there with
    log probabilities within `margin` (a wrong token loses by far more than rounding)."""
    if DEVICE == "cpu":
        assert got == want
        return
    config = {"max_model_len": 256} | config
    for prompt, a, b in zip(batch, got, want):
        if a == b:
            continue
        i = next(n for n, (x, y) in enumerate(zip(a, b)) if x != y)
        done, _ = engine_for(target_dir, **config).generate([prompt + b[:i]], SamplingParams(max_new_tokens=1, logprobs=2))
        top = dict(done[0].logprobs[0].top)
        assert {a[i], b[i]} <= set(top), f"token {i}: {a[i]} vs {b[i]}, the target's top two are {top}"
        assert abs(top[a[i]] - top[b[i]]) < margin, f"token {i}: {a[i]} vs {b[i]} is no near-tie: {top}"


def run_cancelling(engine, ids: list[str], every: int, check=lambda: None) -> None:
    """Step the engine until it has no work, cancelling one of the requests `ids` every `every` steps (waiting,
    prefilling and decoding ones alike, by a fixed stride); `check()` after each step."""
    steps = 0
    while engine.has_work():
        engine.step()
        check()
        steps += 1
        if steps % every == 0:
            engine.abort(ids[(steps * 7) % len(ids)])


def prompts(vocab: int, lengths, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


class EagerGraph:
    """Stands in for a LaneGraphs on the CPU: runs the function its graphs would have captured."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def run(self, *inputs):
        self.calls += 1
        return self.fn(*inputs)

    def run_host(self, *inputs):
        return self.run(*(torch.from_numpy(x).to(DEVICE) for x in inputs))
