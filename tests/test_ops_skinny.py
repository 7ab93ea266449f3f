"""ops/gemm/skinny.py: the split-K skinny GEMM against F.linear in fp64 (CPU under TRITON_INTERPRET=1, or
CUDA) on awkward shapes and tiles, its table's dispatch, and an engine whose rounds' products go through it."""

import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from deltaflash.core.request import SamplingParams
from deltaflash.engine.config import EngineConfig
from deltaflash.errors import DeltaflashError
from deltaflash.models.dflash import load_drafter
from deltaflash.models.layers import RoutedLinear, product_weights
from deltaflash.ops.gemm import skinny
from deltaflash.ops.gemm.skinny import MAX_ROWS, SkinnyGemms, SkinnyTile, bundled_table, skinny_linear, table_key
from tests.spec_pairs import engine_for, make_pair, prompts
from tests.test_ops_gemm import DEVICE, HALF, INTERPRETED, operands  # the GEMM tests' device and operands

pytestmark = pytest.mark.skipif(not INTERPRETED and not torch.cuda.is_available(),
                                reason="kernel tests need TRITON_INTERPRET=1 before import, or CUDA")


def reference(x, w, b):
    return F.linear(x.double(), w.double(), None if b is None else b.double())


TILES = [SkinnyTile(16, 32), SkinnyTile(32, 16, split=3, warps=2), SkinnyTile(16, 64, split=2, stages=2),
         SkinnyTile(64, 16, split=40)]  # the last asks for more stretches than K has steps


@pytest.mark.parametrize("M,K,N", [(1, 64, 48), (5, 100, 70), (16, 96, 16), (33, 80, 40), (64, 48, 24)])
@pytest.mark.parametrize("tile", TILES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, HALF], ids=["fp32", "half"])
def test_matches_f_linear(M, K, N, tile, dtype):
    x, w, b = operands(M, K, N, dtype, bias=M % 2 == 1)
    got = skinny_linear(x, w, b, tile)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    assert got.shape == (M, N) and got.dtype == dtype
    torch.testing.assert_close(got.double(), reference(x, w, b), **tol)


def test_split_k_sums_in_split_order():
    """Three stretches of K: the output is ((p0 + p1) + p2) of the fp32 partial products, the same bits every
    call (no atomics)."""
    x, w, b = operands(7, 96, 40, torch.float32, True, seed=3)
    tile = SkinnyTile(16, 32, split=3)
    got = skinny_linear(x, w, b, tile)
    parts = [skinny_linear(x[:, k:k + 32].contiguous(), w[:, k:k + 32].contiguous(), None, SkinnyTile(16, 32))
             for k in (0, 32, 64)]
    assert torch.equal(got, ((parts[0] + parts[1]) + parts[2]) + b)
    assert all(torch.equal(skinny_linear(x, w, b, tile), got) for _ in range(2))


def test_leading_dims_strided_rows_and_bad_calls():
    x, w, b = operands(24, 64, 32, torch.float32, True)
    tile = SkinnyTile(16, 32, split=2)
    x3 = x.view(2, 12, 64)
    torch.testing.assert_close(skinny_linear(x3, w, b, tile).double(), reference(x3, w, b), rtol=1e-5, atol=1e-5)
    wide = torch.randn(24, 128, device=DEVICE)[:, :64]  # rows with a stride
    torch.testing.assert_close(skinny_linear(wide, w, None, tile).double(), reference(wide, w, None),
                               rtol=1e-5, atol=1e-5)
    assert skinny_linear(x[:0], w, b, tile).shape == (0, 32)
    with pytest.raises(ValueError, match="one dtype"):
        skinny_linear(x.half(), w, None, tile)
    with pytest.raises(ValueError, match=f"at most {MAX_ROWS} rows"):
        skinny_linear(torch.randn(MAX_ROWS + 1, 64, device=DEVICE), w, None, tile)
    with pytest.raises(ValueError, match="at least 16"):
        skinny_linear(x, w, None, SkinnyTile(8, 32))


