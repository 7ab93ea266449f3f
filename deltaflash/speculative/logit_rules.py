"""The rules that turn a lane's raw target logits into the logits its request samples from.

Row n of a lane verifies the token after the lane's committed tokens and its drafts d_1..d_n, so every
rule is evaluated for that row's own history: the drafts count as generated tokens for the rows after
them. Target-only decoding is the same with one row. Per row, in order (as vLLM applies them):
- repetition_penalty r over tokens of the prompt or the output: logit / r where positive, * r where not;
- frequency f and presence p penalties over output tokens: logit - f * count - p * (count > 0);
- logit_bias: logit + bias;
- min_tokens: stop tokens (EOS, stop_token_ids) at -inf while fewer than min_tokens were generated;
- grammar: tokens the request's grammar does not allow after the row's history at -inf.
Greedy lanes take the argmax of the result, sampled lanes lane_probs of it (temperature, top-k/p,
min_p). Everything is built from host lists and runs on the device without reading anything back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from deltaflash.core.batch import to_device
from deltaflash.core.request import Sequence as Seq


@dataclass(frozen=True)
class LogitRules:
    """The rules of L lanes. A field is None when no lane uses that rule (nothing is computed for it).

    penalties [L, 3] fp32 (presence, frequency, repetition); counts [L, V] fp32 output-token counts
    before row 0; seen [L, V] bool tokens of the prompt or the output before row 0; bias [L, V] fp32;
    stop [L, V] bool the stop tokens of lanes under min_tokens, tokens_to_min [L] long (rows n with
    n < tokens_to_min may not stop); grammar [L, W, ceil(V'/32)] int32 bitmasks (bit set = allowed;
    tokens past the tokenizer's V' are disallowed)."""

    penalties: Tensor | None = None
    counts: Tensor | None = None
    seen: Tensor | None = None
    bias: Tensor | None = None
    stop: Tensor | None = None
    tokens_to_min: Tensor | None = None
    grammar: Tensor | None = None

    @classmethod
    def build(cls, seqs: Sequence[Seq], vocab_size: int, device, grammar: Tensor | None = None) -> "LogitRules | None":
        """The rules of `seqs` (one lane each), or None when no lane has one. grammar: the lanes'
        bitmasks, already on the device (speculative/grammar.py)."""
        params = [s.params for s in seqs]
        if not any(p.has_rules for p in params):
            return None
        L, V = len(seqs), vocab_size
        fields = {"grammar": grammar}
        if any(p.penalized for p in params):
            lanes = [i for i, p in enumerate(params) if p.penalized]
            out_idx = [i * V + t for i in lanes for t in seqs[i].output_ids]
            seen_idx = out_idx + [i * V + t for i in lanes if params[i].repetition_penalty != 1
                                  for t in seqs[i].prompt_ids]
            counts = torch.zeros(L * V, device=device)
            counts.index_add_(0, to_device(out_idx, device), torch.ones(len(out_idx), device=device))
            seen = torch.zeros(L * V, dtype=torch.bool, device=device)
            seen[to_device(seen_idx, device)] = True
            fields |= {"counts": counts.view(L, V), "seen": seen.view(L, V),
                       "penalties": to_device([[p.presence_penalty, p.frequency_penalty, p.repetition_penalty]
                                               for p in params], device, torch.float32)}
        if any(p.logit_bias for p in params):
            pairs = [(i * V + t, b) for i, p in enumerate(params) for t, b in p.logit_bias]
            bias = torch.zeros(L * V, device=device)
            bias[to_device([i for i, _ in pairs], device)] = to_device([b for _, b in pairs], device, torch.float32)
            fields["bias"] = bias.view(L, V)
        under_min = [i for i, (s, p) in enumerate(zip(seqs, params)) if len(s.output_ids) < p.min_tokens]
        if under_min:
            stop = torch.zeros(L * V, dtype=torch.bool, device=device)
            stop[to_device([i * V + t for i in under_min for t in seqs[i].stop_ids if t < V], device)] = True
            fields |= {"stop": stop.view(L, V),
                       "tokens_to_min": to_device([p.min_tokens - len(s.output_ids) for s, p in zip(seqs, params)],
                                                  device)}
        return cls(**fields)

    def apply(self, logits: Tensor, drafts: Tensor, tree=None) -> Tensor:
        """logits [L, W, V] raw target rows, drafts [L, W-1] (a chain) or tree (speculative/tree.py
        DraftTree: row n follows the tokens of node n's path) -> [L, W, V] fp32 with the rules applied."""
        x = logits.float()
        L, W, V = x.shape
        if self.penalties is not None:
            counts = self.counts[:, None].expand(L, W, V)
            if W > 1:  # the drafts before a row count as generated tokens for it
                added = torch.zeros(L, W, V, device=x.device)
                if tree is None:
                    added[:, 1:].scatter_(2, drafts[..., None], 1.0)
                    counts = counts + added.cumsum(dim=1)
                else:  # the tokens of the row's own path, the anchor (already output) excluded
                    added.scatter_(2, tree.tokens[..., None], 1.0)
                    counts = counts + torch.bmm(tree.ancestors()[:, :, 1:].float(), added[:, 1:])
            seen = self.seen[:, None] | (counts > 0)
            presence, frequency, repetition = (self.penalties[:, i].view(L, 1, 1) for i in range(3))
            x = torch.where(seen, torch.where(x > 0, x / repetition, x * repetition), x)
            x = x - frequency * counts - presence * (counts > 0)
        if self.bias is not None:
            x = x + self.bias[:, None]
        if self.stop is not None:  # tokens generated before row n: n in a chain, its depth in a tree
            rows = torch.arange(W, device=x.device).view(1, W, 1) if tree is None else tree.depth[..., None]
            x = x.masked_fill(self.stop[:, None] & (rows < self.tokens_to_min.view(L, 1, 1)), float("-inf"))
        if self.grammar is not None:
            x = x.masked_fill(~unpack_bitmask(self.grammar, V), float("-inf"))
        return x


def unpack_bitmask(bitmask: Tensor, vocab_size: int) -> Tensor:
    """int32 bitmasks [..., words] -> bool [..., vocab_size] (bit b of word w = token 32 w + b; tokens
    past 32 * words are disallowed)."""
    bits = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = ((bitmask[..., None] >> bits) & 1).bool().flatten(-2)
    if allowed.shape[-1] >= vocab_size:
        return allowed[..., :vocab_size]
    pad = torch.zeros(*allowed.shape[:-1], vocab_size - allowed.shape[-1], dtype=torch.bool, device=bitmask.device)
    return torch.cat([allowed, pad], dim=-1)
