"""`bench model`'s time-to-first-token table on a tiny model (the CPU runs it; the figures come from the H200)."""

from __future__ import annotations

import torch

from deltaflash.bench.model import last_row_weights, prefill_flops, transformers_twin, ttft_rows
from deltaflash.models.loader import load_model
from tests.checkpoints import build_hf_model, save_checkpoint


def test_ttft_table_times_the_engine_and_transformers_against_the_compute_limit(tmp_path):
    model = load_model(save_checkpoint(build_hf_model("dense_gqa"), tmp_path / "target"), device="cpu",
                       dtype=torch.float32, progress=False)
    rows = ttft_rows(model, transformers_twin(model), [3, 70], limit_ms=1e-3, gen=torch.Generator().manual_seed(0))
    assert [r["prompt_tokens"] for r in rows] == [3, 70]
    for r in rows:
        assert r["deltaflash_ms"] > 0 and r["budget_chunks_ms"] > 0 and r["transformers_ms"] > 0
        assert r["compute_limit_ms"] >= 1e-3
        assert r["deltaflash_x_limit"] == r["deltaflash_ms"] / r["compute_limit_ms"]
        assert r["deltaflash_x_last_row_limit"] == r["deltaflash_ms"] / r["last_row_limit_ms"]
    assert rows[1]["compute_limit_ms"] > rows[0]["compute_limit_ms"]  # FLOPs grow with the prompt
    assert rows[1]["last_row_limit_ms"] < rows[1]["compute_limit_ms"]


def test_the_least_prefill_flops_count_the_last_layers_rowwise_work_once(tmp_path):
    """The last layer (attention here) past its K/V for the last row alone: its MLP, query / gate and output
    projections once, one query's attention - the rest of the forward for every row."""
    model = load_model(save_checkpoint(build_hf_model("dense_gqa"), tmp_path / "target"), device="cpu",
                       dtype=torch.float32, progress=False)
    cfg, layer = model.cfg, model.layers[-1]
    assert not layer.is_gdn
    H, inter, nh, hd = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.head_dim
    assert last_row_weights(model) == 3 * H * inter + nh * 2 * hd * H + nh * hd * H  # MLP, q | gate, o (not k, v)
    T, read_bytes = 100, 10 ** 7
    whole, least = prefill_flops(cfg, T, read_bytes), prefill_flops(cfg, T, read_bytes, last_row_weights(model))
    one_query = 2 * T * nh * hd * (T - 2)  # the last layer's causal attention against one query's
    assert whole - least == 2 * (T - 1) * last_row_weights(model) + one_query

