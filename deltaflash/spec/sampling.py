"""Turning logits into tokens: greedy, temperature / top-k / top-p sampling, one RNG per request."""

from __future__ import annotations

import torch

from deltaflash.engine.request import SamplingParams


def sampling_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """q [..., V] fp32 from logits [..., V]: softmax(logits / T) over the top_k, then the top_p nucleus
    (tokens whose preceding mass is < top_p), renormalised."""
    scores = logits.float() / temperature
    kept = None
    if 0 < top_k < scores.shape[-1]:
        scores, kept = scores.topk(top_k, dim=-1)
    probs = scores.softmax(dim=-1)
    if top_p < 1.0:
        ordered, order = probs.sort(dim=-1, descending=True)
        ordered = ordered * (ordered.cumsum(dim=-1) - ordered < top_p)
        probs = torch.zeros_like(probs).scatter(-1, order, ordered)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    if kept is not None:
        probs = torch.zeros_like(logits, dtype=probs.dtype).scatter(-1, kept, probs)
    return probs


def request_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a request samples from (sampling_probs with its settings)."""
    return sampling_probs(logits, params.temperature, params.top_p, params.top_k)


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from a [V] distribution."""
    return int(torch.multinomial(probs, 1, generator=generator).item())


def sample_rows(logits: torch.Tensor, params: list[SamplingParams], generators: list) -> list[int]:
    """logits [L, V] -> one token per row; greedy rows share one argmax (one host sync)."""
    tokens = logits.argmax(-1).tolist()
    for i, p in enumerate(params):
        if not p.greedy:
            tokens[i] = draw(request_probs(logits[i], p), generators[i])
    return tokens


def make_generator(params: SamplingParams, device) -> torch.Generator | None:
    if params.greedy:
        return None
    gen = torch.Generator(device=device)
    if params.seed is None:
        gen.seed()
    else:
        gen.manual_seed(params.seed)
    return gen
