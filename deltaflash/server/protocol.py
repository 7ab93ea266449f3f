"""OpenAI request bodies -> validated, typed requests. Every error names the field (OpenAI's `param`).

Checks here need no model: types, ranges, valid Unicode. Checks against the model (context length,
vocabulary, chat template) happen in `frontend.py`. A field missing from the tables below is unknown: it
is ignored and listed in the request's `ignored_fields` (the server logs each name once), or rejected
with a 400 under `--strict-fields`.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, replace
from types import MappingProxyType

from deltaflash.core.request import MAX_LOGPROBS, GrammarSpec
from deltaflash.errors import RequestError
from deltaflash.server.errors import BadRequest
from deltaflash.server.tools import ToolRequest, parse_tools
from deltaflash.tokenizer import ChatOptions, DecodeOptions, reserved_template_names, utf8_length

# The fields both generation endpoints know. None: implemented (`_request` reads it); a tuple: not
# implemented, so only these neutral values are accepted (another value is a 400 naming the field).
# guided_* and structured_outputs are vLLM's structured-output fields.
_COMMON = MappingProxyType({
    "model": None, "max_tokens": None, "temperature": None, "top_p": None, "top_k": None, "seed": None,
    "stop": None, "stop_token_ids": None, "ignore_eos": None, "stream": None, "stream_options": None,
    "return_token_ids": None, "skip_special_tokens": None, "spaces_between_special_tokens": None,
    "user": None,  # accepted and ignored when a string
    "n": None, "best_of": None, "logprobs": None, "presence_penalty": None, "frequency_penalty": None,
    "repetition_penalty": None, "logit_bias": None, "min_p": None, "min_tokens": None, "response_format": None,
    "guided_json": None, "guided_regex": None, "guided_choice": None, "guided_grammar": None,
    "structured_outputs": None, "tree_budget": None, "prompt_logprobs": None,
    "echo": (False,), "suffix": ("",), "store": (False,),
})
_COMPLETION_NEUTRAL = MappingProxyType({**_COMMON, "echo": None})  # completions implement echo
_COMPLETION_FIELDS = frozenset({*_COMMON, "prompt"})
_TEMPLATE_FIELDS = frozenset({"add_generation_prompt", "continue_final_message", "chat_template_kwargs"})
_CHAT_FIELDS = frozenset({*_COMMON, *_TEMPLATE_FIELDS, "messages", "max_completion_tokens", "top_logprobs", "tools",
                          "tool_choice", "parallel_tool_calls", "include_reasoning"})
_RESPONSE_FORMATS = ("text", "json_object", "json_schema")
_JSON_SCHEMA_FIELDS = frozenset({"name", "description", "schema", "strict"})
# structured_outputs key -> (how its value is read, the grammar kind)
_STRUCTURED_OUTPUTS = MappingProxyType({"json": ("schema", "json_schema"), "regex": ("text", "regex"),
                                        "choice": ("choice", "regex"), "grammar": ("text", "lark"),
                                        "json_object": ("flag", "json_object")})
_GUIDED = MappingProxyType({"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                            "guided_grammar": "grammar"})
_REGEX_SPECIAL = re.compile(r"[\\.+*?()|\[\]{}^$]")
_STREAM_OPTIONS = frozenset({"include_usage"})
_MESSAGE_FIELDS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id", "reasoning",
                             "reasoning_content"})
_TOKENIZE_FIELDS = frozenset({"model", "prompt", "messages", "tools", *_TEMPLATE_FIELDS})
_DETOKENIZE_FIELDS = frozenset({"model", "tokens", "skip_special_tokens", "spaces_between_special_tokens"})
_ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOPS = 16
MAX_CHOICES = 64        # n x prompts: engine requests one API request may start
MAX_LOGIT_BIAS = 1024   # logit_bias entries (the engine rebuilds the bias rows every step)


@dataclass(frozen=True)
class Sampling:
    """max_tokens None: the endpoint's default. top_k 0: off. stop_token_ids and logit_bias token ids not
    yet checked against the vocabulary. logprobs: None, or how many top logprobs per token (0 = only the
    chosen token's). grammar: structured output, from the request field `grammar_param`."""

    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop_strings: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    logprobs: int | None = None
    grammar: GrammarSpec | None = None
    grammar_param: str = ""
    tree_budget: int | None = None  # deltaflash's extension: nodes of this request's draft trees
    prompt_logprobs: int | None = None  # each prompt token's logprob and top ones (echo, vLLM's prompt_logprobs)


@dataclass(frozen=True)
class ApiRequest:
    """A validated /v1/completions body (`prompts`: one or more, each text or token ids) or
    /v1/chat/completions body (`messages`: ({"role", "content", and "name", "tool_calls", "tool_call_id"
    when given}, ...) with content flattened to text). `n`: samples per prompt. `text_bytes`: UTF-8 bytes
    of every prompt text, or of every string in the messages and the tools' JSON (0 for token ids);
    `prompt_bytes` those of each prompt. `ignored_fields`: unknown fields, as "name" or "messages[].name".
    `tools`: a chat request's function tools; None without tools or with tool_choice "none" (then the
    template renders no tools and the answer is all content). `echo` (completions): each choice's text and
    logprobs begin with its prompt's. `prompt_logprobs` (vLLM's field): None, or how many top logprobs each
    prompt token's entry lists. `chat_options` (chat): how the template renders the messages.
    `include_reasoning` (vLLM's chat field): False drops the thinking a reasoning parser splits off."""

    chat: bool
    model: str | None
    prompts: tuple[str | tuple[int, ...], ...] | None
    messages: tuple[dict, ...] | None
    sampling: Sampling
    stream: bool
    include_usage: bool
    return_token_ids: bool
    decode: DecodeOptions
    text_bytes: int
    n: int = 1
    prompt_bytes: tuple[int, ...] = ()
    ignored_fields: tuple[str, ...] = ()
    tools: ToolRequest | None = None
    echo: bool = False
    prompt_logprobs: int | None = None
    chat_options: ChatOptions = ChatOptions()
    include_reasoning: bool = True


@dataclass(frozen=True)
class TokenizeRequest:
    """A /tokenize body: `prompt` (text, tokenized as /v1/completions does) or `messages` (through the
    chat template, as /v1/chat/completions does, with the generation prompt unless told otherwise, and
    the `tools` when given, as `chat_options` say)."""

    model: str | None
    prompt: str | None
    messages: tuple[dict, ...] | None
    chat_options: ChatOptions
    text_bytes: int
    ignored_fields: tuple[str, ...] = ()
    tools: ToolRequest | None = None


@dataclass(frozen=True)
class DetokenizeRequest:
    model: str | None
    tokens: tuple[int, ...]
    decode: DecodeOptions
    ignored_fields: tuple[str, ...] = ()


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


def parse_completion(body: dict, strict: bool = False) -> ApiRequest:
    """`logprobs`: an integer, the top logprobs per token (OpenAI's legacy completions). `echo`: the answer
    repeats the prompt, and with logprobs scores its tokens (the first has none: null); max_tokens may then be
    0, the prompt scored alone (how evaluation harnesses compute a text's likelihood)."""
    reader = _Reader(strict)
    fields = reader.top_level(body, _COMPLETION_FIELDS, _COMPLETION_NEUTRAL)
    prompts = _prompts(body.get("prompt"))
    prompt_bytes = []
    for i, prompt in enumerate(prompts):
        before = reader.text_bytes
        if isinstance(prompt, str):
            reader.text(prompt, "prompt" if len(prompts) == 1 else f"prompt[{i}]")
        prompt_bytes.append(reader.text_bytes - before)
    echo = fields.bool("echo", False)
    max_tokens = fields.int("max_tokens", lo=0 if echo else 1)
    logprobs = fields.int("logprobs", lo=0, hi=MAX_LOGPROBS)
    req = _request(fields, reader, chat=False, prompts=prompts, messages=None, max_tokens=max_tokens,
                   logprobs=logprobs, prompt_bytes=tuple(prompt_bytes))
    if not echo:
        return req
    asked = [k for k in (logprobs, 0 if max_tokens == 0 else None, req.prompt_logprobs) if k is not None]
    return replace(req, echo=True, sampling=replace(req.sampling, prompt_logprobs=max(asked, default=None)))


def parse_chat(body: dict, strict: bool = False) -> ApiRequest:
    """`logprobs`: true or false; `top_logprobs` (0 when not given) needs it true when above 0. A
    tool_choice that forces calls ("required", a named function) constrains the answer with a grammar of
    its own, so it excludes the structured-output fields."""
    reader = _Reader(strict)
    fields = reader.top_level(body, _CHAT_FIELDS)
    tools = _tools(body, reader)
    chat_options = _chat_options(fields, reader)
    max_tokens = fields.int("max_tokens", lo=1)
    max_completion = fields.int("max_completion_tokens", lo=1)
    if max_tokens is not None and max_completion is not None and max_tokens != max_completion:
        raise BadRequest(f"max_tokens ({max_tokens}) and max_completion_tokens ({max_completion}) disagree; "
                         "give one", param="max_completion_tokens")
    logprobs, top = fields.bool("logprobs", False), fields.int("top_logprobs", 0, lo=0, hi=MAX_LOGPROBS)
    if top > 0 and not logprobs:
        raise BadRequest(f"top_logprobs = {top} needs logprobs: true", param="top_logprobs")
    req = _request(fields, reader, chat=True, prompts=None, messages=_messages(body.get("messages"), reader),
                   max_tokens=max_tokens if max_tokens is not None else max_completion,
                   logprobs=top if logprobs else None, tools=tools)
    req = replace(req, chat_options=chat_options, include_reasoning=fields.bool("include_reasoning", True))
    if tools is not None and tools.choice in ("required", "function") and req.sampling.grammar is not None:
        forced = '"required"' if tools.choice == "required" else f"function {tools.function!r}"
        param = req.sampling.grammar_param
        raise BadRequest(f"tool_choice {forced} constrains the answer to tool calls, so {param} cannot constrain "
                         "it too: give one", param=param)
    return req


def parse_tokenize(body: dict, strict: bool = False) -> TokenizeRequest:
    reader = _Reader(strict)
    reader.check_known(body, _TOKENIZE_FIELDS)
    prompt, messages = body.get("prompt"), body.get("messages")
    if (prompt is None) == (messages is None):
        raise BadRequest("give either prompt (text) or messages (a chat)",
                         param="messages" if prompt is not None else "prompt")
    if prompt is not None and body.get("tools") is not None:
        raise BadRequest("tools are rendered by the chat template: give messages, not prompt", param="tools")
    tools = _tools({"tools": body.get("tools")}, reader)
    chat_options = _chat_options(_Fields(body), reader)
    if prompt is not None:
        if not isinstance(prompt, str):
            raise BadRequest(f"prompt must be a string, got {_kind(prompt)}", param="prompt")
        reader.text(prompt, "prompt")
    else:
        messages = _messages(messages, reader)
    return TokenizeRequest(_model(body), prompt, messages, chat_options, reader.text_bytes, tuple(reader.ignored),
                           tools)


def parse_detokenize(body: dict, strict: bool = False) -> DetokenizeRequest:
    """Special tokens are kept unless `skip_special_tokens` (as vLLM's /detokenize)."""
    reader = _Reader(strict)
    reader.check_known(body, _DETOKENIZE_FIELDS)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(_is_int(t) for t in tokens):
        raise BadRequest("tokens must be a list of integer token ids", param="tokens")
    fields = _Fields(body)
    options = DecodeOptions(fields.bool("skip_special_tokens", False),
                            fields.bool("spaces_between_special_tokens", True))
    return DetokenizeRequest(_model(body), tuple(tokens), options, tuple(reader.ignored))


def _request(fields: "_Fields", reader: "_Reader", chat: bool, prompts, messages, max_tokens: int | None,
             logprobs: int | None, prompt_bytes: tuple[int, ...] = (), tools: ToolRequest | None = None) -> ApiRequest:
    stream = fields.bool("stream", False)
    options = fields.body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise BadRequest("stream_options is only allowed when stream is true", param="stream_options")
        if not isinstance(options, dict):
            raise BadRequest('stream_options must be an object {"include_usage": bool}', param="stream_options")
        reader.check_known(options, _STREAM_OPTIONS, "stream_options.")
        include_usage = _Fields(options, "stream_options.").bool("include_usage", False)
    strings, ids = _stop(fields.body.get("stop"))
    extra_ids = fields.body.get("stop_token_ids")
    if extra_ids is not None:
        if not isinstance(extra_ids, list) or not all(_is_int(t) for t in extra_ids):
            raise BadRequest("stop_token_ids must be a list of integer token ids", param="stop_token_ids")
        ids += tuple(extra_ids)
    n = fields.int("n", 1, lo=1, hi=MAX_CHOICES)
    choices = n * (1 if prompts is None else len(prompts))
    if choices > MAX_CHOICES:
        raise BadRequest(f"n = {n} samples of {len(prompts)} prompts are {choices} choices; at most {MAX_CHOICES} "
                         "per request", param="n")
    best_of = fields.int("best_of", lo=1)
    if best_of is not None and best_of != n:
        raise BadRequest(f"best_of = {best_of} is not supported: only best_of = n ({n}), every sample returned",
                         param="best_of", code="unsupported_value")
    grammar, grammar_param = _grammar(fields.body, reader)
    prompt_logprobs = fields.int("prompt_logprobs", lo=0, hi=MAX_LOGPROBS)
    if prompt_logprobs is not None and stream:
        raise BadRequest("prompt_logprobs are returned with the whole response: not with stream",
                         param="prompt_logprobs")
    sampling = Sampling(
        max_tokens=max_tokens,
        temperature=fields.float("temperature", 1.0, lo=0.0),
        top_p=fields.float("top_p", 1.0, lo=0.0, lo_open=True, hi=1.0),
        top_k=max(fields.int("top_k", 0, lo=-1), 0),  # -1 and 0 both mean off
        seed=fields.int("seed", lo=0, hi=2 ** 63 - 1),  # the engine's seeds are 63 bits
        stop_strings=strings, stop_token_ids=ids, ignore_eos=fields.bool("ignore_eos", False),
        min_p=fields.float("min_p", 0.0, lo=0.0, hi=1.0),
        presence_penalty=fields.float("presence_penalty", 0.0, lo=-2.0, hi=2.0),
        frequency_penalty=fields.float("frequency_penalty", 0.0, lo=-2.0, hi=2.0),
        repetition_penalty=fields.float("repetition_penalty", 1.0, lo=0.0, lo_open=True, hi=10.0),
        logit_bias=_logit_bias(fields.body.get("logit_bias")), min_tokens=fields.int("min_tokens", 0, lo=0),
        logprobs=logprobs, grammar=grammar, grammar_param=grammar_param,
        tree_budget=fields.int("tree_budget", lo=1, hi=64), prompt_logprobs=prompt_logprobs)
    decode = DecodeOptions(skip_special_tokens=fields.bool("skip_special_tokens", True),
                           spaces_between_special_tokens=fields.bool("spaces_between_special_tokens", True))
    return ApiRequest(chat=chat, model=_model(fields.body), prompts=prompts, messages=messages, sampling=sampling,
                      stream=stream, include_usage=include_usage,
                      return_token_ids=fields.bool("return_token_ids", False), decode=decode,
                      text_bytes=reader.text_bytes, n=n, prompt_bytes=prompt_bytes,
                      ignored_fields=tuple(reader.ignored), tools=tools, prompt_logprobs=prompt_logprobs)


class _Reader:
    """What parsing one request found beyond its values: unknown fields (ignored and listed, or a 400
    when `strict`) and the UTF-8 bytes of the text the tokenizer will see."""

    def __init__(self, strict: bool):
        self.strict, self.ignored, self.text_bytes = strict, [], 0

    def check_known(self, obj: dict, known: frozenset[str], where: str = "", pattern: str | None = None) -> None:
        """`where`: the object's path in messages ("messages[2]."); `pattern`: its path in `ignored`
        ("messages[]."), so that each name is listed alike whatever the index."""
        for name in obj:
            if name not in known:
                if self.strict:
                    raise BadRequest(f"unknown field {where + name!r}", param=where + name)
                self.ignored.append((where if pattern is None else pattern) + name)

    def top_level(self, body: dict, known: frozenset[str], neutrals=_COMMON) -> "_Fields":
        """The body's fields; fields not implemented yet (those `neutrals` gives values) must hold a neutral value."""
        self.check_known(body, known)
        for name, neutral in neutrals.items():
            value = body.get(name)
            if neutral is not None and value is not None and not any(_same(value, n) for n in neutral):
                only = " or ".join(json.dumps(n) for n in neutral)
                raise BadRequest(f"{name} = {json.dumps(value)} is not supported (only {only})", param=name,
                                 code="unsupported_value")
        if body.get("user") is not None and not isinstance(body["user"], str):
            raise BadRequest(f"user must be a string, got {_kind(body['user'])}", param="user")
        return _Fields(body)

    def text(self, value, where: str) -> str:
        """A string the tokenizer will see: valid Unicode, counted in `text_bytes`."""
        if not isinstance(value, str):
            raise BadRequest(f"{where} must be a string, got {_kind(value)}", param=where)
        try:
            self.text_bytes += utf8_length(value, where)
        except RequestError as exc:
            raise BadRequest(str(exc), param=where) from None
        return value


class _Fields:
    """Typed reads of one JSON object; `prefix` is its path in messages ("stream_options.")."""

    def __init__(self, body: dict, prefix: str = ""):
        self.body, self.prefix = body, prefix

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


def _model(body: dict) -> str | None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest(f"model must be a string, got {_kind(model)}", param="model")
    return model


def _prompts(prompt) -> tuple[str | tuple[int, ...], ...]:
    """`prompt`: a string, a list of token ids, or a list of several of either (a batch)."""
    if prompt is None:
        raise BadRequest("prompt is required", param="prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) > MAX_CHOICES:
            raise BadRequest(f"prompt: at most {MAX_CHOICES} prompts per request, got {len(prompt)}", param="prompt")
        return tuple(_prompt(p, f"prompt[{i}]") for i, p in enumerate(prompt))
    return (_prompt(prompt, "prompt"),)


def _prompt(prompt, where: str) -> str | tuple[int, ...]:
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest(f"{where} must not be empty", param=where)
        return prompt
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        return tuple(prompt)
    raise BadRequest(f"{where} must be a non-empty string or a non-empty list of integer token ids", param=where)


def _logit_bias(bias) -> tuple[tuple[int, float], ...]:
    """{"token id": bias in [-100, 100], ...} -> ((token id, bias), ...) sorted by token id."""
    if bias is None:
        return ()
    if not isinstance(bias, dict):
        raise BadRequest(f'logit_bias must be an object {{"token id": bias}}, got {_kind(bias)}', param="logit_bias")
    if len(bias) > MAX_LOGIT_BIAS:
        raise BadRequest(f"logit_bias: at most {MAX_LOGIT_BIAS} tokens, got {len(bias)}", param="logit_bias")
    out = []
    for key, value in bias.items():
        if not re.fullmatch(r"-?[0-9]+", key):
            raise BadRequest(f"logit_bias keys must be token ids (integers as strings), got {key!r}",
                             param="logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise BadRequest(f"logit_bias[{key}] must be a number in [-100, 100], got {json.dumps(value)}",
                             param="logit_bias")
        out.append((int(key), float(value)))
    return tuple(sorted(out))


def _grammar(body: dict, reader: _Reader) -> tuple[GrammarSpec | None, str]:
    """The request's structured output and the field it came from (response_format, a guided_* field
    or a structured_outputs key); at most one may be given."""
    found = []
    fmt = body.get("response_format")
    if fmt is not None:
        spec = _response_format(fmt, reader)
        if spec is not None:
            found.append(("response_format", spec))
    for name, key in _GUIDED.items():
        if body.get(name) is not None:
            found.append((name, _structured(key, body[name], name)))
    outputs = body.get("structured_outputs")
    if outputs is not None:
        if not isinstance(outputs, dict):
            raise BadRequest("structured_outputs must be an object with one of "
                             f"{', '.join(_STRUCTURED_OUTPUTS)}, got {_kind(outputs)}", param="structured_outputs")
        reader.check_known(outputs, frozenset(_STRUCTURED_OUTPUTS), "structured_outputs.")
        for key in _STRUCTURED_OUTPUTS:
            spec = _structured(key, outputs.get(key), f"structured_outputs.{key}")
            if spec is not None:
                found.append((f"structured_outputs.{key}", spec))
    if len(found) > 1:
        raise BadRequest(f"give one structured output; got {found[0][0]} and {found[1][0]}", param=found[1][0])
    return (found[0][1], found[0][0]) if found else (None, "")


def _response_format(fmt, reader: _Reader) -> GrammarSpec | None:
    """{"type": "text"} (None), {"type": "json_object"} or {"type": "json_schema", "json_schema":
    {"name", "schema", "description", "strict"}} (the schema is always enforced)."""
    if not isinstance(fmt, dict) or fmt.get("type") not in _RESPONSE_FORMATS:
        raise BadRequest(f"response_format must be an object with type one of {', '.join(_RESPONSE_FORMATS)}, got "
                         f"{json.dumps(fmt)[:200]}", param="response_format")
    kind = fmt["type"]
    reader.check_known(fmt, frozenset({"type", kind}) if kind == "json_schema" else frozenset({"type"}),
                       "response_format.")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object")
    spec, where = fmt.get("json_schema"), "response_format.json_schema"
    if not isinstance(spec, dict):
        raise BadRequest(f'{where} must be an object {{"name", "schema"}}, got {_kind(spec)}', param=where)
    reader.check_known(spec, _JSON_SCHEMA_FIELDS, where + ".")
    if not isinstance(spec.get("schema"), dict):
        raise BadRequest(f"{where}.schema must be a JSON schema (an object), got {_kind(spec.get('schema'))}",
                         param=f"{where}.schema")
    for key in ("name", "description"):
        if spec.get(key) is not None and not isinstance(spec[key], str):
            raise BadRequest(f"{where}.{key} must be a string, got {_kind(spec[key])}", param=f"{where}.{key}")
    _Fields(spec, where + ".").bool("strict", True)  # type-checked only: the schema is always enforced
    return GrammarSpec("json_schema", json.dumps(spec["schema"]))


def _structured(key: str, value, where: str) -> GrammarSpec | None:
    """One vLLM structured-output value (key as in `_STRUCTURED_OUTPUTS`): a JSON schema (an object or its
    text), a regular expression, a Lark grammar, a list of strings to choose from, or json_object: true."""
    if value is None:
        return None
    read, kind = _STRUCTURED_OUTPUTS[key]
    if read == "schema":
        if isinstance(value, dict):
            return GrammarSpec(kind, json.dumps(value))
        if isinstance(value, str):
            return GrammarSpec(kind, _unicode(value, where))
        raise BadRequest(f"{where} must be a JSON schema (an object or its JSON text), got {_kind(value)}", param=where)
    if read == "text":
        if not isinstance(value, str) or not value:
            raise BadRequest(f"{where} must be a non-empty string, got {_kind(value)}", param=where)
        return GrammarSpec(kind, _unicode(value, where))
    if read == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise BadRequest(f"{where} must be a non-empty list of non-empty strings", param=where)
        return GrammarSpec(kind, "|".join(_REGEX_SPECIAL.sub(r"\\\g<0>", _unicode(c, where)) for c in value))
    if not isinstance(value, bool):
        raise BadRequest(f"{where} must be true or false, got {_kind(value)}", param=where)
    return GrammarSpec(kind) if value else None


def _unicode(value: str, where: str) -> str:
    try:
        utf8_length(value, where)
    except RequestError as exc:
        raise BadRequest(str(exc), param=where) from None
    return value


def _tools(body: dict, reader: _Reader) -> ToolRequest | None:
    """The body's tools (server/tools.py `parse_tools`); None for tool_choice "none". The JSON of the tool
    definitions, which the template renders, counts in `text_bytes`."""
    tools = parse_tools(body)
    if tools is None or tools.choice == "none":
        return None
    reader.text_bytes += sum(len(json.dumps(t.definition, ensure_ascii=False).encode()) for t in tools.tools)
    return tools


def _chat_options(fields: "_Fields", reader: _Reader) -> ChatOptions:
    """vLLM's chat-template fields: add_generation_prompt (default true), continue_final_message (default false;
    not with add_generation_prompt) and chat_template_kwargs, an object of more template variables (Qwen3's
    enable_thinking, ...) whose JSON counts in `text_bytes`; none of them may be one the server sets itself."""
    add, cont = fields.bool("add_generation_prompt", True), fields.bool("continue_final_message", False)
    if add and cont:
        raise BadRequest("continue_final_message leaves the last message open, add_generation_prompt opens a new "
                         "turn: set add_generation_prompt to false", param="continue_final_message")
    kwargs = fields.body.get("chat_template_kwargs")
    if kwargs is None:
        return ChatOptions(add, cont)
    if not isinstance(kwargs, dict):
        raise BadRequest(f"chat_template_kwargs must be an object of template variables, got {_kind(kwargs)}",
                         param="chat_template_kwargs")
    taken = sorted(reserved_template_names() & set(kwargs))
    if taken:
        raise BadRequest(f"chat_template_kwargs may not set {', '.join(taken)}: the server renders the template "
                         "with its own (add_generation_prompt and continue_final_message are fields of their own)",
                         param="chat_template_kwargs")
    reader.text_bytes += len(json.dumps(kwargs, ensure_ascii=False).encode())
    return ChatOptions(add, cont, MappingProxyType(dict(kwargs)))


def _messages(messages, reader: _Reader) -> tuple[dict, ...]:
    """Each message as the chat template gets it: role, content (text), and name, tool_call_id and an
    assistant's tool_calls and thinking when given - its `reasoning` (vLLM's name) or `reasoning_content` (the
    older one), passed on as `reasoning_content`, the name Qwen's templates read."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list of {role, content} objects", param="messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise BadRequest(f"{where} must be an object, got {_kind(m)}", param=where)
        reader.check_known(m, _MESSAGE_FIELDS, where + ".", "messages[].")
        if m.get("role") not in _ROLES:
            raise BadRequest(f"{where}.role must be one of {', '.join(_ROLES)}, got {m.get('role')!r}",
                             param=f"{where}.role")
        message = {"role": m["role"]}
        if m.get("tool_calls") is not None:
            if m["role"] != "assistant":
                raise BadRequest(f"{where}.tool_calls is only allowed on assistant messages",
                                 param=f"{where}.tool_calls")
            message["tool_calls"] = _tool_calls(m["tool_calls"], f"{where}.tool_calls", reader)
        calls_only = m.get("content") is None and "tool_calls" in message  # OpenAI: content may be null then
        message["content"] = "" if calls_only else reader.text(_content(m.get("content"), f"{where}.content"),
                                                              f"{where}.content")
        for key in ("name", "tool_call_id"):
            if m.get(key) is not None:
                message[key] = reader.text(m[key], f"{where}.{key}")
        for key in ("reasoning_content", "reasoning"):
            if m.get(key) is not None and "reasoning_content" not in message:
                if m["role"] != "assistant":
                    raise BadRequest(f"{where}.{key} is only allowed on assistant messages", param=f"{where}.{key}")
                message["reasoning_content"] = reader.text(m[key], f"{where}.{key}")
        out.append(message)
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


_TOOL_CALL = '{"id": str, "type": "function", "function": {"name": str, "arguments": str}}'


def _tool_calls(calls, where: str, reader: _Reader) -> list[dict]:
    """An assistant's tool calls, checked and passed to the chat template as given."""
    if not isinstance(calls, list):
        raise BadRequest(f"{where} must be a list of {_TOOL_CALL}, got {_kind(calls)}", param=where)
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(call, dict) and isinstance(call.get("id"), str) and call.get("type") == "function"
                and isinstance(function, dict)
                and all(isinstance(function.get(k), str) for k in ("name", "arguments"))):
            raise BadRequest(f"{where}[{j}] must be {_TOOL_CALL}, got {json.dumps(call)[:200]}", param=f"{where}[{j}]")
        reader.text(call["id"], f"{where}[{j}].id")
        for key in ("name", "arguments"):
            reader.text(function[key], f"{where}[{j}].function.{key}")
    return calls


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
