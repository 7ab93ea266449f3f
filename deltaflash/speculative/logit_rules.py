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
The penalties' token histories stay on the device between rounds (PenaltyHistory, a row per engine
slot): a round sends only the tokens committed since the last, not the whole prompt and output.
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
    def build(cls, seqs: Sequence[Seq], vocab_size: int, device, grammar: Tensor | None = None,
              history: "PenaltyHistory | None" = None) -> "LogitRules | None":
        """The rules of `seqs` (one lane each), or None when no lane has one. grammar: the lanes'
        bitmasks, already on the device (speculative/grammar.py); history: the engine's PenaltyHistory
        (None: the penalized lanes' histories are built from their whole prompts and outputs)."""
        params = [s.params for s in seqs]
        if not any(p.has_rules for p in params):
            return None
        L, V = len(seqs), vocab_size
        fields = {"grammar": grammar}
        if any(p.penalized for p in params):
            fresh = history is None
            counts, seen = (PenaltyHistory(L, V, device) if fresh else history).rows(seqs, range(L) if fresh else None)
            fields |= {"counts": counts, "seen": seen,
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


class PenaltyHistory:
    """The token histories the penalties read, on the device, a row per engine slot (and a last row of
    zeros for lanes without penalties): counts [slots + 1, V] fp32 of each penalized request's output
    tokens, seen [slots + 1, V] bool of its output's tokens and, under a repetition penalty, its
    prompt's. A row follows the request that holds its slot: a request new to the row (admitted, or
    resumed in another slot after a preemption) or whose output shrank starts it again from its prompt
    and whole output; otherwise a round adds only the output tokens committed since the last. Host work per
    round is therefore O(new tokens), not O(context), and the device work a few launches for all
    lanes. The rows are allocated at the first penalized request (5 bytes x V a slot)."""

    def __init__(self, slots: int, vocab_size: int, device):
        self.slots, self.vocab_size, self.device = slots, vocab_size, torch.device(device)
        self.counts: Tensor | None = None
        self.seen: Tensor | None = None
        self.owner: list[Seq | None] = [None] * slots  # the request whose history a row holds
        self.outputs = [0] * slots  # how many of its output tokens the row holds

    def rows(self, seqs: Sequence[Seq], rows: Sequence[int] | None = None) -> tuple[Tensor, Tensor]:
        """(counts [L, V], seen [L, V]) of the lanes `seqs` as their histories stand: rows of the
        penalized lanes, zeros for the others. rows: the row each lane uses (default: its slot)."""
        V = self.vocab_size
        if self.counts is None:
            self.counts = torch.zeros(self.slots + 1, V, device=self.device)
            self.seen = torch.zeros(self.slots + 1, V, dtype=torch.bool, device=self.device)
        lane_rows, restart, prompt_idx, output_idx = [], [], [], []
        for i, s in enumerate(seqs):
            r = s.slot if rows is None else rows[i]
            if not s.params.penalized:
                lane_rows.append(self.slots)
                continue
            if not 0 <= r < self.slots:
                raise ValueError(f"a penalized lane's history row {r} is not one of the {self.slots} slots")
            lane_rows.append(r)
            if self.owner[r] is not s or self.outputs[r] > len(s.output_ids):
                self.owner[r], self.outputs[r] = s, 0
                restart.append(r)
                if s.params.repetition_penalty != 1:
                    prompt_idx += [r * V + t for t in s.prompt_ids]
            output_idx += [r * V + t for t in s.output_ids[self.outputs[r]:]]
            self.outputs[r] = len(s.output_ids)
        counts, seen = self.counts.view(-1), self.seen.view(-1)
        if restart or output_idx:  # (prompt tokens come with a restart)
            flat = to_device(restart + prompt_idx + output_idx, self.device)  # one transfer
            restart_t, prompt_t, output_t = flat.split([len(restart), len(prompt_idx), len(output_idx)])
            if restart:
                self.counts.index_fill_(0, restart_t, 0.0)
                self.seen.index_fill_(0, restart_t, False)
            if prompt_idx:
                seen[prompt_t] = True
            if output_idx:
                counts.index_add_(0, output_t, torch.ones(len(output_idx), device=self.device))
                seen[output_t] = True
        index = to_device(lane_rows, self.device)
        return self.counts[index], self.seen[index]


def unpack_bitmask(bitmask: Tensor, vocab_size: int) -> Tensor:
    """int32 bitmasks [..., words] -> bool [..., vocab_size] (bit b of word w = token 32 w + b; tokens
    past 32 * words are disallowed)."""
    bits = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = ((bitmask[..., None] >> bits) & 1).bool().flatten(-2)
    if allowed.shape[-1] >= vocab_size:
        return allowed[..., :vocab_size]
    pad = torch.zeros(*allowed.shape[:-1], vocab_size - allowed.shape[-1], dtype=torch.bool, device=bitmask.device)
    return torch.cat([allowed, pad], dim=-1)
