"""Batched drafting: one DFlash / DFlash2 block per lane, over lanes with different context lengths.

Lane l drafts the block [anchor, MASK x (B-1)] at positions anchor_pos + 0..B-1 against its slot's
context rows (positions < anchor_pos; the slot's length must equal anchor_pos). Block slot k >= 1
proposes the token at position anchor_pos + k. Block K/V is never stored.
- DFlash: d_k = argmax of the logits of slot k, or a sample from q = sampling_probs(logits), each
  slot independently.
- DFlash2: the selector keeps the top-k tokens of each slot's logits and walks the slots in order:
  score(c) = logit(c) + <pred_codebook[prev] * hidden_projection(h_k), succ_codebook[c]>, prev
  starting at the anchor; greedy takes the best candidate, sampling draws from q = softmax(score / T)
  (temperature only, as the dflash package does; top-p / top-k do not apply to the selector).
Sampling draws argmax(q / E) with E ~ Exp(1) (a q-distributed draw), so it never syncs with the host;
lane l's noise comes from generators[l] when given (one stream per request).
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn import functional as F

from deltaflash.cache.draft_context import DraftContextCache
from deltaflash.errors import RequestError
from deltaflash.models.dflash import DFlashDrafter
from deltaflash.spec.sampling import sampling_probs


@dataclass(frozen=True)
class DraftProposal:
    """Drafted tokens d_1..d_{B-1} of L lanes.

    tokens: [L, B-1] int64
    probs: q of each drafted slot, fp32: DFlash [L, B-1, V]; DFlash2 [L, B-1, K] over `indices`;
        None when greedy
    indices: DFlash2 only, candidate token ids [L, B-1, K] (descending logit); None for DFlash
    """

    tokens: Tensor
    probs: Tensor | None = None
    indices: Tensor | None = None


def exponential_noise(shape: tuple[int, ...], generators: Sequence[torch.Generator | None] | None,
                      device: torch.device) -> Tensor:
    """Exp(1) noise [L, ...] fp32; lane l drawn from generators[l] (None: the default generator)."""
    noise = torch.empty(shape, dtype=torch.float32, device=device)
    if generators is None:
        noise.exponential_()
    else:
        for lane, generator in enumerate(generators):
            noise[lane].exponential_(generator=generator)
    return noise.clamp_min_(torch.finfo(torch.float32).tiny)  # a 0 draw must not give 0 / 0


def draft_hidden(
    drafter: DFlashDrafter, ctx_cache: DraftContextCache, embed_weight: Tensor,
    slot_ids: Tensor, anchor_ids: Tensor, anchor_positions: Tensor, block_size: int,
    max_context_len: int | None = None,
) -> Tensor:
    """Normed block hidden states [L, B, H] (slot 0 = anchor); lanes [L] as in `propose`."""
    config = drafter.config
    ids = torch.full((slot_ids.shape[0], block_size), config.mask_token_id, dtype=torch.long, device=slot_ids.device)
    ids[:, 0] = torch.where(slot_ids < 0, 0, anchor_ids)  # padding lanes may carry any anchor id
    embeds = (F.embedding(ids, embed_weight) * config.input_embedding_scale).to(drafter.dtype)
    positions = anchor_positions[:, None] + torch.arange(block_size, device=slot_ids.device)
    return drafter(embeds, positions, ctx_cache.view(slot_ids, max_context_len))


@torch.no_grad()
def propose(
    drafter: DFlashDrafter, ctx_cache: DraftContextCache, embed_weight: Tensor, lm_head_weight: Tensor,
    slot_ids: Tensor, anchor_ids: Tensor, anchor_positions: Tensor, block_size: int,
    temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
    generators: Sequence[torch.Generator | None] | None = None, max_context_len: int | None = None,
) -> DraftProposal:
    """Draft B-1 tokens for each of L lanes.

    slot_ids [L] (-1 = padding lane), anchor_ids [L], anchor_positions [L] (= the slot's context
    length); embed_weight / lm_head_weight [V, H], the target's. temperature 0 = greedy.
    generators: one per lane (None entries use the default generator), on the lanes' device.
    max_context_len: optional host-known bound on the lanes' context lengths (reads fewer rows).
    """
    if temperature < 0 or not 0 < top_p <= 1 or top_k < 0:
        raise RequestError(f"sampling: expected temperature >= 0, 0 < top_p <= 1, top_k >= 0; "
                           f"got {temperature}, {top_p}, {top_k}")
    if generators is not None and len(generators) != slot_ids.shape[0]:
        raise ValueError(f"generators: {len(generators)} given for {slot_ids.shape[0]} lanes")
    anchor_ids = torch.where(slot_ids < 0, 0, anchor_ids)  # padding lanes may carry any anchor id
    hidden = draft_hidden(drafter, ctx_cache, embed_weight, slot_ids, anchor_ids, anchor_positions,
                          block_size, max_context_len)[:, 1:]  # [L, B-1, H]
    logits = drafter.logits(hidden, lm_head_weight)  # [L, B-1, V]
    return choose_tokens(drafter, hidden, logits, anchor_ids, temperature, top_p, top_k, generators)


def choose_tokens(
    drafter: DFlashDrafter, hidden: Tensor, logits: Tensor, anchor_ids: Tensor,
    temperature: float, top_p: float, top_k: int, generators: Sequence[torch.Generator | None] | None,
) -> DraftProposal:
    """Tokens from the block's hidden [L, B-1, H] / logits [L, B-1, V] for lanes sharing one setting."""
    if drafter.config.variant == "dflash2":
        return _select_candidates(drafter, hidden, logits, anchor_ids, temperature, generators)
    if temperature == 0:
        return DraftProposal(tokens=logits.argmax(dim=-1))
    probs = sampling_probs(logits, temperature, top_p, top_k)
    noise = exponential_noise(tuple(probs.shape), generators, probs.device)
    return DraftProposal(tokens=(probs / noise).argmax(dim=-1), probs=probs)


