"""Tensor parallelism of the target (deltaflash/parallel/tensor.py), two ranks over gloo on the CPU: the
sharded forwards give the single-process model's logits, and each rank's slot state is its heads' share
of the single model's."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from deltaflash.cache.slots import SlotPool
from deltaflash.config import ModelConfig
from deltaflash.core.batch import ExtendBatch, VerifyBatch
from deltaflash.errors import UnsupportedModelError
from deltaflash.models.loader import load_model
from deltaflash.ops.kernels import reference_kernels
from deltaflash.parallel.tensor import shard_config, shard_model
from tests.checkpoints import build_hf_model, save_checkpoint

PROMPTS = ([5, 17, 3, 44, 9, 21, 60], [8, 2, 71])
DRAFTS = ([30, 12, 7, 55], [1, 90, 4, 33])  # a verify round after the prompts: anchor + 3 drafts per lane


def forwards(model) -> dict[str, torch.Tensor]:
    """A ragged prefill of two prompts, then a chain verify of four rows per lane, on a pool of the model's
    own (sharded) shapes."""
    kernels = reference_kernels()
    pool = SlotPool(model.cfg, 2, 64, torch.float32, "cpu")
    prefill, _ = model.extend(ExtendBatch.build([(i, 0, p) for i, p in enumerate(PROMPTS)], "cpu"), pool, kernels)
    batch = VerifyBatch.chain(torch.tensor(DRAFTS), (0, 1), tuple(len(p) for p in PROMPTS))
    verify = model.verify(batch, pool, kernels)
    return {"prefill": prefill, "verify": verify.logits, "state": pool.recurrent_state.clone(),
            "conv": pool.conv_history.clone(), "keys": pool.key_cache.clone(), "log": verify.replay_log.clone()}


def _rank(rank: int, size: int, target: str, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=size)
    try:
        model = shard_model(load_model(target, device="cpu", dtype=torch.float32, progress=False), rank, size)
        torch.save(forwards(model), f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return save_checkpoint(build_hf_model("dense_gqa", seed=3), tmp_path_factory.mktemp("tp") / "target")


def test_two_ranks_give_the_single_models_logits_and_shares_of_its_state(target, tmp_path):
    size = 2
    mp.spawn(_rank, args=(size, str(target), str(tmp_path / "init"), str(tmp_path)), nprocs=size, join=True)
    single = forwards(load_model(target, device="cpu", dtype=torch.float32, progress=False))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(size)]
    cfg = load_model(target, device="cpu", dtype=torch.float32, progress=False).cfg
    for got in ranks:  # every rank holds the whole residual stream: the same logits
        torch.testing.assert_close(got["prefill"], single["prefill"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got["verify"], single["verify"], rtol=1e-5, atol=1e-5)
    nv, nkv = cfg.linear_num_value_heads // size, cfg.num_kv_heads // size
    kd, vd = cfg.linear_num_key_heads * cfg.linear_key_head_dim, cfg.linear_num_value_heads * cfg.linear_value_head_dim
    for r, got in enumerate(ranks):  # and its heads' share of the slot state and the K/V pages
        torch.testing.assert_close(got["state"], single["state"][:, :, r * nv:(r + 1) * nv], rtol=1e-4, atol=2e-5)
        torch.testing.assert_close(got["log"], single["log"][:, :, :, r * nv:(r + 1) * nv], rtol=1e-4, atol=2e-5)
        torch.testing.assert_close(got["keys"], single["keys"][..., r * nkv:(r + 1) * nkv, :], rtol=1e-4, atol=2e-5)
        q, k, v = (slice(r * kd // size, (r + 1) * kd // size), slice(kd + r * kd // size, kd + (r + 1) * kd // size),
                   slice(2 * kd + r * vd // size, 2 * kd + (r + 1) * vd // size))
        channels = torch.cat([single["conv"][:, :, s] for s in (q, k, v)], dim=2)
        torch.testing.assert_close(got["conv"], channels, rtol=1e-4, atol=2e-5)


def test_shares_must_divide_the_heads_and_moe_is_refused(target, tmp_path):
    cfg = load_model(target, device="cpu", dtype=torch.float32, progress=False).cfg
    assert shard_config(cfg, 2).linear_num_value_heads == cfg.linear_num_value_heads // 2
    with pytest.raises(UnsupportedModelError, match="does not divide num_heads 4, num_kv_heads 2"):
        shard_config(cfg, 3)
    moe = ModelConfig.from_folder(save_checkpoint(build_hf_model("moe"), tmp_path / "moe"))
    with pytest.raises(UnsupportedModelError, match="MoE"):
        shard_config(moe, 2)
