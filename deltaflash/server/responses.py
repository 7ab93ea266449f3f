"""OpenAI response bodies and server-sent-event chunks for one request."""

from __future__ import annotations

import json
from dataclasses import dataclass

DONE = b"data: [DONE]\n\n"


def sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


@dataclass(frozen=True)
class Formatter:
    """`return_token_ids` adds `token_ids` to each choice (and `prompt_token_ids` to full bodies)."""

    chat: bool
    request_id: str
    model: str
    created: int
    return_token_ids: bool

    def body(self, text: str, token_ids: list[int], finish_reason: str, prompt_ids: tuple[int, ...],
             completion_tokens: int) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        if self.return_token_ids:
            choice["token_ids"] = list(token_ids)
        out = self._head(chunk=False) | {"choices": [choice], "usage": usage(len(prompt_ids), completion_tokens)}
        if self.return_token_ids:
            out["prompt_token_ids"] = list(prompt_ids)
        return out

    def chunk(self, text: str, token_ids: tuple[int, ...], finish_reason: str | None,
              include_usage: bool = False) -> dict:
        if self.chat:
            choice = {"index": 0, "delta": {"content": text} if text else {}, "logprobs": None,
                      "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        if self.return_token_ids:
            choice["token_ids"] = list(token_ids)
        out = self._head(chunk=True) | {"choices": [choice]}
        if include_usage:
            out["usage"] = None
        return out

    def role_chunk(self, include_usage: bool = False) -> dict:
        """The first chat chunk: the assistant role, no content yet."""
        out = self._head(chunk=True) | {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                      "logprobs": None, "finish_reason": None}]}
        if include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        """The last chunk with stream_options.include_usage: no choices, the request's usage."""
        return self._head(chunk=True) | {"choices": [], "usage": usage(prompt_tokens, completion_tokens)}

    def _head(self, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.request_id, "object": kind, "created": self.created, "model": self.model}
