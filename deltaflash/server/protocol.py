"""OpenAI request bodies -> validated, typed requests. Every error names the field (OpenAI's `param`).

Checks here need no model: types, ranges, unknown fields. Checks against the model (context length,
vocabulary, chat template) happen in `frontend.py`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from types import MappingProxyType

from deltaflash.server.errors import BadRequest

# OpenAI fields deltaflash does not implement: accepted only at their neutral value
_NEUTRAL = MappingProxyType({
    "n": (1,), "best_of": (1,), "echo": (False,), "logprobs": (False, 0), "top_logprobs": (0,),
    "presence_penalty": (0,), "frequency_penalty": (0,), "repetition_penalty": (1,), "logit_bias": ({},),
    "suffix": ("",), "tools": ([],), "tool_choice": ("none",), "response_format": ({"type": "text"},),
    "parallel_tool_calls": (False, True), "store": (False,),
})
_FREE_TEXT = ("user",)  # accepted and ignored when a string
_COMMON = frozenset({"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids",
                     "ignore_eos", "stream", "stream_options", "return_token_ids", *_NEUTRAL, *_FREE_TEXT})
_COMPLETION_FIELDS = _COMMON | {"prompt"}
_CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens"}
_ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOPS = 16


@dataclass(frozen=True)
class Sampling:
    """max_tokens None: the endpoint's default. top_k 0: off. stop_token_ids not yet range-checked."""

    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop_strings: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool


@dataclass(frozen=True)
class ApiRequest:
    """A validated /v1/completions body (`prompt`: text or token ids) or /v1/chat/completions body
    (`messages`: ({"role", "content"}, ...) with content flattened to text)."""

    chat: bool
    model: str | None
    prompt: str | tuple[int, ...] | None
    messages: tuple[dict, ...] | None
    sampling: Sampling
    stream: bool
    include_usage: bool
    return_token_ids: bool


