"""Batched drafting: one DFlash / DFlash2 block per lane, over lanes with different context lengths.

Lane l drafts the block [anchor, MASK x (B-1)] at positions anchor_pos + 0..B-1 against its slot's
context rows (positions < anchor_pos; the slot's length must equal anchor_pos). Block slot k >= 1
proposes the token at position anchor_pos + k. Block K/V is never stored.
- DFlash: d_k = argmax of the logits of slot k (greedy lanes), or a sample from q = lane_probs(logits)
  with the lane's own settings, each slot independently.
- DFlash2: the selector keeps the top-k tokens of each slot's logits and walks the slots in order:
  score(c) = logit(c) + <pred_codebook[prev] * hidden_projection(h_k), succ_codebook[c]>, prev
  starting at the anchor; greedy lanes take the best candidate, sampled lanes draw from
  q = softmax(score / T) (temperature only, as the dflash package does; top-p / top-k do not apply).
Sampling draws from the lane's STREAM_DRAFT noise (speculative/sampling.py): no host sync.
"""

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn import functional as F

from deltaflash.cache.draft_context import DraftContext, DraftContextCache
from deltaflash.models.dflash import DFlashDrafter
from deltaflash.models.vocab import Vocab
from deltaflash.ops.attention.naive import paged_attention_ref
from deltaflash.speculative.sampling import STREAM_DRAFT, LaneSampling, lane_probs, sample_from, uniform_noise


@dataclass(frozen=True)
class DraftProposal:
    """Drafted tokens d_1..d_{B-1} of L lanes.

    tokens: [L, B-1] int64
    probs: q of each drafted slot, fp32: DFlash [L, B-1, V]; DFlash2 [L, B-1, K] over `indices`;
        None when every lane is greedy (meaningless on greedy lanes otherwise)
    indices: DFlash2 only, candidate token ids [L, B-1, K] (descending logit); None for DFlash
    """

    tokens: Tensor
    probs: Tensor | None = None
    indices: Tensor | None = None


def draft_hidden(
    drafter: DFlashDrafter, ctx_cache: DraftContextCache, vocab: Vocab,
    slot_ids: Tensor, anchor_ids: Tensor, anchor_positions: Tensor, block_size: int,
    max_context_len: int | None = None, attend=paged_attention_ref,
) -> Tensor:
    """Normed block hidden states [L, B, H] (slot 0 = anchor); lanes [L] as in `propose`; attend: the
    paged attention op (the reference, or the Triton kernel of ops/kernels.py)."""
    config = drafter.config
    ids = torch.full((slot_ids.shape[0], block_size), config.mask_token_id, dtype=torch.long, device=slot_ids.device)
    ids[:, 0] = torch.where(slot_ids < 0, 0, anchor_ids)  # padding lanes may carry any anchor id
    embeds = (vocab.embed(ids) * config.input_embedding_scale).to(drafter.dtype)
    positions = anchor_positions[:, None] + torch.arange(block_size, device=slot_ids.device)
    context = DraftContext.build(ctx_cache, slot_ids, anchor_positions, block_size, attend, max_context_len)
    return drafter(embeds, positions, context)


@torch.no_grad()
def propose(
    drafter: DFlashDrafter, ctx_cache: DraftContextCache, vocab: Vocab, slot_ids: Tensor, anchor_ids: Tensor, anchor_positions: Tensor, block_size: int,
    sampling: LaneSampling | None = None, max_context_len: int | None = None,
) -> DraftProposal:
    """Draft B-1 tokens for each of L lanes.

    slot_ids [L] (-1 = padding lane), anchor_ids [L], anchor_positions [L] (= the slot's context
    length); vocab: the target's embedding and lm_head (models/vocab.py). sampling: the lanes' settings and
    noise (None: every lane greedy). max_context_len: optional host-known bound on the lanes' context
    lengths (reads fewer rows).
    """
    anchor_ids = torch.where(slot_ids < 0, 0, anchor_ids)  # padding lanes may carry any anchor id
    hidden = draft_hidden(drafter, ctx_cache, vocab, slot_ids, anchor_ids, anchor_positions,
                          block_size, max_context_len)[:, 1:]  # [L, B-1, H]
    logits = drafter.logits(hidden, vocab)  # [L, B-1, V]
    return choose_tokens(drafter, hidden, logits, anchor_ids,
                         sampling or LaneSampling.greedy_lanes(slot_ids.shape[0], slot_ids.device))


def choose_tokens(drafter: DFlashDrafter, hidden: Tensor, logits: Tensor, anchor_ids: Tensor,
                  sampling: LaneSampling) -> DraftProposal:
    """Tokens from the block's hidden [L, B-1, H] / logits [L, B-1, V], each lane by its own settings."""
    if drafter.config.variant == "dflash2":
        return _select_candidates(drafter, hidden, logits, anchor_ids, sampling)
    tokens = logits.argmax(dim=-1)
    if sampling.all_greedy:
        return DraftProposal(tokens=tokens)
    probs = lane_probs(logits, sampling)
    drawn = sample_from(probs, sampling.stream(STREAM_DRAFT))
    return DraftProposal(tokens=torch.where(sampling.greedy[:, None], tokens, drawn), probs=probs)


def full_vocab_probs(proposal: DraftProposal, vocab_size: int) -> Tensor | None:
    """q over the whole vocabulary [L, B-1, V] (DFlash2 keeps it over its candidates)."""
    if proposal.probs is None or proposal.indices is None:
        return proposal.probs
    q = torch.zeros(*proposal.indices.shape[:-1], vocab_size, dtype=torch.float32, device=proposal.probs.device)
    return q.scatter(-1, proposal.indices, proposal.probs.float())


def _select_candidates(drafter: DFlashDrafter, hidden: Tensor, logits: Tensor, anchor_ids: Tensor,
                       sampling: LaneSampling) -> DraftProposal:
    """DFlash2 walk over slots; hidden [L, B-1, H], logits [L, B-1, V]."""
    selector = drafter.candidate_selector
    unary, candidates = logits.topk(selector.top_k, dim=-1)  # [L, B-1, K]
    projected = selector.hidden_projection(hidden)  # [L, B-1, rank]
    successors = F.embedding(candidates, selector.successor_codebook)  # [L, B-1, K, rank]
    exp_noise = None
    if not sampling.all_greedy:
        exp_noise = uniform_noise(sampling.stream(STREAM_DRAFT), tuple(candidates.shape)).log_().neg_()
    previous, tokens, q_rows = anchor_ids, [], []
    for slot in range(candidates.shape[1]):
        query = F.embedding(previous, selector.predecessor_codebook) * projected[:, slot]  # [L, rank]
        scores = unary[:, slot] + torch.einsum("lr,lkr->lk", query, successors[:, slot])  # [L, K]
        pick = scores.argmax(dim=-1)
        if exp_noise is not None:
            q = (scores.float() / sampling.temperature[:, None]).softmax(dim=-1)
            pick = torch.where(sampling.greedy, pick, (q / exp_noise[:, slot]).argmax(dim=-1))
            q_rows.append(q)
        previous = candidates[:, slot].gather(-1, pick[:, None])[:, 0]
        tokens.append(previous)
    probs = torch.stack(q_rows, dim=1) if q_rows else None
    return DraftProposal(tokens=torch.stack(tokens, dim=1), probs=probs, indices=candidates)
