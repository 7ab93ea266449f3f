"""`bench model`'s time-to-first-token table on a tiny model (the CPU runs it; the figures come from the H200)."""

from __future__ import annotations

import torch

from deltaflash.bench.model import transformers_twin, ttft_rows
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
    assert rows[1]["compute_limit_ms"] > rows[0]["compute_limit_ms"]  # FLOPs grow with the prompt

