"""The demo-pair training pipeline at tiny sizes on CPU: corpus, tokenizer, target, drafter, exports, CLI."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from deltaflash.train import cli
from deltaflash.train.corpus import encode_corpus, heldout_prompts, is_heldout, load_split
from deltaflash.train.draft import (Drafter, export_drafter, load_drafter, make_blocks, target_features,
                                    teacher_forced_acceptance, train_drafter)
from deltaflash.train.loop import LoopOptions, Metric, run_loop, seed_everything
from deltaflash.train.shapes import DrafterShape, TargetShape
from deltaflash.train.target import build_target, export_target, heldout_loss, train_target
from deltaflash.train.tokenizer import load_tokenizer, save_tokenizer, special_ids, train_tokenizer

MAX_FILES = 120
SEQ_LEN = 64
BLOCK = 4
TINY_TARGET = TargetShape(hidden_size=64, num_layers=4, intermediate_size=128, num_attention_heads=2,
                          num_key_value_heads=1, head_dim=32, linear_num_key_heads=1, linear_num_value_heads=2,
                          linear_head_dim=32, max_position_embeddings=512)
CPU = torch.device("cpu")


@pytest.fixture(scope="module", autouse=True)
def flush_denormals():
    """What `resolve_device("cpu")` does for a training run (GDN steps ~40x faster), undone afterwards."""
    torch.set_flush_denormal(True)
    yield
    torch.set_flush_denormal(False)


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    out = tmp_path_factory.mktemp("pair")
    split = load_split(max_files=MAX_FILES)
    tokenizer = train_tokenizer(split.train.texts, vocab_size=300)
    save_tokenizer(tokenizer, out / "tokenizer", model_max_length=512)
    ids = special_ids(tokenizer)
    train_tokens = encode_corpus(tokenizer, split.train, ids.endoftext)
    heldout_tokens = encode_corpus(tokenizer, split.heldout, ids.endoftext)
    options = LoopOptions(steps=16, lr=1e-2, warmup=2, log_every=4, eval_every=8)

    target = build_target(TINY_TARGET, tokenizer.get_vocab_size(), ids, seed=0)
    target_loop = train_target(target, train_tokens, heldout_tokens, options=options, seq_len=SEQ_LEN,
                               batch_size=4, seed=0, device=CPU, eval_tokens=4 * SEQ_LEN)
    export_target(target, out / "tokenizer", out / "target")
    _round_to_bf16(target)  # from here on the in-memory target is the exported one, as in `train draft`
    target.eval().requires_grad_(False)

    shape = DrafterShape(hidden_size=64, vocab_size=tokenizer.get_vocab_size(), num_target_layers=4,
                         target_layer_ids=(1, 2), block_size=BLOCK, mask_token_id=ids.mask, num_layers=2,
                         intermediate_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                         max_position_embeddings=512)
    seed_everything(0)
    drafter = Drafter(shape)
    draft_loop = train_drafter(drafter, target, train_tokens, heldout_tokens, options=options, seq_len=SEQ_LEN,
                               batch_size=4, blocks_per_seq=8, gamma=2.0, label_source="data", seed=0, device=CPU,
                               eval_tokens=4 * SEQ_LEN)
    export_drafter(drafter, out / "draft")
    _round_to_bf16(drafter)
    return SimpleNamespace(out=out, split=split, tokenizer=tokenizer, ids=ids, heldout_tokens=heldout_tokens,
                           target=target, target_loop=target_loop, drafter=drafter, draft_loop=draft_loop)


def _round_to_bf16(module: torch.nn.Module) -> None:
    """The exported weights are bf16: round the in-memory model the same way before comparing."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(p.to(torch.bfloat16).float())


def test_corpus_split_is_deterministic_and_disjoint(pipeline):
    split = pipeline.split
    again = load_split(max_files=MAX_FILES)
    assert again == split
    train, heldout = set(split.train.paths), set(split.heldout.paths)
    assert not train & heldout
    assert list(split.train.paths) == sorted(train) and list(split.heldout.paths) == sorted(heldout)
    assert all(is_heldout(p) for p in heldout) and not any(is_heldout(p) for p in train)
    assert 0 < len(heldout) < 0.2 * (len(train) + len(heldout))
    assert not any(p.startswith(("encodings/", "pydoc_data/")) or "site-packages" in p for p in train | heldout)
    prompts = heldout_prompts(split, count=3, num_lines=5)
    assert len(prompts) == 3
    assert all(p.count("\n") == 5 and any(t.startswith(p) for t in split.heldout.texts) for p in prompts)


