"""Target model parity with transformers, batched decode, slot reuse (CPU, fp32)."""

import dataclasses

import pytest
import torch

from deltaflash.cache.slots import SlotPool
from deltaflash.core.batch import ExtendBatch
from deltaflash.core.request import SamplingParams
from deltaflash.engine.engine import Engine
from deltaflash.models.loader import load_model
from deltaflash.ops.kernels import kernels_named, reference_kernels
from tests.checkpoints import build_hf_model, save_checkpoint

CASES = [
    ("dense_gqa", "causal_lm", None),
    ("dense_gqa", "conditional", None),
    ("dense_tied", "causal_lm", None),
    ("dense_tied", "conditional", "40KB"),
    ("moe", "causal_lm", None),
    ("moe", "conditional", "60KB"),
]


@pytest.mark.parametrize("kind,layout,shard", CASES, ids=["-".join(filter(None, c)) for c in CASES])
def test_parity_with_transformers(tmp_path, kind, layout, shard):
    hf = build_hf_model(kind, seed=hash((kind, layout)) % 1000)
    folder = save_checkpoint(hf, tmp_path / "ckpt", layout, max_shard_size=shard)
    if shard:
        assert (folder / "model.safetensors.index.json").is_file()
        assert len(list(folder.glob("model-*.safetensors"))) > 1
    model = load_model(folder, device="cpu", progress=False)
    vocab = hf.config.vocab_size
    prompt = torch.randint(0, vocab, (1, 70), generator=torch.Generator().manual_seed(1))

    with torch.no_grad():
        ref = hf(prompt).logits[0].float()
    pool = SlotPool(model.cfg, 2, 256, torch.float32, "cpu")
    batch = ExtendBatch.build([(0, 0, prompt[0].tolist())], "cpu")
    logits, _ = model.extend(batch, pool, reference_kernels(), all_logits=True)
    scale = ref.abs().max().item()
    assert (logits[0] - ref).abs().max().item() <= 1e-4 * scale

    expected = hf.generate(prompt, max_new_tokens=32, do_sample=False, min_new_tokens=32)[0, 70:].tolist()
    engine = Engine(model)
    (done,), _ = engine.generate([prompt[0].tolist()], SamplingParams(max_new_tokens=32, ignore_eos=True))
    assert done.token_ids == expected


def _prompts(vocab, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def dense_folder(tmp_path_factory):
    return save_checkpoint(build_hf_model("dense_gqa", seed=7), tmp_path_factory.mktemp("dense"))


def test_batched_decode_equals_solo_runs(dense_folder):
    engine = Engine.from_pretrained(dense_folder, device="cpu", progress=False, max_slots=4, max_model_len=256)
    prompts = _prompts(96, [3, 11, 29, 64])
    params = SamplingParams(max_new_tokens=24)
    together, _ = engine.generate(prompts, params)
    assert engine.stats["decode_rounds"] < 4 * 24  # the four really shared rounds
    for prompt, done in zip(prompts, together):
        solo_engine = Engine.from_pretrained(dense_folder, device="cpu", progress=False, max_slots=1, max_model_len=256)
        (solo,), _ = solo_engine.generate([prompt], params)
        assert done.token_ids == solo.token_ids


def test_more_requests_than_slots_queue_and_finish(dense_folder):
    engine = Engine.from_pretrained(dense_folder, device="cpu", progress=False, max_slots=2, max_model_len=128)
    prompts = _prompts(96, [4, 9, 2, 7, 5], seed=3)
    done, _ = engine.generate(prompts, SamplingParams(max_new_tokens=6))
    solo = Engine.from_pretrained(dense_folder, device="cpu", progress=False, max_slots=1, max_model_len=128)
    for p, d in zip(prompts, done):
        assert d.token_ids == solo.generate([p], SamplingParams(max_new_tokens=6))[0][0].token_ids
    assert engine.num_live == 0


def test_slot_reuse_matches_fresh_engine(dense_folder):
    engine = Engine.from_pretrained(dense_folder, device="cpu", progress=False, max_slots=1, max_model_len=128)
    first, second = _prompts(96, [40, 13], seed=5)
    engine.generate([first], SamplingParams(max_new_tokens=20))
    assert engine.scheduler.slots.num_free == 1  # the slot was retired...
    (reused,), _ = engine.generate([second], SamplingParams(max_new_tokens=20))  # ...and re-admitted
    fresh = Engine.from_pretrained(dense_folder, device="cpu", progress=False, max_slots=1, max_model_len=128)
    (clean,), _ = fresh.generate([second], SamplingParams(max_new_tokens=20))
    assert reused.token_ids == clean.token_ids


def test_padding_lane_touches_nothing(dense_folder):
    model = load_model(dense_folder, device="cpu", progress=False)
    pool = SlotPool(model.cfg, 3, 64, torch.float32, "cpu")
    slot = 0
    model.extend(ExtendBatch.build([(slot, 0, [1, 2, 3])], "cpu"), pool, reference_kernels())
    before = [t.clone() for t in (pool.conv_history, pool.recurrent_state, pool.key_cache, pool.value_cache)]
    lengths = list(pool.lengths)
    batch = ExtendBatch.build([(slot, 3, [4])], "cpu", pad_lanes_to=3)
    model.extend(batch, pool, reference_kernels())
    after = (pool.conv_history, pool.recurrent_state, pool.key_cache, pool.value_cache)
    others = slice(pool.tables.max_pages, pool.tables.num_pages)  # static tables: the pages of slots 1, 2
    for b, a in zip(before[:2], after[:2]):  # only the live slot changed
        assert torch.equal(b[1:pool.num_slots], a[1:pool.num_slots])
    for b, a in zip(before[2:], after[2:]):  # K/V of padding rows went to the sink page, not to other slots
        assert torch.equal(b[:, others], a[:, others])
    assert pool.lengths[1:] == lengths[1:]


def test_sampling_is_reproducible_per_seed(dense_folder):
    engine = Engine.from_pretrained(dense_folder, device="cpu", progress=False, max_slots=2, max_model_len=128)
    prompt = _prompts(96, [6])[0]
    p = SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.9, top_k=20, seed=11)
    a = engine.generate([prompt], p)[0][0].token_ids
    b = engine.generate([prompt, prompt], [p, SamplingParams(max_new_tokens=12, temperature=1.0, seed=12)])[0][0].token_ids
    assert a == b