def test_table_routes_only_the_calls_it_has_tiles_for(monkeypatch):
    """A call goes to the kernel when the table has its (N, K, dtype, row bucket), else to F.linear (more
    than MAX_ROWS rows, another shape, another bucket); save / load keep the table."""
    tile = SkinnyTile(16, 32, split=2)
    gemms = SkinnyGemms("test", {table_key(32, 64, torch.float32, 8): tile})
    assert table_key(32, 64, torch.float32, 5) == table_key(32, 64, torch.float32, 8) == "32x64:float32:8"
    calls = []
    real = skinny.skinny_linear
    monkeypatch.setattr(skinny, "skinny_linear", lambda *a: calls.append(a[3]) or real(*a))
    x, w, b = operands(70, 64, 32, torch.float32, True)
    for rows, routed in ((5, True), (8, True), (4, False), (9, False), (70, False)):
        calls.clear()
        got = gemms.linear(x[:rows], w, b)
        torch.testing.assert_close(got.double(), reference(x[:rows], w, b), rtol=1e-5, atol=1e-5)
        assert calls == ([tile] if routed else []), rows
    calls.clear()
    gemms.linear(x[:5, :48].contiguous(), w[:, :48].contiguous())  # another K
    assert calls == []
    with tempfile.TemporaryDirectory() as tmp:
        gemms.save(Path(tmp, "t.json"))
        assert SkinnyGemms.load(Path(tmp, "t.json")) == gemms
        Path(tmp, "bad.json").write_text('{"tiles": {}}')
        with pytest.raises(ValueError, match="bad.json: not a skinny GEMM table"):
            SkinnyGemms.load(Path(tmp, "bad.json"))


def test_config_resolves_the_table():
    """auto: the table shipped for the CUDA device, off elsewhere; a path is checked at resolve; the
    batch-invariant GEMM excludes it."""
    cpu = torch.device("cpu")
    assert EngineConfig().resolve(cpu, None).skinny_gemm == "off"
    assert bundled_table("No Such GPU 9000") is None
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "t.json")
        SkinnyGemms("test", {}).save(path)
        env = {"TRITON_INTERPRET": "1"}
        assert EngineConfig(skinny_gemm=str(path)).resolve(cpu, None, env=env).skinny_gemm == str(path)
        with pytest.raises(DeltaflashError, match="need a CUDA device"):
            EngineConfig(skinny_gemm=str(path)).resolve(cpu, None, env={})
        with pytest.raises(DeltaflashError, match="exclude each other"):
            EngineConfig(skinny_gemm=str(path), batch_invariant=True).resolve(cpu, None, env=env)
        with pytest.raises(DeltaflashError, match="not a skinny GEMM table"):
            EngineConfig(skinny_gemm=str(Path(tmp, "missing.json"))).resolve(cpu, None, env=env)


def test_every_shipped_table_loads_and_is_found_by_its_devices_name():
    """Each tiles/*.json that ships is a table, found under the name of the device it was tuned on, with
    tiles the kernel takes (K a multiple of BK: its keys' K; BK and BN powers of two)."""
    from deltaflash.ops.gemm.skinny import TABLES

    shipped = sorted(TABLES.glob("*.json"))
    assert any(p.stem == "nvidia-h100-80gb-hbm3" for p in shipped)
    for path in shipped:
        table = SkinnyGemms.load(path)
        assert bundled_table(table.device) == path, path
        for key, tile in table.tiles.items():
            k = int(key.split(":")[0].split("x")[1])
            assert k % tile.block_k == 0 and tile.block_k & (tile.block_k - 1) == 0, (path, key)
            assert tile.block_n & (tile.block_n - 1) == 0 and tile.split >= 1, (path, key)