def test_tokenizer_round_trips_and_loads_in_transformers(pipeline):
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(pipeline.out / "tokenizer", local_files_only=True)
    text = pipeline.split.heldout.texts[0][:2000] + "\n# ünïcödé ✓ \t tabs\r\n"
    ids = auto.encode(text, add_special_tokens=False)
    assert auto.decode(ids) == text
    assert ids == pipeline.tokenizer.encode(text, add_special_tokens=False).ids
    assert auto.convert_tokens_to_ids("<|mask|>") == pipeline.ids.mask
    assert auto.eos_token_id == pipeline.ids.endoftext
    chat = auto.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert pipeline.tokenizer.get_vocab_size() == 300


def test_training_lowers_the_loss(pipeline):
    for loop in (pipeline.target_loop, pipeline.draft_loop):
        losses = loop.losses
        assert loop.steps == 16 and len(losses) == 4
        assert losses[-1] < losses[0] - 0.3, losses
        assert [step for step, _ in loop.evals] == [8, 16]


def test_loop_keeps_the_best_evaluation():
    torch.manual_seed(0)
    module = torch.nn.Linear(4, 1)
    x, y = torch.randn(32, 4), torch.randn(32, 1)
    scores = iter([3.0, 1.0, 2.0])  # evaluations at steps 5, 10, 15: the best loss comes at step 10
    snapshots = []

    def compute() -> float:
        snapshots.append(module.weight.detach().clone())
        return next(scores)

    options = LoopOptions(steps=15, lr=0.1, warmup=1, log_every=5, eval_every=5)
    result = run_loop(module, lambda step: ((module(x) - y) ** 2).mean(), options, CPU,
                      Metric("loss", compute, maximize=False), desc="toy")
    assert (result.best_step, result.best_value) == (10, 1.0)
    assert result.evals == ((5, 3.0), (10, 1.0), (15, 2.0))
    assert torch.equal(module.weight, snapshots[1]) and not torch.equal(module.weight, snapshots[2])