def test_verify_ancestor_mask_follows_every_parent_chain():
    """Verify rows see exactly their root path inside the block (trees, chains, width 1)."""
    from deltaflash.core.batch import ancestor_mask

    def walked(parents):
        L, W = parents.shape
        mask = torch.zeros(L, W, W, dtype=torch.bool)
        for lane in range(L):
            for node in range(W):
                m = node
                while m >= 0:
                    mask[lane, node, m] = True
                    m = int(parents[lane, m])
        return mask

    g = torch.Generator().manual_seed(0)
    for W in (1, 2, 5, 16, 33):
        tree = torch.stack([torch.tensor([-1] + [int(torch.randint(-1, n, (1,), generator=g)) for n in range(1, W)])
                            for _ in range(3)])
        chain = (torch.arange(W) - 1)[None]
        for parents in (tree, chain):
            assert torch.equal(ancestor_mask(parents), walked(parents))


def test_extend_batch_packs_live_rows_once():
    """The per-batch tables every GDN layer reuses: live lanes, their valid rows packed in order, offsets."""
    batch = ExtendBatch.build([(4, 0, [1, 2, 3]), (2, 7, [5])], "cpu", pad_lanes_to=3)
    assert batch.live_lanes.tolist() == [0, 1] and batch.live_lanes_host == [0, 1]
    assert batch.packed_rows.tolist() == [0, 1, 2, 3]  # T = 3: lane 0 rows 0..2, lane 1 row 0
    assert batch.cu_seqlens.tolist() == batch.cu_seqlens_host.tolist() == [0, 3, 4]