@pytest.mark.skipif(not INTERPRETED, reason="the engine test runs on the CPU interpreter")
def test_an_engine_routes_its_round_products_through_the_table(monkeypatch):
    """An engine given a table runs the target's and the drafter's few-row products through the kernel
    (counted) and its greedy speculative output equals target-only output (fp32, IEEE sums on both sides)."""
    with tempfile.TemporaryDirectory() as tmp:
        target, draft = make_pair(Path(tmp), kind="dense_gqa")
        plain = engine_for(target, max_model_len=64)
        batch = prompts(96, [5, 9, 3], seed=2)
        params = SamplingParams(max_new_tokens=10, ignore_eos=True)
        want = [c.token_ids for c in plain.generate(batch, params)[0]]
        model = plain.runner.model
        drafter = load_drafter(draft, target_hidden_size=model.cfg.hidden_size, target_vocab_size=model.cfg.vocab_size,
                               target_num_layers=model.cfg.num_layers, dtype=torch.float32)
        shapes = {tuple(w.shape) for w in product_weights(model) + product_weights(drafter)}
        assert tuple(model.lm_head_weight.shape) in shapes
        tile = SkinnyTile(16, 32, split=2)
        table = {table_key(n, k, torch.float32, rows): tile for n, k in shapes for rows in (1, 2, 4, 8, 16, 32, 64)}
        path = Path(tmp, "tiles.json")
        SkinnyGemms("test", table).save(path)
        calls = []
        real = skinny.skinny_linear
        monkeypatch.setattr(skinny, "skinny_linear", lambda *a: calls.append(a[1].shape) or real(*a))
        spec = engine_for(target, draft, max_model_len=64, skinny_gemm=str(path))
        drafter = spec.runner.source.drafter
        assert all(any(isinstance(m, RoutedLinear) and m.product == spec.runner.model.linear for m in module.modules())
                   for module in (spec.runner.model, drafter))
        got = [c.token_ids for c in spec.generate(batch, params)[0]]
        assert got == want
        shapes_called = {tuple(shape) for shape in calls}
        assert tuple(model.lm_head_weight.shape) in shapes_called and tuple(drafter.fc.weight.shape) in shapes_called


def test_routed_products_are_restored_to_f_linear():
    """route_products points every product (nn.Linear layers and modules' `linear`) at a GEMM and back: a
    runner given a model an earlier engine routed restores F.linear when its own config asks for cuBLAS."""
    from deltaflash.models.layers import is_routed, route_products
    from deltaflash.models.qwen3_5 import Qwen35Model
    from deltaflash.models.random_init import toy_config

    model = Qwen35Model(toy_config(2)).merge_projections()
    assert not is_routed(model)
    gemms = SkinnyGemms("test", {})
    route_products(model, gemms.linear)
    assert is_routed(model) and model.linear == gemms.linear and model.layers[0].mlp.linear == gemms.linear
    assert all(m.product == gemms.linear for m in model.modules() if isinstance(m, RoutedLinear))
    route_products(model, F.linear)
    routed = [m for m in model.modules() if isinstance(m, RoutedLinear)]
    assert model.linear is F.linear and routed and all(m.product is F.linear for m in routed)
    out_proj = model.layers[0].linear_attn.out_proj
    x = torch.randn(3, out_proj.in_features)
    assert torch.equal(out_proj(x), F.linear(x, out_proj.weight))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_product_weights_are_one_forwards_products(tied):
    """The 9B shape (4 layers, on the meta device): four products a layer (merged input projections, their
    output, the MLP's merged gate/up and down) and the lm_head - every matrix of the model but the embedding
    table, each once (a tied model's lm_head is its embedding)."""
    import dataclasses

    from deltaflash.models.qwen3_5 import Qwen35Model
    from deltaflash.models.random_init import qwen35_9b_config

    cfg = dataclasses.replace(qwen35_9b_config(4), tie_word_embeddings=tied)
    with torch.device("meta"):
        model = Qwen35Model(cfg)
    model.merge_projections()
    weights = product_weights(model)
    matrices = [p for name, p in model.named_parameters() if p.dim() == 2 and name != "embed_tokens.weight"]
    assert len(weights) == 4 * 4 + 1 and (4096, 12288) in {tuple(w.shape) for w in weights}
    embedding = model.embed_tokens.weight.numel()
    assert sum(w.numel() for w in weights) == sum(p.numel() for p in matrices) + tied * embedding
    assert weights[-1] is (model.embed_tokens.weight if tied else model.lm_head.weight)


