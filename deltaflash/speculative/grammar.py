"""Structured output through llguidance: JSON schemas, JSON objects, regular expressions, Lark grammars.

Why llguidance: a maintained Rust library (the guidance project's, used by vLLM and SGLang) with no
dependency of its own, fast mask computation over large vocabularies, and `rollback`, which speculative
verify needs: the masks of a lane's W rows are computed by consuming its drafts one by one (row n's
mask is the grammar's state after the committed tokens and d_1..d_n), then rolled back; after
acceptance only the emitted tokens are consumed for good. A draft the grammar rejects ends the walk:
its row's mask forbids it, so acceptance stops there anyway.
"""

from __future__ import annotations

import json

import torch

from deltaflash.core.request import GrammarSpec
from deltaflash.errors import RequestError


# JSON without optional whitespace (as OpenAI's structured outputs write it): a model may otherwise spend
# its whole budget on spaces and newlines between tokens the grammar allows anywhere
JSON_DEFAULTS = {"whitespace_flexible": False}


def grammar_text(spec: GrammarSpec) -> str:
    """The llguidance grammar of a spec; RequestError naming what is wrong with it."""
    import llguidance

    if spec.kind == "json_object":
        text = llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_DEFAULTS)
    elif spec.kind == "json_schema":
        try:
            json.loads(spec.source)
        except ValueError as exc:
            raise RequestError(f"json_schema is not valid JSON: {exc}") from None
        text = llguidance.LLMatcher.grammar_from_json_schema(spec.source, defaults=JSON_DEFAULTS)
    elif spec.kind == "regex":
        text = llguidance.LLMatcher.grammar_from_regex(spec.source)
    elif spec.kind == "lark":
        text = llguidance.LLMatcher.grammar_from_lark(spec.source)
    else:
        raise RequestError(f"unknown grammar kind {spec.kind!r}")
    error = llguidance.LLMatcher.validate_grammar(text)
    if error:
        raise RequestError(f"invalid {spec.kind.replace('_', ' ')}: {error.strip().splitlines()[0]}")
    return text


class GrammarCompiler:
    """Matchers for one tokenizer (built once: the token trie over the whole vocabulary)."""

    def __init__(self, hf_tokenizer, vocab_size: int):
        import llguidance.hf

        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer)
        self.vocab_size = vocab_size
        self.words = (self.tokenizer.vocab_size + 31) // 32

    def matcher(self, spec: GrammarSpec) -> "GrammarMatcher | GrammarAfter":
        matcher = GrammarMatcher(self, grammar_text(spec))
        return matcher if spec.after is None else GrammarAfter(matcher, spec.after)


class GrammarMatcher:
    """One request's grammar state (host only)."""

    def __init__(self, compiler: GrammarCompiler, grammar: str):
        import llguidance

        self.tokens, self.words = compiler.tokenizer.vocab_size, compiler.words
        self.matcher = llguidance.LLMatcher(compiler.tokenizer, grammar)
        if self.matcher.is_error():
            raise RequestError(f"grammar: {self.matcher.get_error()}")

    def row_masks(self, drafts: list[int]) -> torch.Tensor:
        """Bitmasks [len(drafts) + 1, words] int32 (CPU) of rows 0..n: row n's allowed tokens after the
        committed tokens and drafts[:n]. The grammar's state is unchanged afterwards."""
        import llguidance.torch as lt

        masks = lt.allocate_token_bitmask(len(drafts) + 1, self.tokens)
        lt.fill_next_token_bitmask(self.matcher, masks, 0)
        consumed = 0
        for n, token in enumerate(drafts):
            # a draft outside the grammar's vocabulary (the model's embedding rows past the tokenizer's)
            # would put the matcher in its error state: it is refused like any other forbidden token
            if (token >= self.tokens or self.matcher.is_stopped()
                    or self.matcher.try_consume_tokens([token]) != 1):
                masks[n + 1:] = masks[n]  # rows past a rejected draft are never reached
                break
            consumed += 1
            lt.fill_next_token_bitmask(self.matcher, masks, n + 1)
        self.matcher.rollback(consumed)
        return masks

    def advance(self, token: int) -> bool:
        """Consume one emitted token for good (its row's mask allowed it). True once the grammar is
        complete: it took its end token, or nothing may follow."""
        if not self.matcher.is_stopped() and self.matcher.try_consume_tokens([token]) != 1:
            if not self.matcher.is_stopped():
                raise RuntimeError(f"grammar refused emitted token {token} (a mask was not applied)")
        return self.matcher.is_stopped()


class GrammarAfter:
    """A grammar that holds from the token after the first `end` (GrammarSpec.after: a thinking model's
    `</think>`): every token is allowed up to and including that one, the grammar's masks after it. The same
    surface as GrammarMatcher."""

    def __init__(self, matcher: GrammarMatcher, end: int):
        self.matcher, self.end, self.before = matcher, end, True  # before: `end` not emitted yet

    @property
    def words(self) -> int:
        return self.matcher.words

    def row_masks(self, drafts: list[int]) -> torch.Tensor:
        if not self.before:
            return self.matcher.row_masks(drafts)
        masks = torch.full((len(drafts) + 1, self.words), -1, dtype=torch.int32)  # every token, up to `end`
        if self.end in drafts:
            k = drafts.index(self.end)  # rows past drafts[k]: the grammar's, from its start
            masks[k + 1:] = self.matcher.row_masks(drafts[k + 1:])
        return masks

    def advance(self, token: int) -> bool:
        if self.before:
            self.before = token != self.end
            return False
        return self.matcher.advance(token)


def lane_masks(seqs, drafts: list[list[int]] | None, width: int, words: int) -> torch.Tensor:
    """[L, width, words] int32 on the host: each grammar lane's row masks (drafts [L][>= width-1] host
    ids, or None at width 1), every token allowed on the other lanes."""
    masks = torch.full((len(seqs), width, words), -1, dtype=torch.int32)
    for lane, seq in enumerate(seqs):
        if seq.matcher is not None:
            rows = seq.matcher.row_masks(drafts[lane][:width - 1] if drafts else [])
            masks[lane, :rows.shape[0]] = rows
    return masks