def full_vocab_probs(proposal: DraftProposal, vocab_size: int) -> Tensor | None:
    """q over the whole vocabulary [L, B-1, V] (DFlash2 keeps it over its candidates)."""
    if proposal.probs is None or proposal.indices is None:
        return proposal.probs
    q = torch.zeros(*proposal.indices.shape[:-1], vocab_size, dtype=torch.float32, device=proposal.probs.device)
    return q.scatter(-1, proposal.indices, proposal.probs.float())


def _select_candidates(
    drafter: DFlashDrafter, hidden: Tensor, logits: Tensor, anchor_ids: Tensor,
    temperature: float, generators: Sequence[torch.Generator | None] | None,
) -> DraftProposal:
    """DFlash2 walk over slots; hidden [L, B-1, H], logits [L, B-1, V]."""
    selector = drafter.candidate_selector
    unary, candidates = logits.topk(selector.top_k, dim=-1)  # [L, B-1, K]
    projected = selector.hidden_projection(hidden)  # [L, B-1, rank]
    successors = F.embedding(candidates, selector.successor_codebook)  # [L, B-1, K, rank]
    noise = None
    if temperature > 0:
        noise = exponential_noise(tuple(candidates.shape), generators, candidates.device)
    previous, tokens, q_rows = anchor_ids, [], []
    for slot in range(candidates.shape[1]):
        query = F.embedding(previous, selector.predecessor_codebook) * projected[:, slot]  # [L, rank]
        scores = unary[:, slot] + torch.einsum("lr,lkr->lk", query, successors[:, slot])  # [L, K]
        if noise is None:
            pick = scores.argmax(dim=-1)
        else:
            q = (scores.float() / temperature).softmax(dim=-1)
            pick = (q / noise[:, slot]).argmax(dim=-1)
            q_rows.append(q)
        previous = candidates[:, slot].gather(-1, pick[:, None])[:, 0]
        tokens.append(previous)
    probs = torch.stack(q_rows, dim=1) if q_rows else None
    return DraftProposal(tokens=torch.stack(tokens, dim=1), probs=probs, indices=candidates)
