"""Per-lane acceptance of a verified draft (DESIGN.md §4).

Greedy: accept while d_{n+1} == argmax(target row n); the bonus is the argmax at the first
mismatching (or last) row, so the output equals target-only greedy decoding.
Sampling: standard speculative rejection sampling — accept d with probability min(1, p(d)/q(d));
on rejection draw from norm(max(p - q, 0)); after a fully accepted draft the bonus is drawn from p.
The result is distributed exactly as target-only sampling with the same parameters.
"""

from __future__ import annotations

import torch

from deltaflash.engine.request import SamplingParams
from deltaflash.spec.sampling import draw, request_probs


def accept_greedy(logits: torch.Tensor, drafts: torch.Tensor, lanes: list[int], n_draft: list[int]):
    """logits [L, W, V]; drafts [L, W-1]; returns {lane: (accepted drafts, bonus token)} for `lanes`.
    One host sync for all lanes."""
    if not lanes:
        return {}
    target = logits.argmax(-1)  # [L, W]
    matched = (drafts == target[:, :-1]).int().cumprod(dim=1).sum(dim=1)
    target_host, matched_host = target.tolist(), matched.tolist()
    result = {}
    for lane in lanes:
        n = min(matched_host[lane], n_draft[lane])
        result[lane] = (n, target_host[lane][n])
    return result


def accept_sampled(logits: torch.Tensor, drafts: torch.Tensor, draft_probs: torch.Tensor | None,
                   params: SamplingParams, generator: torch.Generator | None, n_draft: int) -> tuple[int, int]:
    """One lane. logits [W, V] target rows; drafts [W-1]; draft_probs q [W-1, V] the drafts were drawn
    from (None: drawn deterministically, q is one-hot). Returns (accepted drafts, next token)."""
    p = request_probs(logits, params)  # [W, V]
    draft_list = drafts.tolist()
    for n in range(n_draft):
        d = draft_list[n]
        p_d = float(p[n, d])
        q_d = 1.0 if draft_probs is None else float(draft_probs[n, d])
        u = float(torch.rand((), generator=generator, device=p.device))
        if u * q_d < p_d:
            continue
        if draft_probs is None:
            residual = p[n].clone()
            residual[d] = 0.0
        else:
            residual = (p[n] - draft_probs[n]).clamp(min=0.0)
        total = float(residual.sum())
        residual = residual / total if total > 0 else p[n]
        return n, draw(residual, generator)
    return n_draft, draw(p[n_draft], generator)
