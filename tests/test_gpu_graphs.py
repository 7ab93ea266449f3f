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
                       start_host=tuple(starts))


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
