"""OpenAI function tools for Qwen chat models: the request's `tools` / `tool_choice` / `parallel_tool_calls`
(`parse_tools`), the grammar that forces calls (`tool_grammar`) and the parser that splits generated text
into content and tool calls, streamed (`ToolCallParser`) or whole (`parse_tool_calls`).

Qwen models write a call as text between `<tool_call>` and `</tool_call>` (plain added tokens, not special
ones: they survive skip_special_tokens, and a grammar spells them as strings), in one of two styles:
    hermes (Qwen2.5, Qwen3):      <tool_call>\\n{"name": "f", "arguments": {"x": 1}}\\n</tool_call>
    xml (Qwen3-Coder, Qwen3.5):   <tool_call>\\n<function=f>\\n<parameter=x>\\n1\\n</parameter>\\n</function>\\n</tool_call>
Calls follow one another separated by "\\n". A checkpoint's style comes from its chat template
(`detect_style`); the parser reads either style whatever the checkpoint's, call by call.

Decisions:
- tool_choice "none": the chat template gets no tools (`template_tools` is None), so the model is never told
  it could call one, as OpenAI promises; vLLM renders them anyway. The parser then passes text through.
- A call is emitted whole when its `</tool_call>` arrives (one delta with id, name and all its arguments), so
  a call that is malformed, names a tool the request did not list, or is cut short becomes content text as
  the model wrote it: nothing already streamed needs taking back. Past the first call, calls are content
  when parallel_tool_calls is false.
- Whitespace touching a `<tool_call>` or `</tool_call>` tag is not content.
- The parser checks a call's shape and tool name, not its arguments against the schema (as OpenAI without
  strict, and vLLM): only a grammar ("required", named) makes them follow it.
"""

from __future__ import annotations

import copy
import json
import re
import secrets
from dataclasses import dataclass

from deltaflash.core.request import GrammarSpec
from deltaflash.server.errors import BadRequest

TOOL_STYLES = ("hermes", "xml")
TOOL_CHOICES = ("none", "auto", "required")
OPEN, CLOSE, NL = "<tool_call>", "</tool_call>", "\n"
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_TOOL_SHAPE = '{"type": "function", "function": {"name", "description"?, "parameters"?, "strict"?}}'
_CHOICE_SHAPE = '"none", "auto", "required" or {"type": "function", "function": {"name": str}}'
# JSON inside calls as the Qwen templates write it (Python json.dumps separators) and nothing more: a model
# otherwise spends its budget on whitespace the grammar would allow between tokens
_JSON_FORMAT = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}


def detect_style(chat_template) -> str:
    """"xml" when the chat template (text, or a dict of named templates) writes `<function=` calls, else
    "hermes"."""
    text = " ".join(map(str, chat_template.values())) if isinstance(chat_template, dict) else chat_template or ""
    return "xml" if "<function=" in text else "hermes"


# ---- the request -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Tool:
    """One function tool. `parameters`: the JSON schema of its arguments object (an empty object schema
    when the client gave none); `definition`: the tool as the client sent it, which the template renders."""

    name: str
    parameters: dict
    definition: dict


@dataclass(frozen=True)
class ToolRequest:
    """A chat request's tools. `choice`: "none" | "auto" | "required" | "function" (exactly one call of the
    tool named `function`); `parallel`: an answer may hold more than one call (parallel_tool_calls)."""

    tools: tuple[Tool, ...]
    choice: str = "auto"
    function: str | None = None
    parallel: bool = True

    def tool(self, name: str) -> Tool | None:
        return next((t for t in self.tools if t.name == name), None)

    def template_tools(self) -> list[dict] | None:
        """What the chat template renders (`encode_chat(..., tools=)`): every tool, or None for "none"."""
        if self.choice == "none":
            return None
        return [t.definition for t in self.tools]


