"""CUDA-graph replay of the verify round equals eager execution; fused route end to end (GPU only)."""

import pytest
import torch

from deltaflash.engine.batch import VerifyBatch
from deltaflash.engine.engine import Engine, EngineConfig
from deltaflash.engine.graphs import VerifyGraphRunner
from deltaflash.engine.request import SamplingParams
from deltaflash.models.loader import load_model
from deltaflash.ops.verify_route import fused_ops
from deltaflash.spec.sources import ScriptedSource
from tests.checkpoints import build_hf_model, save_checkpoint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_checkpoint(build_hf_model("dense_gqa", seed=6), tmp_path_factory.mktemp("graphs"))


def _batch(slots, starts, W, vocab, lanes_total=None):
    g = torch.Generator().manual_seed(len(slots))
    L = lanes_total or len(slots)
    slots = list(slots) + [-1] * (L - len(slots))
    starts = list(starts) + [0] * (L - len(starts))
    chain = torch.arange(W)
    start = torch.tensor(starts)
    return VerifyBatch(input_ids=torch.randint(0, vocab, (L, W), generator=g).cuda(),
                       parents=(chain - 1).expand(L, W).contiguous().cuda(), positions=(start[:, None] + chain).cuda(),
                       slot_ids=torch.tensor(slots).cuda(), start=start.cuda(), slot_ids_host=tuple(slots),
                       start_host=tuple(starts), chain_host=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_graph_replay_equals_eager(folder, dtype):
    model = load_model(folder, device="cuda", dtype=dtype, progress=False)
    engine = Engine(model, config=EngineConfig(max_slots=6, max_model_len=128))
    prompts = [[5, 6, 7], list(range(1, 30)), list(range(40, 51))]
    slots = []
    for p in prompts:
        engine.add_request(p, SamplingParams(max_new_tokens=50))
    while engine.waiting or any(s.num_prefilled < len(s.prompt_ids) for s in engine.running.values()):
        engine.step()
    seqs = list(engine.running.values())
    slots, starts = [s.slot for s in seqs][::-1], [s.position for s in seqs][::-1]  # permuted lanes
    W = 5
    runner = VerifyGraphRunner(model, engine.pool, fused_ops(), W)
    before = [t.clone() for t in (engine.pool.recurrent_state, engine.pool.conv_history)]
    graphed = runner.run(_batch(slots, starts, W, 96))  # bucket 4: one padding lane
    graphed = [t.clone() for t in (graphed.logits, graphed.conv_windows, graphed.replay_log)]
    eager = model.verify(_batch(slots, starts, W, 96, lanes_total=4), engine.pool, fused_ops(), kmax=engine.pool.max_len)
    assert torch.equal(graphed[0], eager.logits[:3])
    assert torch.equal(graphed[1], eager.conv_windows[:, :3])
    assert torch.equal(graphed[2], eager.replay_log[:, :3])
    assert torch.equal(before[0], engine.pool.recurrent_state) and torch.equal(before[1], engine.pool.conv_history)
    again = runner.run(_batch(slots, starts, W, 96))
    assert torch.equal(again.logits, graphed[0])


def test_fused_route_with_graphs_is_lossless(folder):
    model = load_model(folder, device="cuda", dtype=torch.float32, progress=False)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (4, 19, 33, 8, 60)]
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    plain = Engine(model, config=EngineConfig(max_slots=8, max_model_len=256))
    expected = [c.token_ids for c in plain.generate(prompts, params)[0]]
    scripts = {tuple(p): e for p, e in zip(prompts[:3], expected[:3])}
    engine = Engine(model, config=EngineConfig(max_slots=8, max_model_len=256),
                    draft_source=ScriptedSource(scripts, 8, 96, corrupt=0.1, seed=1))
    assert engine.speculator.graphs is not None and engine.speculator.verify_ops.name == "fused"
    done = [c.token_ids for c in engine.generate(prompts, params)[0]]
    assert done == expected


def test_drafter_graphs_are_lossless_and_match_eager_drafting(tmp_path):
    """A DFlash drafter on CUDA drafts from graphs (block forward, context append); output stays lossless,
    and a graph-replayed block equals the eager block over the same context up to fp32 rounding."""
    from deltaflash.models.dflash import load_drafter
    from tests.spec_pairs import make_pair

    target_dir, draft_dir = make_pair(tmp_path, "dense_gqa", "dflash", seed=1)
    model = load_model(target_dir, device="cuda", dtype=torch.float32, progress=False)
    drafter = load_drafter(draft_dir, target_hidden_size=model.cfg.hidden_size, target_vocab_size=model.cfg.vocab_size,
                           target_num_layers=model.cfg.num_layers, dtype=torch.float32, device="cuda")
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (5, 23, 40)]
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    config = EngineConfig(max_slots=4, max_model_len=256)
    expected = [c.token_ids for c in Engine(model, config=config).generate(prompts, params)[0]]
    spec = Engine(model, None, drafter, config)
    source = spec.speculator.source
    assert source.block_graphs is not None and source.append_graphs is not None
    assert [c.token_ids for c in spec.generate(prompts, params)[0]] == expected

    for p in prompts:  # fresh sequences past prefill, then one block both ways
        spec.add_request(p, SamplingParams(max_new_tokens=8, ignore_eos=True))
    spec.step()
    seqs = list(spec.running.values())
    slot_ids = torch.tensor([s.slot for s in seqs], device="cuda")
    anchors = torch.tensor([s.pending for s in seqs], device="cuda")
    start = torch.tensor([s.position for s in seqs], device="cuda")
    with torch.inference_mode():  # as the engine drafts (the graphs' static buffers are inference tensors)
        graphed = [t.clone() for t in source.block_graphs.run(slot_ids, anchors, start)]
        eager = source._block_logits(slot_ids, anchors, start, max(s.position for s in seqs))
    for a, b in zip(graphed, eager):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
