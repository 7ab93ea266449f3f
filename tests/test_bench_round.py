"""`bench round`'s engines: lanes past prefill, with their prompts computed or left unwritten."""

from __future__ import annotations

import torch

from deltaflash.bench.round import decoding_engine, round_ms
from deltaflash.cache.pages import pages_for
from deltaflash.models.random_init import SHAPES, random_model


def test_an_unwritten_context_takes_the_pages_and_lengths_of_a_computed_one():
    model = random_model(SHAPES["toy"](), torch.float32, "cpu")
    engines = [decoding_engine(model, 2, 4, 70, 256, "reference", unwritten=u) for u in (False, True)]
    computed, unwritten = ([(s.slot, s.position, e.runner.pool.lengths[s.slot]) for s in e.scheduler.running.values()]
                           for e in engines)
    assert computed == unwritten and all(p == 70 == n for _, p, n in unwritten)
    page = engines[1].config.page_size
    assert engines[1].scheduler.pages.num_used == engines[0].scheduler.pages.num_used >= 2 * pages_for(70, page)
    assert "extend" not in vars(engines[1].runner.model)  # the model computes again after the fill
    assert round_ms(engines[1], 1) > 0  # and rounds run on the unwritten context
    assert all(s.position > 70 for s in engines[1].scheduler.running.values())