def parse_tools(body: dict) -> ToolRequest | None:
    """The tools of a /v1/chat/completions body; None when it gives no tools (and tool_choice is absent or
    "none"). BadRequest naming the field otherwise wrong. tool_choice defaults to "auto", parallel_tool_calls
    to true."""
    tools, choice, parallel = body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise BadRequest(f"parallel_tool_calls must be a boolean, got {_kind(parallel)}", param="parallel_tool_calls")
    if tools is not None and not isinstance(tools, list):
        raise BadRequest(f"tools must be a list of {_TOOL_SHAPE}, got {_kind(tools)}", param="tools")
    parsed = tuple(_tool(t, f"tools[{i}]") for i, t in enumerate(tools or []))
    names = [t.name for t in parsed]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise BadRequest(f"tools[{i}].function.name {name!r} is given twice", param=f"tools[{i}].function.name")
    if not parsed:
        if choice not in (None, "none"):
            raise BadRequest("tool_choice is only allowed when tools are given", param="tool_choice")
        return None
    choice, function = _choice(choice, names)
    return ToolRequest(parsed, choice, function, True if parallel is None else parallel)


def _tool(tool, where: str) -> Tool:
    if not isinstance(tool, dict):
        raise BadRequest(f"{where} must be {_TOOL_SHAPE}, got {_kind(tool)}", param=where)
    if tool.get("type") != "function":
        raise BadRequest(f'{where}.type must be "function" (the only tool type supported), got {tool.get("type")!r}',
                         param=f"{where}.type")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise BadRequest(f"{where}.function must be an object {{name, description?, parameters?, strict?}}, got "
                         f"{_kind(function)}", param=f"{where}.function")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise BadRequest(f"{where}.function.name must be 1 to 64 characters of a-z, A-Z, 0-9, _ and -, got {name!r}",
                         param=f"{where}.function.name")
    if function.get("description") is not None and not isinstance(function["description"], str):
        raise BadRequest(f"{where}.function.description must be a string, got {_kind(function['description'])}",
                         param=f"{where}.function.description")
    if function.get("strict") is not None and not isinstance(function["strict"], bool):
        raise BadRequest(f"{where}.function.strict must be a boolean, got {_kind(function['strict'])}",
                         param=f"{where}.function.strict")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    elif not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        got = _kind(parameters) if not isinstance(parameters, dict) else f'type {parameters["type"]!r}'
        raise BadRequest(f'{where}.function.parameters must be a JSON schema of type "object", got {got}',
                         param=f"{where}.function.parameters")
    try:
        json.dumps(tool, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise BadRequest(f"{where} is not valid Unicode (it holds a lone surrogate)", param=where) from None
    return Tool(name, copy.deepcopy(parameters), copy.deepcopy(tool))


def _choice(choice, names: list[str]) -> tuple[str, str | None]:
    if choice is None:
        return "auto", None
    if isinstance(choice, str) and choice in TOOL_CHOICES:
        return choice, None
    function = choice.get("function") if isinstance(choice, dict) else None
    if not (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(function, dict)
            and isinstance(function.get("name"), str)):
        raise BadRequest(f"tool_choice must be {_CHOICE_SHAPE}, got {json.dumps(choice)[:200]}", param="tool_choice")
    if function["name"] not in names:
        raise BadRequest(f"tool_choice.function.name {function['name']!r} is not one of the tools given "
                         f"({', '.join(names)})", param="tool_choice.function.name")
    return "function", function["name"]


def _kind(value) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number" if isinstance(value, (int, float)) else type(value).__name__)


def template_messages(messages) -> list[dict]:
    """`messages` for the chat template: an assistant's tool_calls[i].function.arguments, a JSON string in
    OpenAI's format, becomes the object the Qwen templates iterate (`arguments|items`); arguments that are
    not a JSON object stay as given. The input is not modified."""
    out = []
    for message in messages:
        if message.get("tool_calls"):
            message = dict(message, tool_calls=[_template_call(c) for c in message["tool_calls"]])
        out.append(message)
    return out


def _template_call(call):
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call
    if not isinstance(arguments, dict):
        return call
    return dict(call, function=dict(function, arguments=arguments))


def finish_reason(reason: str, calls: int) -> str:
    """A choice's OpenAI finish_reason: "tool_calls" when the model stopped by itself ("stop") after at
    least one parsed call, otherwise the engine's reason ("stop", "length", ...)."""
    return "tool_calls" if reason == "stop" and calls > 0 else reason


# ---- grammar -----------------------------------------------------------------------------------------
def tool_grammar(req: ToolRequest, style: str) -> GrammarSpec | None:
    """A Lark grammar (llguidance) forcing the answer to be tool calls in `style`: exactly one call of the
    named tool, or for "required" one or more calls of any tool (exactly one when parallel_tool_calls is
    false); None for "auto" and "none". Arguments follow the tool's parameters schema: hermes as JSON; xml
    with the parameters of the schema's `properties` in their order, the `required` ones present, values of
    string type (or of no stated type) as raw text without `</parameter>` (enum / minLength / maxLength
    kept), other values as JSON. The grammar ends after the last `</tool_call>`. BadRequest naming the tool
    whose parameters llguidance cannot compile."""
    if style not in TOOL_STYLES:
        raise ValueError(f"tool style must be one of {', '.join(TOOL_STYLES)}, got {style!r}")
    if req.choice not in ("required", "function"):
        return None
    chosen = [i for i, t in enumerate(req.tools) if req.choice == "required" or t.name == req.function]
    text = _grammar(req, style, chosen, several=req.choice == "required" and req.parallel)
    error = _grammar_error(text)
    if error:
        for i in chosen:  # name the tool at fault
            if _grammar_error(_grammar(req, style, [i], several=False)):
                raise BadRequest(f"tools[{i}].function.parameters cannot constrain a tool call: {error}",
                                 param=f"tools[{i}].function.parameters")
        raise BadRequest(f"the tools cannot constrain a tool call: {error}", param="tools")
    return GrammarSpec("lark", text)


def _grammar(req: ToolRequest, style: str, chosen: list[int], several: bool) -> str:
    calls = 'call ("\\n" call)*' if several else "call"
    tools = " | ".join(f"tool_{i}" for i in chosen)
    rules = [f"start: {calls}", f"call: {_lit(OPEN + NL)} ({tools}) {_lit(NL + CLOSE)}"]
    for i in chosen:
        rules += (_hermes_rules if style == "hermes" else _xml_rules)(req.tools[i], f"tool_{i}", f"tools[{i}]")
    return "\n".join(rules) + "\n"


def _hermes_rules(tool: Tool, rule: str, where: str) -> list[str]:
    head = '{"name": ' + json.dumps(tool.name) + ', "arguments": '
    return [f"{rule}: {_lit(head)} {rule}_arguments {_lit('}')}",
            f"{rule}_arguments: %json {json.dumps(tool.parameters | {'x-guidance': _JSON_FORMAT})}"]


def _xml_rules(tool: Tool, rule: str, where: str) -> list[str]:
    properties = tool.parameters.get("properties") or {}
    required = tool.parameters.get("required") or []
    body, rules = [], []
    for j, (key, schema) in enumerate(properties.items()):
        if not key or any(c in key for c in "<>\n"):
            raise BadRequest(f"{where}.function.parameters.properties has a key {key!r} the xml tool-call format "
                             "cannot write (empty, or holding <, > or a newline)",
                             param=f"{where}.function.parameters.properties")
        name = f"{rule}_p{j}"
        body.append(name if key in required else name + "?")
        rules.append(f"{name}: {_lit(f'<parameter={key}>' + NL)} {name}_value {_lit(NL)}")
        rules += _xml_value_rules(f"{name}_value", schema, tool.parameters,
                                  f"{where}.function.parameters.properties.{key}")
    head, tail = _lit(f"<function={tool.name}>\n"), _lit("</function>")
    return [f"{rule}: {head} {' '.join(body)} {tail}", *rules]


def _xml_value_rules(rule: str, schema, parameters: dict, where: str) -> list[str]:
    """A parameter's value and the `\\n</parameter>` after it (`where`: its schema's field, for errors)."""
    end = "\n</parameter>"
    if not _is_text(schema):
        defs = {k: parameters[k] for k in ("$defs", "definitions") if k in parameters and k not in schema}
        value = schema | defs  # its "#/$defs/..." refs point at the root
        return [f"{rule}: {rule}_json {_lit(end)}",
                f"{rule}_json: %json {json.dumps(value | {'x-guidance': _JSON_FORMAT})}"]
    values = _text_values(schema)
    if values is not None:
        return [f"{rule}: {' | '.join(_lit(v + end) for v in values)}"]
    schema = schema if isinstance(schema, dict) else {}
    lo, hi = schema.get("minLength", 0), schema.get("maxLength")
    for key, bound in (("minLength", lo), ("maxLength", hi)):
        if bound is not None and (not isinstance(bound, int) or isinstance(bound, bool) or bound < 0):
            raise BadRequest(f"{where}.{key} must be a non-negative integer, got {bound!r}", param=f"{where}.{key}")
    chars = f"{{{lo},{'' if hi is None else hi}}}"
    # lazy: the value ends at the first "\n</parameter>"; the intersection keeps "</parameter>" out of it
    return [f"{rule}[lazy]: {rule.upper()}",
            f"{rule.upper()}: /(?s:.{chars})\\n<\\/parameter>/ & ~/(?s:.*)<\\/parameter>(?s:.*)<\\/parameter>/"]


def _lit(text: str) -> str:
    """A Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


def _grammar_error(text: str) -> str:
    import llguidance

    error = llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(text))
    return error.strip().splitlines()[0] if error else ""


def _types(schema) -> list:
    types = schema.get("type") if isinstance(schema, dict) else None
    return types if isinstance(types, list) else [types] if types is not None else []


def _text_values(schema) -> list[str] | None:
    """The allowed values of a text parameter when its schema lists them (enum, const)."""
    if not isinstance(schema, dict):
        return None
    values = schema["enum"] if "enum" in schema else [schema["const"]] if "const" in schema else None
    return values if isinstance(values, list) and all(isinstance(v, str) for v in values) else None


def _is_text(schema) -> bool:
    """Whether the xml style writes a parameter as raw text: its schema says it is a string, or says nothing
    of its type; else its value is JSON."""
    if not isinstance(schema, dict):
        return True
    if "type" in schema:
        return "string" in _types(schema)
    if "enum" in schema or "const" in schema:
        return _text_values(schema) is not None
    return not any(k in schema for k in ("anyOf", "oneOf", "allOf", "$ref", "properties", "items"))


# ---- parsing -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TextDelta:
    """Content text."""

    text: str


@dataclass(frozen=True)
class CallDelta:
    """A tool call's piece as OpenAI streams it: a call's first delta has `id` ("call_<hex>") and `name`,
    later ones only more `arguments` text; the arguments of one `index` joined are a JSON object. (This
    parser emits each call whole, in one delta.)"""

    index: int
    id: str | None
    name: str | None
    arguments: str

    def openai(self) -> dict:
        """The `choices[].delta.tool_calls[]` entry of a chat.completion.chunk."""
        out: dict = {"index": self.index}
        if self.id is not None:
            out |= {"id": self.id, "type": "function"}
        function = {"name": self.name} if self.name is not None else {}
        out["function"] = function | {"arguments": self.arguments}
        return out

    def message(self) -> dict:
        """The `choices[].message.tool_calls[]` entry of a whole chat.completion (a whole call's delta)."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


ToolDelta = TextDelta | CallDelta


class ToolCallParser:
    """Generated text -> content and tool calls, incrementally: `feed` each new piece of text, then `finish`
    once. Text that may still turn into a tag (a partial `<tool_call>`, and the whitespace before it) and a
    call until its `</tool_call>` are held back; at `finish` whatever is held is content. `calls`: how many
    calls were emitted. With no tools or tool_choice "none" every text is content."""

    def __init__(self, req: ToolRequest | None):
        self.req = req
        self.calls = 0
        self._passthrough = req is None or req.choice == "none"
        self._pending = ""        # text not decided yet: inside a call, or the tail that may start one
        self._in_call = False     # _pending follows an open tag
        self._gap = ""            # the whitespace dropped before that open tag (content again if the call is)
        self._after_call = False  # the last text decided was a call: whitespace that follows is not content

    def feed(self, text: str) -> list[ToolDelta]:
        if self._passthrough:
            return [TextDelta(text)] if text else []
        self._pending += text
        out: list[ToolDelta] = []
        while self._step(out):
            pass
        return out

    def finish(self) -> list[ToolDelta]:
        if self._passthrough:
            return []
        out: list[ToolDelta] = []
        self._text(out, self._gap + OPEN + self._pending if self._in_call else self._pending)
        self._pending, self._in_call = "", False
        return out

    def _step(self, out: list[ToolDelta]) -> bool:
        """Decide what can be decided at the front of the pending text; True when there may be more."""
        if self._in_call:
            end = self._pending.find(CLOSE)
            if end < 0:
                return False
            body, self._pending, self._in_call = self._pending[:end], self._pending[end + len(CLOSE):], False
            call = self._call(body)
            if call is None:
                self._text(out, self._gap + OPEN + body + CLOSE)
            else:
                out.append(call)
                self._after_call = True
            return True
        start = self._pending.find(OPEN)
        if start < 0:
            end = _text_end(self._pending)
            self._text(out, self._pending[:end])
            self._pending = self._pending[end:]
            return False
        before = self._pending[:start]
        text = before.rstrip()
        self._text(out, text)
        self._gap, self._pending, self._in_call = before[len(text):], self._pending[start + len(OPEN):], True
        return True

    def _text(self, out: list[ToolDelta], text: str) -> None:
        if self._after_call:
            text = text.lstrip()
        if text:
            self._after_call = False
            out.append(TextDelta(text))

    def _call(self, body: str) -> CallDelta | None:
        if self.calls and not self.req.parallel:
            return None
        call = _read_call(body.strip(), self.req)
        if call is None:
            return None
        name, arguments = call
        self.calls += 1
        return CallDelta(self.calls - 1, f"call_{secrets.token_hex(12)}", name, json.dumps(arguments, ensure_ascii=False))


def parse_tool_calls(req: ToolRequest | None, text: str) -> tuple[str | None, list[dict]]:
    """A whole answer -> (content or None when there is none, calls in OpenAI's message format
    {"id", "type": "function", "function": {"name", "arguments": JSON string}})."""
    parser = ToolCallParser(req)
    deltas = parser.feed(text) + parser.finish()
    content = "".join(d.text for d in deltas if isinstance(d, TextDelta))
    calls = [d.message() for d in deltas if isinstance(d, CallDelta)]
    return content or None, calls


def _text_end(text: str) -> int:
    """Where the undecided tail of text outside a call begins: a proper prefix of the open tag at its end,
    and the whitespace before that, wait for what follows."""
    end = len(text)
    for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:k]):
            end -= k
            break
    while end and text[end - 1].isspace():
        end -= 1
    return end


