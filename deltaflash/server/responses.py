"""OpenAI response bodies and server-sent-event chunks for one request (one or more choices)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from deltaflash.server.textstream import TextLogprob

DONE = b"data: [DONE]\n\n"
MIN_LOGPROB = -9999.0  # stands for -inf, which JSON cannot hold (as vLLM does)


def sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; `cached_tokens`: prompt tokens served from the prefix cache (or shared with another
    request's prefill), as OpenAI's prompt caching reports them."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


@dataclass(frozen=True)
class Choice:
    """One finished choice of a full body. `prompt_ids`: the prompt it continues. `text`: a chat choice's
    content, None when the answer is only `tool_calls` (OpenAI's message format). `reasoning`: its thinking,
    split off by a reasoning parser (None: not parsed)."""

    index: int
    text: str | None
    token_ids: tuple[int, ...]
    logprobs: tuple[TextLogprob, ...]
    finish_reason: str
    prompt_ids: tuple[int, ...]
    tool_calls: tuple[dict, ...] = ()
    prompt_logprobs: tuple[TextLogprob, ...] = ()  # its prompt's tokens, when scored (the first's logprob None)
    reasoning: str | None = None


@dataclass(frozen=True)
class Formatter:
    """`return_token_ids` adds `token_ids` to each choice and the prompt's `prompt_token_ids` (to each
    completions choice, to the chat body: vLLM's places). `logprobs`: the request asked for them.

    Logprobs, per token: chat {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token",
    "logprob", "bytes"}]}]}; completions OpenAI's legacy {"tokens", "token_logprobs", "top_logprobs":
    [{token: logprob}] (the top tokens and the chosen one), "text_offset"}, where a token's text_offset
    is the summed length of the texts of the tokens before it in its choice; an echoed prompt's first token
    has null for its logprob and its top logprobs (each entry's top cut to `top_logprobs`).

    `prompt_logprobs` (vLLM's field; None: not asked): each completions choice's, or the chat body's,
    `prompt_logprobs` - null for the prompt's first token, then per token {token id: {"logprob", "rank",
    "decoded_token"}} for the token and the `prompt_logprobs` most likely ones of its row.

    `include_reasoning` False (vLLM's field): the thinking a reasoning parser splits off is dropped (by the
    relay, which hands on no `reasoning`)."""

    chat: bool
    request_id: str
    model: str
    created: int
    return_token_ids: bool
    logprobs: bool = False
    top_logprobs: int = 20
    prompt_logprobs: int | None = None
    include_reasoning: bool = True

    def body(self, choices: Sequence[Choice], prompt_tokens: int, completion_tokens: int,
             cached_tokens: int = 0) -> dict:
        out = []
        for c in choices:
            if self.chat:
                message = {"role": "assistant", "content": c.text}
                if c.reasoning is not None:  # vLLM's name and its older one (SGLang's)
                    message["reasoning"] = message["reasoning_content"] = c.reasoning or None
                if c.tool_calls:
                    message["tool_calls"] = list(c.tool_calls)
                choice = {"index": c.index, "message": message}
            else:
                choice = {"index": c.index, "text": c.text}
            choice |= {"logprobs": self._logprobs(c.logprobs, 0) if self.logprobs else None,
                       "finish_reason": c.finish_reason}
            if self.return_token_ids:
                choice["token_ids"] = list(c.token_ids)
                if not self.chat:
                    choice["prompt_token_ids"] = list(c.prompt_ids)
            if self.prompt_logprobs is not None and not self.chat:
                choice["prompt_logprobs"] = self._prompt_logprobs(c.prompt_logprobs)
            out.append(choice)
        body = self._head(chunk=False) | {"choices": out,
                                          "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}
        if self.return_token_ids and self.chat:
            body["prompt_token_ids"] = list(choices[0].prompt_ids)
        if self.prompt_logprobs is not None and self.chat:  # (every choice continues the one prompt)
            body["prompt_logprobs"] = self._prompt_logprobs(choices[0].prompt_logprobs)
        return body

    def chunk(self, index: int, text: str, token_ids: tuple[int, ...], logprobs: tuple[TextLogprob, ...] | None,
              finish_reason: str | None, text_offset: int, include_usage: bool = False,
              tool_calls: Sequence[dict] = (), reasoning: str = "") -> dict:
        """Choice `index`'s next piece; `text_offset`: the choice's token texts so far (completions logprobs);
        `tool_calls`: chat `delta.tool_calls` entries (server/tools.py `CallDelta.openai`); `reasoning`: chat
        thinking split off by a reasoning parser (`delta.reasoning` and `delta.reasoning_content`)."""
        if self.chat:
            delta = {"reasoning": reasoning, "reasoning_content": reasoning} if reasoning else {}
            if text:
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = list(tool_calls)
            choice = {"index": index, "delta": delta}
        else:
            choice = {"index": index, "text": text}
        choice |= {"logprobs": self._logprobs(logprobs, text_offset) if self.logprobs and logprobs else None,
                   "finish_reason": finish_reason}
        if self.return_token_ids:
            choice["token_ids"] = list(token_ids)
        out = self._head(chunk=True) | {"choices": [choice]}
        if include_usage:
            out["usage"] = None
        return out

    def role_chunk(self, index: int, include_usage: bool = False) -> dict:
        """A chat choice's first chunk: the assistant role, no content yet."""
        out = self._head(chunk=True) | {"choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                                      "logprobs": None, "finish_reason": None}]}
        if include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
        """The last chunk with stream_options.include_usage: no choices, the request's usage."""
        return self._head(chunk=True) | {"choices": [], "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}

    def _head(self, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.request_id, "object": kind, "created": self.created, "model": self.model}

    def _logprobs(self, entries: Sequence[TextLogprob], text_offset: int) -> dict:
        if self.chat:
            return {"content": [_chat_entry(e.token, e.logprob)
                                | {"top_logprobs": [_chat_entry(t, lp) for t, lp in e.top]} for e in entries]}
        offsets = []
        for e in entries:
            offsets.append(text_offset)
            text_offset += len(e.token)
        return {"tokens": [e.token for e in entries],
                "token_logprobs": [None if e.logprob is None else _finite(e.logprob) for e in entries],
                "top_logprobs": [None if e.logprob is None else _top_dict(e, self.top_logprobs) for e in entries],
                "text_offset": offsets}

    def _prompt_logprobs(self, entries: Sequence[TextLogprob]) -> list[dict | None]:
        out = []
        for e in entries:
            if e.logprob is None:
                out.append(None)
                continue
            top = {str(e.token_id): _vllm_entry(e.logprob, e.rank, e.token)}
            for rank, (token_id, (text, logprob)) in enumerate(zip(e.top_ids, e.top[:self.prompt_logprobs]), 1):
                top.setdefault(str(token_id), _vllm_entry(logprob, rank, text))
            out.append(top)
        return out


def _vllm_entry(logprob: float, rank: int | None, text: str) -> dict:
    return {"logprob": _finite(logprob), "rank": rank, "decoded_token": text}


def _chat_entry(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": _finite(logprob), "bytes": list(token.encode())}


def _top_dict(entry: TextLogprob, k: int) -> dict[str, float]:
    """{text: logprob} of the k top tokens and the chosen one; of tokens with the same text, the likelier."""
    top: dict[str, float] = {}
    for token, logprob in (*entry.top[:k], (entry.token, entry.logprob)):
        top.setdefault(token, _finite(logprob))
    return top


def _finite(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)