def parse_json(raw: bytes) -> dict:
    def reject_constant(name):
        raise ValueError(f"{name} is not valid JSON")

    try:
        body = json.loads(raw, parse_constant=reject_constant)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise BadRequest(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise BadRequest(f"request body must be a JSON object, got {_kind(body)}", code="invalid_json")
    return body


def parse_completion(body: dict) -> ApiRequest:
    fields = _Fields(body, _COMPLETION_FIELDS)
    prompt = _prompt(body.get("prompt"))
    return _request(fields, chat=False, prompt=prompt, messages=None, max_tokens=fields.int("max_tokens", lo=1))


def parse_chat(body: dict) -> ApiRequest:
    fields = _Fields(body, _CHAT_FIELDS)
    max_tokens = fields.int("max_tokens", lo=1)
    max_completion = fields.int("max_completion_tokens", lo=1)
    if max_tokens is not None and max_completion is not None and max_tokens != max_completion:
        raise BadRequest(f"max_tokens ({max_tokens}) and max_completion_tokens ({max_completion}) disagree; "
                         "give one", param="max_completion_tokens")
    return _request(fields, chat=True, prompt=None, messages=_messages(body.get("messages")),
                    max_tokens=max_tokens if max_tokens is not None else max_completion)


def _request(fields: "_Fields", chat: bool, prompt, messages, max_tokens) -> ApiRequest:
    stream = fields.bool("stream", False)
    options = fields.body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise BadRequest("stream_options is only allowed when stream is true", param="stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise BadRequest('stream_options must be an object {"include_usage": bool}', param="stream_options")
        include_usage = _Fields(options, frozenset({"include_usage"}), "stream_options.").bool("include_usage", False)
    strings, ids = _stop(fields.body.get("stop"))
    extra_ids = fields.body.get("stop_token_ids")
    if extra_ids is not None:
        if not isinstance(extra_ids, list) or not all(_is_int(t) for t in extra_ids):
            raise BadRequest("stop_token_ids must be a list of integer token ids", param="stop_token_ids")
        ids += tuple(extra_ids)
    sampling = Sampling(
        max_tokens=max_tokens,
        temperature=fields.float("temperature", 1.0, lo=0.0),
        top_p=fields.float("top_p", 1.0, lo=0.0, lo_open=True, hi=1.0),
        top_k=max(fields.int("top_k", 0, lo=-1), 0),  # -1 and 0 both mean off
        seed=fields.int("seed", lo=-(2 ** 63), hi=2 ** 64 - 1),
        stop_strings=strings, stop_token_ids=ids, ignore_eos=fields.bool("ignore_eos", False))
    model = fields.body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest(f"model must be a string, got {_kind(model)}", param="model")
    return ApiRequest(chat=chat, model=model, prompt=prompt, messages=messages, sampling=sampling, stream=stream,
                      include_usage=include_usage, return_token_ids=fields.bool("return_token_ids", False))


class _Fields:
    """Typed reads of one JSON object; rejects unknown fields and unsupported non-neutral values."""

    def __init__(self, body: dict, known: frozenset[str], prefix: str = ""):
        self.body, self.prefix = body, prefix
        for name in body:
            if name not in known:
                raise BadRequest(f"unknown field {prefix + name!r}", param=prefix + name)
        for name, neutral in _NEUTRAL.items():
            value = body.get(name)
            if name in body and value is not None and not any(_same(value, n) for n in neutral):
                only = " or ".join(json.dumps(n) for n in neutral)
                raise BadRequest(f"{name} = {json.dumps(value)} is not supported (only {only})", param=name,
                                 code="unsupported_value")
        for name in _FREE_TEXT:
            if body.get(name) is not None and not isinstance(body[name], str):
                raise BadRequest(f"{name} must be a string, got {_kind(body[name])}", param=name)

    def int(self, name: str, default: int | None = None, lo: int | None = None, hi: int | None = None):
        value = self.body.get(name)
        if value is None:
            return default
        if not _is_int(value):
            raise BadRequest(f"{self.prefix}{name} must be an integer, got {_kind(value)}", param=self.prefix + name)
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise BadRequest(f"{self.prefix}{name} must be {_range(lo, hi)}, got {value}", param=self.prefix + name)
        return value

    def float(self, name: str, default: float, lo: float, hi: float | None = None, lo_open: bool = False) -> float:
        value = self.body.get(name)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise BadRequest(f"{self.prefix}{name} must be a finite number, got {_kind(value)}", param=self.prefix + name)
        if value < lo or (lo_open and value == lo) or (hi is not None and value > hi):
            span = f"in ({lo}, {hi}]" if lo_open else _range(lo, hi)
            raise BadRequest(f"{self.prefix}{name} must be {span}, got {value}", param=self.prefix + name)
        return float(value)

    def bool(self, name: str, default: bool) -> bool:
        value = self.body.get(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise BadRequest(f"{self.prefix}{name} must be true or false, got {_kind(value)}", param=self.prefix + name)
        return value


def _prompt(prompt) -> str | tuple[int, ...]:
    if prompt is None:
        raise BadRequest("prompt is required", param="prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise BadRequest(f"prompt: only one prompt per request is supported, got {len(prompt)}", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("prompt must not be empty", param="prompt")
        return prompt
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        return tuple(prompt)
    raise BadRequest("prompt must be a non-empty string or a non-empty list of integer token ids", param="prompt")


def _messages(messages) -> tuple[dict, ...]:
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list of {role, content} objects", param="messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise BadRequest(f"{where} must be an object, got {_kind(m)}", param=where)
        for key in m:
            if key not in ("role", "content", "name"):
                raise BadRequest(f"unknown field {where}.{key}", param=f"{where}.{key}")
        if m.get("role") not in _ROLES:
            raise BadRequest(f"{where}.role must be one of {', '.join(_ROLES)}, got {m.get('role')!r}",
                             param=f"{where}.role")
        out.append({"role": m["role"], "content": _content(m.get("content"), f"{where}.content")})
    return tuple(out)


def _content(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise BadRequest(f"{where}[{j}] must be a text part {{\"type\": \"text\", \"text\": str}} "
                                 "(only text is supported)", param=f"{where}[{j}]")
            texts.append(part["text"])
        return "".join(texts)
    raise BadRequest(f"{where} must be a string or a list of text parts, got {_kind(content)}", param=where)


def _stop(stop) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """`stop`: a string, or a list of strings and integer token ids."""
    if stop is None:
        return (), ()
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, list) or len(items) > MAX_STOPS:
        raise BadRequest(f"stop must be a string or a list of at most {MAX_STOPS} strings / token ids", param="stop")
    strings, ids = [], []
    for item in items:
        if isinstance(item, str) and item:
            strings.append(item)
        elif _is_int(item):
            ids.append(item)
        else:
            raise BadRequest(f"stop entries must be non-empty strings or integer token ids, got {item!r}", param="stop")
    return tuple(strings), tuple(ids)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _same(value, neutral) -> bool:
    return type(value) is type(neutral) and value == neutral or (
        _is_int(neutral) and isinstance(value, (int, float)) and not isinstance(value, bool) and value == neutral)


def _range(lo, hi) -> str:
    if hi is None:
        return f">= {lo}"
    return f"<= {hi}" if lo is None else f"in [{lo}, {hi}]"


def _kind(value) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), f"{type(value).__name__} {value!r}")