def test_target_export_loads_in_transformers_with_equal_logits(pipeline):
    from transformers import Qwen3_5ForCausalLM

    folder = pipeline.out / "target"
    loaded = Qwen3_5ForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True).eval()
    raw = json.loads((folder / "config.json").read_text())
    assert raw["dtype"] == "bfloat16" and raw["tie_word_embeddings"] is True
    assert raw["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert load_tokenizer(folder).get_vocab_size() == 300
    tokens = pipeline.heldout_tokens[:2 * SEQ_LEN].view(2, SEQ_LEN)
    with torch.no_grad():
        expected = pipeline.target(input_ids=tokens).logits
        got = loaded(input_ids=tokens).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert heldout_loss(loaded, tokens, CPU) == pytest.approx(heldout_loss(pipeline.target, tokens, CPU), rel=1e-5)


def test_a_damaged_exported_drafter_is_a_checkpoint_error_naming_it(pipeline, tmp_path):
    """The trainer reads an exported drafter (`train draft --init`, `train evaluate`) through the same
    checkpoint reader as the engine: a truncated file is a one-line CheckpointError naming it."""
    import os
    import shutil

    from deltaflash.errors import CheckpointError

    folder = Path(shutil.copytree(pipeline.out / "draft", tmp_path / "draft"))
    weights = folder / "model.safetensors"
    os.truncate(weights, weights.stat().st_size - 100)
    with pytest.raises(CheckpointError, match=re.escape(str(weights))) as error:
        load_drafter(folder, CPU)
    assert "\n" not in str(error.value)


def test_drafter_export_loads_in_dflash_with_equal_forward(pipeline):
    from dflash.model import DFlashDraftModel

    folder = pipeline.out / "draft"
    reference = DFlashDraftModel.from_pretrained(folder, dtype=torch.float32).eval()
    ours = load_drafter(folder, CPU)
    assert (reference.block_size, reference.mask_token_id) == (BLOCK, pipeline.ids.mask)
    assert list(reference.target_layer_ids) == [1, 2]

    # config.json is what z-lab's own save_pretrained writes for the same model
    reference.to(torch.bfloat16).save_pretrained(pipeline.out / "draft-resaved")
    reference.float()
    resaved = json.loads((pipeline.out / "draft-resaved" / "config.json").read_text())
    assert json.loads((folder / "config.json").read_text()) == resaved

    # Many blocks in one masked forward == z-lab's forward of each block alone on its context prefix.
    tokens = pipeline.heldout_tokens[:2 * SEQ_LEN].view(2, SEQ_LEN)
    anchors = torch.tensor([[1, 9, 30, 57], [5, 6, 40, 60]])
    target = pipeline.target
    with torch.no_grad():
        features, _ = target_features(target, tokens, ours.shape.target_layer_ids, with_logits=False)
        blocks = make_blocks(tokens, anchors, BLOCK, ours.shape.mask_token_id)
        embeds = target.get_input_embeddings()(blocks.block_ids)
        batched = ours(embeds, features, blocks.positions, blocks.mask).view(2, 4, BLOCK, -1)
        for row in range(2):
            for m, anchor in enumerate(anchors[row].tolist()):
                block_embeds = embeds[row:row + 1, m * BLOCK:(m + 1) * BLOCK]
                alone = reference(position_ids=torch.arange(anchor + BLOCK)[None], noise_embedding=block_embeds,
                                  target_hidden=features[row:row + 1, :anchor])
                torch.testing.assert_close(batched[row, m], alone[0], rtol=1e-4, atol=1e-4)
                # a context that also held the anchor's own row would differ far beyond that tolerance
                leaky = reference(position_ids=torch.arange(anchor + 1 + BLOCK)[None], noise_embedding=block_embeds,
                                  target_hidden=features[row:row + 1, :anchor + 1])
                assert (leaky[0] - batched[row, m]).abs().max() > 1e-3

    # The trained drafter (rounded to bf16) is the exported one.
    trained = pipeline.drafter.state_dict()
    for (name, got), (_, want) in zip(ours.state_dict().items(), trained.items(), strict=True):
        assert torch.equal(got, want), name


def test_acceptance_is_chained_and_cli_evaluate_reports_it(pipeline, capsys):
    windows = pipeline.heldout_tokens[:4 * SEQ_LEN].view(4, SEQ_LEN)
    drafter = load_drafter(pipeline.out / "draft", CPU)
    acceptance = teacher_forced_acceptance(drafter, pipeline.target, windows, CPU)
    assert len(acceptance) == BLOCK - 1
    assert all(0.0 <= a <= 1.0 for a in acceptance)
    assert all(later <= earlier for earlier, later in zip(acceptance, acceptance[1:]))

    cli.main(["evaluate", "--target", str(pipeline.out / "target"), "--draft", str(pipeline.out / "draft"),
              "--max-files", str(MAX_FILES), "--seq-len", str(SEQ_LEN), "--eval-tokens", str(4 * SEQ_LEN)])
    printed = capsys.readouterr().out
    loss = float(re.search(r"held-out loss ([0-9.]+)", printed).group(1))
    assert 0.0 < loss < math.log(300) - 1.0  # a nat below a uniform guess (an untrained model is at or above it)
    shown = [float(x) for x in re.search(r"slot 1\.\.3: ([0-9. ]+) \|", printed).group(1).split()]
    assert shown == pytest.approx(acceptance, abs=5e-4)


def test_generate_writes_the_targets_greedy_continuations_and_draft_trains_on_them(pipeline, capsys):
    from deltaflash.engine.engine import Engine
    from deltaflash.core.request import SamplingParams
    from deltaflash.train.generate import generation_prompts, load_stream

    out = pipeline.out
    stream_path = out / "selfgen.safetensors"
    cli.main(["generate", "--target", str(out / "target"), "--out", str(stream_path), "--prompts", "5",
              "--new-tokens", "12", "--max-slots", "2", "--max-files", str(MAX_FILES), "--device", "cpu"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["prompts"] == 5

    prompts = generation_prompts(pipeline.split.train, pipeline.tokenizer, 5, seed=0)
    heldout_starts = {tuple(pipeline.tokenizer.encode(t, add_special_tokens=False).ids[:8]) for t in pipeline.split.heldout.texts}
    assert not any(tuple(p[:8]) in heldout_starts for p in prompts)  # the train split only
    engine = Engine.from_pretrained(out / "target", device="cpu", progress=False, max_slots=1, max_model_len=512)
    greedy = [c.token_ids for c in engine.generate(prompts, SamplingParams(max_new_tokens=12))[0]]
    eos = pipeline.ids.endoftext
    expected = [p + g + ([] if g[-1] == eos else [eos]) for p, g in zip(prompts, greedy)]
    assert load_stream(stream_path).tolist() == [t for doc in expected for t in doc]
    assert report["generated_tokens"] == sum(map(len, greedy))

    cli.main(["draft", "--target", str(out / "target"), "--out", str(out / "draft-selfgen"), "--init", str(out / "draft"),
              "--data", str(stream_path), str(stream_path), "--block-size", str(BLOCK), "--num-layers", "2",
              "--intermediate-size", "128", "--num-attention-heads", "2", "--num-key-value-heads", "1",
              "--head-dim", "32", "--target-layers", "1", "2", "--labels", "target", "--steps", "0",
              "--batch-size", "2", "--seq-len", str(SEQ_LEN), "--eval-every", "0", "--eval-tokens", str(2 * SEQ_LEN),
              "--max-files", str(MAX_FILES), "--device", "cpu"])
    # zero steps from --init: the exported drafter is the initial one
    initial, again = load_drafter(out / "draft", CPU), load_drafter(out / "draft-selfgen", CPU)
    for (name, a), b in zip(initial.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), name