_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*)</function>", re.S)
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>(.*?)</parameter>", re.S)


def _read_call(body: str, req: ToolRequest) -> tuple[str, dict] | None:
    """(tool name, arguments) of a call's stripped text in either style; None when it is malformed or names
    a tool the request did not list."""
    if body.startswith("{"):
        return _read_hermes(body, req)
    if body.startswith("<function="):
        return _read_xml(body, req)
    return None


def _read_hermes(body: str, req: ToolRequest) -> tuple[str, dict] | None:
    try:
        call = json.loads(body, parse_constant=_no_constant)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or req.tool(call["name"]) is None:
        return None
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # arguments written as a JSON string holding the object
        try:
            arguments = json.loads(arguments, parse_constant=_no_constant)
        except ValueError:
            return None
    return (call["name"], arguments) if isinstance(arguments, dict) else None


def _read_xml(body: str, req: ToolRequest) -> tuple[str, dict] | None:
    match = _FUNCTION.fullmatch(body)
    tool = req.tool(match.group(1).strip()) if match else None
    if tool is None:
        return None
    properties = tool.parameters.get("properties") or {}
    arguments, rest, pos = {}, match.group(2), 0
    while parameter := _PARAMETER.match(rest, pos):
        key, value = parameter.group(1).strip(), parameter.group(2)
        value = value[1:] if value.startswith("\n") else value  # the template's "\n" after and before the tags
        value = value[:-1] if value.endswith("\n") else value
        arguments[key] = _xml_value(value, properties.get(key))
        pos = parameter.end()
    return (tool.name, arguments) if not rest[pos:].strip() else None


def _xml_value(text: str, schema):
    """A parameter's raw text as its schema's type: text for strings, else JSON when it parses (and
    True / False, as a template's `|string` writes booleans); the text when not."""
    if _is_text(schema):
        return text
    try:
        return json.loads(text, parse_constant=_no_constant)
    except ValueError:
        pass
    if "boolean" in _types(schema) and text.strip() in ("True", "False"):
        return text.strip() == "True"
    return text


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")
