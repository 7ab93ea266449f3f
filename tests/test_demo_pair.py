"""The bundled demo pair (deltaflash/assets/demo): loads in deltaflash, transformers and z-lab's dflash
with matching logits, and speculative greedy output equals target-only output on held-out prompts."""

import pytest
import torch

from deltaflash.bundled import BUNDLED
from deltaflash.core.batch import ExtendBatch
from deltaflash.core.request import SamplingParams
from deltaflash.engine.engine import Engine
from deltaflash.models.dflash import load_drafter
from deltaflash.tokenizer import encode_prompt
from deltaflash.train.corpus import heldout_prompts, load_split
from tests.spec_pairs import give_pages

TARGET, DRAFT = BUNDLED / "target", BUNDLED / "draft"


@pytest.fixture(scope="module")
def prompts():
    return heldout_prompts(load_split(), 3, num_lines=8)


def test_target_logits_match_transformers(prompts):
    from transformers import Qwen3_5ForCausalLM

    engine = Engine.from_pretrained(TARGET, device="cpu", progress=False)
    ids = encode_prompt(engine.tokenizer, prompts[0])[:200]
    hf = Qwen3_5ForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    give_pages(engine, 0, len(ids))
    ours, _ = engine.model.extend(ExtendBatch.build([(0, 0, ids)], "cpu"), engine.pool, engine.runner.kernels,
                                  all_logits=True)
    assert (ours[0] - ref).abs().max() <= 1e-4 * ref.abs().max()


def test_drafter_matches_dflash_package(prompts):
    from dflash.model import DFlashDraftModel

    engine = Engine.from_pretrained(TARGET, DRAFT, device="cpu", progress=False)
    cfg = engine.cfg
    ours = load_drafter(DRAFT, target_hidden_size=cfg.hidden_size, target_vocab_size=cfg.vocab_size,
                        target_num_layers=cfg.num_layers, dtype=torch.float32, device="cpu")
    oracle = DFlashDraftModel.from_pretrained(DRAFT, dtype=torch.float32).eval()
    mine = dict(ours.named_parameters())
    theirs = {k: v for k, v in oracle.state_dict().items() if not k.startswith(("embed_tokens.", "lm_head.", "rotary_emb."))}
    assert sorted(mine) == sorted(theirs)  # every tensor, loaded by two implementations, is the same
    for name, p in theirs.items():
        assert torch.equal(mine[name], p), name
    assert ours.config.target_layer_ids == tuple(oracle.target_layer_ids)
    assert ours.config.block_size == oracle.block_size and ours.config.mask_token_id == oracle.mask_token_id


def test_speculative_greedy_equals_target_only(prompts):
    plain = Engine.from_pretrained(TARGET, device="cpu", progress=False, max_slots=3)
    spec = Engine.from_pretrained(TARGET, DRAFT, device="cpu", progress=False, max_slots=3, speculation="fixed")
    ids = [encode_prompt(plain.tokenizer, p) for p in prompts]
    params = SamplingParams(max_new_tokens=48)
    expected = [c.token_ids for c in plain.generate(ids, params)[0]]
    done = spec.generate(ids, params)[0]
    assert [c.token_ids for c in done] == expected
    accepted = [n for c in done for n in c.accepted_lengths]
    assert sum(accepted) / len(accepted) > 2.0  # the pair accepts about 3 tokens per round on held-out text
    assert all(0 <= len(c.token_ids) - 1 - sum(c.accepted_lengths) <= 1 for c in done)


def test_mean_accepted_length_on_20_heldout_prompts():
    """The acceptance bar of the bundled pair: at least 3.0 tokens per round, bonus token included,
    over 20 held-out prompts decoded greedily for 128 new tokens (fp32 on the CPU)."""
    texts = heldout_prompts(load_split(), 20, num_lines=12)
    assert len(texts) == 20
    spec = Engine.from_pretrained(TARGET, DRAFT, device="cpu", progress=False, max_slots=20, max_model_len=1024,
                                  speculation="fixed")  # the pair's acceptance at its own block
    done = spec.generate([encode_prompt(spec.tokenizer, t) for t in texts], SamplingParams(max_new_tokens=128))[0]
    accepted = [n for c in done for n in c.accepted_lengths]
    mean = sum(accepted) / len(accepted)
    print(f"bundled pair: mean accepted length {mean:.3f} over {len(accepted)} rounds")
    assert mean >= 3.0
