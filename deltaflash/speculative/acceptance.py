"""Acceptance of verified chains for all lanes at once, on the device (DESIGN.md §4).

Lane l verified rows [anchor, d_1 .. d_{W-1}] and may accept up to n_draft[l] of its drafts.
- Greedy lanes: accept while d_{n+1} == argmax(target row n); the next token is the argmax at the
  first mismatching (or last allowed) row, so the output equals target-only greedy decoding.
- Sampled lanes: speculative rejection sampling - accept d with probability min(1, p(d) / q(d)) (q
  one-hot for deterministic drafts); at the first rejection draw from norm(max(p - q, 0)), after the
  last allowed draft draw from p. Distributed exactly as target-only sampling with the same settings.
Plain decoding is the same rule with n_draft = 0: the next token is drawn from row 0.
Every row is first turned into the logits its request samples from (LogitRules: penalties, bias,
min_tokens, grammar), for that row's own history, so the rules hold with and without speculation.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from deltaflash.speculative.logit_rules import LogitRules
from deltaflash.speculative.sampling import (
    STREAM_ACCEPT, STREAM_TOKEN, LaneSampling, lane_probs, sample_from, uniform_noise,
)


@dataclass(frozen=True)
class Accepted:
    """counts [L] long: drafts accepted per lane; tokens [L, W] long: the tokens each lane emits are
    tokens[l, :counts[l] + 1] (its accepted drafts, then the next token). With logprobs asked for:
    logprobs [L, W] fp32, the log probability of tokens[l, n] under the model's row n (raw logits,
    before any rule or temperature); top_ids / top_logprobs [L, W, k] the row's k most likely tokens."""

    counts: Tensor
    tokens: Tensor
    logprobs: Tensor | None = None
    top_ids: Tensor | None = None
    top_logprobs: Tensor | None = None
    path: Tensor | None = None  # trees (speculative/tree.py): [L, W] node ids, the root first; chains: None


def accept(logits: Tensor | None, drafts: Tensor, draft_q: Tensor | None, n_draft: Tensor,
           sampling: LaneSampling, rules: LogitRules | None = None, top_logprobs: int | None = None,
           argmax: Tensor | None = None) -> Accepted:
    """logits [L, W, V] fp32 raw target rows; drafts [L, W-1] long; draft_q [L, W-1, V] fp32, the q each
    draft was drawn from (None: deterministic drafts); n_draft [L] long in 0..W-1; rules: the lanes'
    LogitRules (None: none); top_logprobs: None, or k >= 0 to report logprobs. `argmax` [L, W]: the rows'
    argmax found without the whole rows (a tensor-parallel vocabulary: models/vocab.py), for all-greedy
    lanes with no rules and no logprobs; logits are then not needed. No host sync."""
    if argmax is not None:
        if not sampling.all_greedy or rules is not None or top_logprobs is not None:
            raise ValueError("argmax alone serves greedy lanes without logit rules or logprobs")
        return _greedy(argmax, drafts, n_draft)
    raw = logits
    if rules is not None:
        logits = rules.apply(logits, drafts)
    accepted = _greedy(logits.argmax(dim=-1), drafts, n_draft)
    if not sampling.all_greedy:
        allowed = torch.arange(drafts.shape[1], device=logits.device)[None] < n_draft[:, None]  # [L, W-1]
        sampled_counts, sampled_next = _rejection_sample(logits, drafts, draft_q, allowed, sampling)
        counts = torch.where(sampling.greedy, accepted.counts, sampled_counts)
        greedy_next = accepted.tokens.gather(1, accepted.counts[:, None])[:, 0]
        accepted = Accepted(counts=counts, tokens=_emitted(drafts, counts, torch.where(sampling.greedy, greedy_next,
                                                                                        sampled_next)))
    return accepted if top_logprobs is None else with_logprobs(accepted, raw, top_logprobs)