def test_input_projections_run_as_one_gemm_over_the_loaded_weights(dense_folder):
    """After loading, each layer's input projections are row views of one merged matrix (no second
    copy; checkpoint names unchanged) and the merged GEMM gives each part's own output."""
    from deltaflash.models.layers import MergedProjections

    model = load_model(dense_folder, device="cpu", dtype=torch.float32, progress=False)
    merged = [m for m in model.modules() if isinstance(m, MergedProjections)]
    kinds = {type(m).__name__ for m in merged}
    assert kinds == {"GatedDeltaNet", "GatedAttention", "SwiGLU"}, kinds
    x = torch.randn(2, 3, model.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    for module in merged:
        storage = module.merged_weight.untyped_storage().data_ptr()
        outputs = module.project(x)
        for name, out in zip(module.PROJECTIONS, outputs, strict=True):
            part = getattr(module, name)
            assert part.weight.untyped_storage().data_ptr() == storage, name
            torch.testing.assert_close(out, part(x), rtol=1e-5, atol=1e-6)
    names = set(model.state_dict())
    assert {"layers.0.linear_attn.in_proj_a.weight", "layers.3.self_attn.q_proj.weight",
            "layers.0.mlp.up_proj.weight"} <= names and not any("merged" in n for n in names)


def test_unmerged_projections_are_a_clear_error():
    from deltaflash.models.layers import SwiGLU

    with pytest.raises(RuntimeError, match="merge_projections"):
        SwiGLU(8, 16)(torch.randn(2, 8), reference_kernels())


def test_a_chunk_that_starts_its_sequences_attends_over_its_own_rows(dense_folder):
    """A first prefill chunk (every lane at position 0) runs kernels.prefill_attention on its own K/V and
    reads no page; a later chunk of several lanes reads pages; a later chunk of one lane and 64+ rows
    gathers its context into one dense run for kernels.prefill_attention. The logits match the
    all-pages route (fp32), and the K/V the chunks leave in their pages are the same bits."""
    model = load_model(dense_folder, device="cpu", progress=False)
    base = reference_kernels()
    calls = []

    def counting(q, k, v, scale, fixed_shape=False):
        assert not fixed_shape  # an eager engine's chunks: their shapes vary
        calls.append(q.shape)
        return base.prefill_attention(q, k, v, scale)

    vocab = model.cfg.vocab_size
    first, second = _prompts(vocab, [37, 29], seed=3), _prompts(vocab, [11, 5], seed=4)
    (third,) = _prompts(vocab, [70], seed=5)
    results = {}
    for name, kernels in (("fresh", dataclasses.replace(base, prefill_attention=counting)),
                          ("pages", dataclasses.replace(base, prefill_attention=None))):
        pool = SlotPool(model.cfg, 3, 128, torch.float32, "cpu")
        a, _ = model.extend(ExtendBatch.build([(2, 0, first[0]), (0, 0, first[1])], "cpu", pad_lanes_to=3),
                            pool, kernels, all_logits=True)
        n_fresh = len(calls)
        b, _ = model.extend(ExtendBatch.build([(2, 37, second[0]), (0, 29, second[1])], "cpu"), pool, kernels,
                            all_logits=True)
        assert len(calls) == n_fresh  # the second chunk has committed keys and two lanes: pages
        c, _ = model.extend(ExtendBatch.build([(2, 48, third)], "cpu"), pool, kernels, all_logits=True)
        results[name] = (a, b, c, pool.key_cache.clone(), pool.value_cache.clone())
    layers = len(model.cfg.attn_layer_ids)
    assert [shape[1] for shape in calls] == [37] * layers + [70] * layers  # every attention layer, once a chunk
    (fa, fb, fc, fk, fv), (pa, pb, pc, pk, pv) = results["fresh"], results["pages"]
    assert (fc - pc).abs().max().item() <= 1e-5 * pc.abs().max().item()
    for lane, n in ((0, 37), (1, 29)):
        scale = pa[lane, :n].abs().max().item()
        assert (fa[lane, :n] - pa[lane, :n]).abs().max().item() <= 1e-5 * scale
    assert torch.equal(fk, pk) and torch.equal(fv, pv)
    assert (fb - pb).abs().max().item() <= 1e-5 * pb.abs().max().item()


def test_a_batch_invariant_engine_keeps_prefill_on_the_pages(dense_folder):
    engine = Engine.from_pretrained(dense_folder, device="cpu", progress=False, max_slots=2, max_model_len=128,
                                    batch_invariant=True)
    assert engine.runner.kernels.prefill_attention is None
    plain = Engine.from_pretrained(dense_folder, device="cpu", progress=False, max_slots=2, max_model_len=128)
    assert plain.runner.kernels.prefill_attention is not None


def test_bf16_extend_of_one_row_and_of_a_chunk(dense_folder):
    """The GDN layers' output buffer is the activation dtype: a bf16 chunk and a bf16 one-row extend
    (the recurrent step computes in fp32) both write it, and agree with fp32 to bf16 rounding: within 8%
    of the largest logit in this random model (measured 4.8-5.8% for either; a wrong buffer dtype or a
    lost state write is off by the whole logit range)."""
    logits = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = load_model(dense_folder, device="cpu", dtype=dtype, progress=False)
        pool = SlotPool(model.cfg, 2, 64, dtype, "cpu")
        chunk, _ = model.extend(ExtendBatch.build([(0, 0, [5, 9, 2, 7])], "cpu"), pool, reference_kernels())
        row, _ = model.extend(ExtendBatch.build([(0, 4, [11])], "cpu"), pool, reference_kernels())
        logits[dtype] = (chunk, row)
    for want, got in zip(logits[torch.float32], logits[torch.bfloat16]):
        assert (got.float() - want).abs().max().item() <= 0.08 * want.abs().max().item()


def test_a_later_chunk_reads_pages_past_the_dense_bounds(dense_folder, monkeypatch):
    """A one-lane later chunk runs on pages when its context is longer than dense.MAX_DENSE_KEYS or it
    has fewer than dense.MIN_DENSE_ROWS rows (the gather would cost more than it saves). (Every row's logits:
    otherwise the last layer, this model's one attention layer, attends for each lane's last row alone.)"""
    from deltaflash.ops.attention import dense

    model = load_model(dense_folder, device="cpu", progress=False)
    calls = []
    kernels = dataclasses.replace(reference_kernels(), prefill_attention=lambda *a, **kw: calls.append(a[0].shape[1])
                                  or dense.causal_block_attention(*a, **kw))
    pool = SlotPool(model.cfg, 2, 256, torch.float32, "cpu")
    (prompt,) = _prompts(model.cfg.vocab_size, [200], seed=6)
    model.extend(ExtendBatch.build([(0, 0, prompt[:40])], "cpu"), pool, kernels, all_logits=True)
    monkeypatch.setattr(dense, "MAX_DENSE_KEYS", 100)
    model.extend(ExtendBatch.build([(0, 40, prompt[40:110])], "cpu"), pool, kernels, all_logits=True)  # 110 keys > 100
    monkeypatch.undo()
    model.extend(ExtendBatch.build([(0, 110, prompt[110:140])], "cpu"), pool, kernels, all_logits=True)  # 30 rows < 64
    model.extend(ExtendBatch.build([(0, 140, prompt[140:])], "cpu"), pool, kernels, all_logits=True)  # 60 rows < 64 too
    layers = len(model.cfg.attn_layer_ids)
    assert calls == [40] * layers  # the first chunk only
    model.extend(ExtendBatch.build([(0, 200, [1] * 64)], "cpu"), pool, kernels, all_logits=True)
    assert calls == [40] * layers + [64] * layers  # 64 rows after 200 keys: dense


@pytest.mark.parametrize("last_mixer,kernel_set", [("attention", "reference"), ("gdn", "reference"),
                                                   ("attention", "triton")])
def test_only_each_lanes_last_row_passes_the_last_layers_mixer(dense_folder, tmp_path, last_mixer, kernel_set):
    """A prefill chunk's logits are each lane's last row's: past the last layer's K/V those rows alone are
    computed - that attention layer's queries, its norm and MLP (one row a lane, padding lanes and short lanes
    included) - every row when all rows' logits are asked for or the last layer is tapped; the logits are those
    of the whole forward's last rows (fp32, to the GEMMs' rounding), and the pool is left the same either way."""
    if last_mixer == "gdn":
        dense_folder = save_checkpoint(build_hf_model("dense_gqa", seed=7, layer_types=[
            "linear_attention", "full_attention", "full_attention", "linear_attention"]), tmp_path)
    model = load_model(dense_folder, device="cpu", progress=False)
    assert (last_mixer == "gdn") == model.layers[-1].is_gdn
    mlp_rows, queries = [], []
    hooks = [model.layers[-1].mlp.register_forward_pre_hook(lambda m, args: mlp_rows.append(args[0].shape[:-1]))]
    if last_mixer == "attention":
        hooks.append(model.layers[-1].self_attn.register_forward_hook(
            lambda m, args, out: queries.append(out.shape[:-1])))
    vocab, last = model.cfg.vocab_size, len(model.layers) - 1
    prompts = _prompts(vocab, [23, 9], seed=11)
    try:
        runs = {}
        for name, kwargs in (("last rows", {}), ("all rows", dict(all_logits=True)),
                             ("tapped", dict(tap_layer_ids=(1, last)))):
            pool = SlotPool(model.cfg, 3, 64, torch.float32, "cpu")
            batch = ExtendBatch.build([(2, 0, prompts[0]), (0, 0, prompts[1])], "cpu", pad_lanes_to=3)
            logits, taps = model.extend(batch, pool, kernels_named(kernel_set), **kwargs)
            runs[name] = logits, taps, pool.recurrent_state.clone(), pool.key_cache.clone()
    finally:
        for hook in hooks:
            hook.remove()
    assert mlp_rows == [(3,), (3, 23), (3, 23)]
    assert queries == ([] if last_mixer == "gdn" else [(3, 1), (3, 23), (3, 23)])  # (a GDN layer: every row)
    (trimmed, _, state, keys), (every, _, state_all, keys_all), (tapped, taps, _, _) = runs.values()
    assert trimmed.shape == tapped.shape == (3, vocab) and taps.shape == (3, 23, 2 * model.cfg.hidden_size)
    want = every[torch.arange(2), torch.tensor([22, 8])]  # (the padding lane's logits are nobody's)
    for got in (trimmed, tapped):
        assert (got[:2] - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    assert torch.equal(state, state_all) and torch.equal(keys, keys_all)
