"""Validated API requests -> engine inputs: chat template, tokenization, checks against the model.

Runs in the HTTP handlers and owns its own tokenizer instance (the engine worker detokenizes with the
engine's), so no tokenizer is shared between threads.
"""

from __future__ import annotations

from dataclasses import dataclass

from deltaflash.core.request import SamplingParams
from deltaflash.errors import RequestError
from deltaflash.server.errors import BadRequest, ModelNotFound
from deltaflash.server.protocol import ApiRequest
from deltaflash.tokenizer import encode_chat, encode_prompt

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context


@dataclass(frozen=True)
class ModelCard:
    """The served model as clients see it (/v1/models) and as requests are checked against it."""

    name: str
    vocab_size: int
    max_model_len: int   # prompt + generated tokens of one request
    block_size: int      # speculative block W; 0 without a drafter
    created: int         # unix seconds


@dataclass(frozen=True)
class Prepared:
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    stop_strings: tuple[str, ...]


class Frontend:
    def __init__(self, card: ModelCard, tokenizer):
        self.card, self.tokenizer = card, tokenizer

    def prepare(self, req: ApiRequest) -> Prepared:
        if req.model is not None and req.model != self.card.name:
            raise ModelNotFound(f"model {req.model!r} does not exist; this server serves {self.card.name!r}",
                                param="model")
        prompt_field = "messages" if req.chat else "prompt"
        ids = self._prompt_ids(req, prompt_field)
        s = req.sampling
        if s.stop_strings and self.tokenizer is None:
            raise BadRequest("stop strings need a tokenizer and this model folder has none; give token ids",
                             param="stop")
        bad = [t for t in s.stop_token_ids if not 0 <= t < self.card.vocab_size]
        if bad:
            raise BadRequest(f"stop token id {bad[0]} is outside the vocabulary 0..{self.card.vocab_size - 1}",
                             param="stop")
        room = self.card.max_model_len - len(ids)
        if room < 1:
            raise BadRequest(f"{prompt_field} is {len(ids)} tokens; the context is {self.card.max_model_len} tokens "
                             "and must leave room for at least one generated token", param=prompt_field,
                             code="context_length_exceeded")
        max_tokens = s.max_tokens
        if max_tokens is None:
            max_tokens = room if req.chat else min(COMPLETION_DEFAULT_MAX_TOKENS, room)
        elif max_tokens > room:
            raise BadRequest(f"max_tokens ({max_tokens}) + prompt ({len(ids)} tokens) exceeds the context of "
                             f"{self.card.max_model_len} tokens; at most {room} tokens can be generated",
                             param="max_tokens", code="context_length_exceeded")
        params = SamplingParams(max_new_tokens=max_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                seed=s.seed, stop_token_ids=s.stop_token_ids, ignore_eos=s.ignore_eos)
        try:
            params.validate()
        except RequestError as exc:
            raise BadRequest(str(exc)) from None
        return Prepared(tuple(ids), params, s.stop_strings)

    def _prompt_ids(self, req: ApiRequest, field: str) -> list[int]:
        try:
            if req.chat:
                ids = encode_chat(self.tokenizer, list(req.messages))
            elif isinstance(req.prompt, str):
                ids = encode_prompt(self.tokenizer, req.prompt)
            else:
                ids = list(req.prompt)
        except RequestError as exc:
            raise BadRequest(f"{field}: {exc}", param=field) from None
        except Exception as exc:  # a chat template that raises on these messages (jinja TemplateError, ...)
            raise BadRequest(f"{field}: the chat template failed: {exc}", param=field) from None
        if not ids:
            raise BadRequest(f"{field} tokenizes to no tokens", param=field)
        bad = [t for t in ids if not 0 <= t < self.card.vocab_size]
        if bad:
            raise BadRequest(f"prompt token id {bad[0]} is outside the vocabulary 0..{self.card.vocab_size - 1}",
                             param=field)
        return ids