def _greedy(argmax: Tensor, drafts: Tensor, n_draft: Tensor) -> Accepted:
    """Greedy acceptance from the target's argmax [L, W]: the drafts up to the first that differs from
    the argmax at its row (at most n_draft of them), then the argmax after them."""
    W = argmax.shape[1]
    if W == 1:  # plain decoding: the argmax is the token
        return Accepted(counts=n_draft.new_zeros(argmax.shape[0]), tokens=argmax)
    allowed = torch.arange(W - 1, device=argmax.device)[None] < n_draft[:, None]  # [L, W-1]
    counts = ((drafts == argmax[:, :-1]) & allowed).long().cumprod(dim=1).sum(dim=1)
    next_token = argmax.gather(1, counts[:, None])[:, 0]
    return Accepted(counts=counts, tokens=_emitted(drafts, counts, next_token))


def _emitted(drafts: Tensor, counts: Tensor, next_token: Tensor) -> Tensor:
    """[L, W]: the accepted drafts, then the next token at index counts (the rest: ignored)."""
    return torch.cat([drafts, drafts.new_zeros(drafts.shape[0], 1)], dim=1).scatter_(1, counts[:, None],
                                                                                     next_token[:, None])


def with_logprobs(accepted: Accepted, rows: Tensor, top_logprobs: int) -> Accepted:
    """`accepted` with the logprobs of its tokens: rows [L, W, V] raw target logits, row n the one
    tokens[:, n] was chosen at; k = top_logprobs most likely tokens per row (0: none)."""
    logprobs, top_ids, top_values, _ = token_logprobs(rows, accepted.tokens, top_logprobs)
    return replace(accepted, logprobs=logprobs, top_ids=top_ids, top_logprobs=top_values)


def token_logprobs(rows: Tensor, tokens: Tensor, k: int, ranks: bool = False):
    """(log probability of tokens [...] under rows [..., V] of raw logits, fp32; the ids and log probabilities
    [..., k] of each row's k most likely tokens, most likely first (every token where V < k), or None for k = 0;
    with `ranks` each token's rank in its row [...] - 1 + the tokens likelier than it - else None)."""
    log_p = rows.float().log_softmax(dim=-1)
    top = log_p.topk(min(k, log_p.shape[-1]), dim=-1) if k > 0 else None
    chosen = log_p.gather(-1, tokens[..., None])
    rank = (log_p > chosen).sum(-1) + 1 if ranks else None
    return chosen[..., 0], None if top is None else top.indices, None if top is None else top.values, rank


def _rejection_sample(logits, drafts, draft_q, allowed, sampling: LaneSampling) -> tuple[Tensor, Tensor]:
    """(accepted drafts [L], next token [L]) by speculative rejection sampling, every lane."""
    L, W, _ = logits.shape
    p = lane_probs(logits, sampling)  # [L, W, V]
    if W == 1:
        return allowed.new_zeros(L, dtype=torch.long), sample_from(p[:, 0], sampling.stream(STREAM_TOKEN))
    p_draft = p[:, :-1].gather(-1, drafts[..., None])[..., 0]  # [L, W-1]
    q_draft = torch.ones_like(p_draft) if draft_q is None else draft_q.gather(-1, drafts[..., None])[..., 0]
    u = uniform_noise(sampling.stream(STREAM_ACCEPT), (L, W - 1))
    counts = ((u * q_draft < p_draft) & allowed).long().cumprod(dim=1).sum(dim=1)  # [L]
    lanes = torch.arange(L, device=logits.device)
    target = p[lanes, counts]  # [L, V]: the row the next token comes from
    at = counts.clamp(max=W - 2)  # the rejected draft's index (meaningful where rejected)
    if draft_q is None:  # q one-hot on the rejected draft: the residual is p without that token
        residual = target.scatter(1, drafts[lanes, at][:, None], 0.0)
    else:
        residual = (target - draft_q[lanes, at]).clamp_(min=0.0)
    total = residual.sum(dim=-1, keepdim=True)
    residual = torch.where(total > 0, residual / total.clamp(min=torch.finfo(torch.float32).tiny), target)
    rejected = counts < allowed.sum(dim=1)  # stopped at a rejection, not after the last allowed draft
    source = torch.where(rejected[:, None], residual, target)
    return counts, sample_from(source, sampling.stream(STREAM_TOKEN))