@pytest.mark.skipif(INTERPRETED or not torch.cuda.is_available(), reason="CUDA graphs")
def test_graph_replayed_rounds_through_the_table_equal_eager_ones_and_stay_lossless(tmp_path, monkeypatch):
    """On CUDA, a table routing every product of a tiny fp32 target: a verify replayed from its CUDA graph (the
    kernels and their split-K workspace captured) gives the eager forward's bits, and greedy speculation from
    scripted drafts equals target-only decoding through the same table."""
    from deltaflash.engine.engine import Engine
    from deltaflash.models.loader import load_model
    from deltaflash.speculative.sources import ScriptedSource
    from tests.checkpoints import build_hf_model, save_checkpoint
    from tests import spec_pairs
    from tests.spec_pairs import assert_greedy_equal, give_pages
    from tests.test_gpu_graphs import decoding

    folder = save_checkpoint(build_hf_model("dense_gqa", seed=6), tmp_path / "target")
    model = load_model(folder, device="cuda", dtype=torch.float32, progress=False)
    tile = SkinnyTile(32, 64, split=2)
    table = {table_key(n, k, torch.float32, rows): tile
             for n, k in {tuple(w.shape) for w in product_weights(model)} for rows in (1, 2, 4, 8, 16, 32, 64)}
    SkinnyGemms("test", table).save(tmp_path / "tiles.json")
    config = EngineConfig(max_slots=6, max_model_len=128, skinny_gemm=str(tmp_path / "tiles.json"))

    engine = Engine(model, config=config, draft_source=ScriptedSource({}, 5, 96))
    assert engine.runner.graphs is not None and any(isinstance(m, RoutedLinear) for m in model.modules())
    seqs = decoding(engine, [[5, 6, 7], list(range(1, 30)), list(range(40, 51))])
    for s in seqs:
        give_pages(engine, s.slot, s.position + 5)
    ids = torch.randint(0, 96, (3, 5), generator=torch.Generator().manual_seed(0)).cuda()
    slot_ids = torch.tensor([s.slot for s in seqs], device="cuda")
    start = torch.tensor([s.position for s in seqs], device="cuda")
    with torch.inference_mode():
        graphed = engine.runner.verify(ids, slot_ids, start, kmax=max(s.position for s in seqs) + 5).logits.clone()
        padding = slot_ids.new_full((1,), -1)  # the graph's 4-lane bucket, eagerly
        eager = engine.runner._verify_rows(torch.cat([ids, ids[:1]]), torch.cat([slot_ids, padding]),
                                           torch.cat([start, start[:1] * 0]))[0]
    assert torch.equal(graphed, eager[:3])
    del engine

    g = torch.Generator().manual_seed(3)
    batch = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (4, 19, 33, 8)]
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    want = [c.token_ids for c in Engine(model, config=config).generate(batch, params)[0]]
    scripts = {tuple(p): e for p, e in zip(batch, want)}
    spec = Engine(model, config=config, draft_source=ScriptedSource(scripts, 8, 96, corrupt=0.1, seed=1))
    got = [c.token_ids for c in spec.generate(batch, params)[0]]
    monkeypatch.setattr(spec_pairs, "DEVICE", "cuda")  # where the outputs part, only at a near-tie (the GPU rule)
    assert_greedy_equal(folder, batch, got, want)
