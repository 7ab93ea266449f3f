"""OpenAI tools for Qwen models (server/tools.py): request validation, the chat template's view of tools and
calls, the tool-call parser (whole and streamed), the grammars of tool_choice "required" / named, and a tiny
random model that a grammar makes call a tool."""

import copy
import json
import random
import re

import jsonschema
import llguidance
import llguidance.hf
import pytest

from deltaflash.core.request import SamplingParams
from deltaflash.server.errors import BadRequest
from deltaflash.server.tools import (
    TOOL_STYLES, CallDelta, TextDelta, ToolCallParser, ToolRequest, detect_style, finish_reason, parse_tool_calls,
    parse_tools, template_messages, tool_grammar)
from deltaflash.tokenizer import decode, encode_chat, load_tokenizer
from tests.checkpoints import make_tokenizer

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    "detailed": {"type": "boolean"},
}, "required": ["city", "days"], "additionalProperties": False}
SEARCH = {"type": "object", "properties": {
    "query": {"type": "string"},
    "tags": {"type": "array", "items": {"type": "string"}},
    "filters": {"type": "object"},
    "limit": {"type": ["integer", "null"]},
}, "required": ["query"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "search", "parameters": SEARCH}}]


def request(**fields) -> ToolRequest:
    return parse_tools({"tools": copy.deepcopy(TOOLS)} | fields)


def hermes(name, arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def xml(name, parameters) -> str:
    inner = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in parameters.items())
    return f"<tool_call>\n<function={name}>\n{inner}</function>\n</tool_call>"


# ---- parse_tools -------------------------------------------------------------------------------------
def test_parse_tools_defaults_and_choices():
    req = request()
    assert (req.choice, req.function, req.parallel) == ("auto", None, True)
    assert [t.name for t in req.tools] == ["get_weather", "search"]
    assert req.template_tools() == TOOLS  # as the client sent them
    assert request(tool_choice="required", parallel_tool_calls=False).parallel is False
    named = request(tool_choice={"type": "function", "function": {"name": "search"}})
    assert (named.choice, named.function) == ("function", "search")
    # "none": the model is not shown the tools, so it never calls one
    assert request(tool_choice="none").template_tools() is None
    assert parse_tools({}) is None and parse_tools({"tools": None, "tool_choice": None}) is None
    assert parse_tools({"tools": [], "tool_choice": "none"}) is None
    no_parameters = parse_tools({"tools": [{"type": "function", "function": {"name": "now"}}]})
    assert no_parameters.tools[0].parameters == {"type": "object", "properties": {}}


def test_parse_tools_does_not_alias_the_body():
    body = {"tools": copy.deepcopy(TOOLS)}
    req = parse_tools(body)
    body["tools"][0]["function"]["parameters"]["properties"].clear()
    assert req.tools[0].parameters == WEATHER and req.template_tools()[0] == TOOLS[0]


def _tool(**function):
    return {"type": "function", "function": {"name": "f"} | function}


@pytest.mark.parametrize("body, param", [
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": ["f"]}, "tools[0]"),
    ({"tools": [{"type": "custom", "custom": {"name": "f"}}]}, "tools[0].type"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [_tool(), {"type": "function", "function": {"description": "no name"}}]}, "tools[1].function.name"),
    ({"tools": [_tool(name="get weather")]}, "tools[0].function.name"),
    ({"tools": [_tool(name="x" * 65)]}, "tools[0].function.name"),
    ({"tools": [_tool(name="")]}, "tools[0].function.name"),
    ({"tools": [_tool(), _tool()]}, "tools[1].function.name"),
    ({"tools": [_tool(description=5)]}, "tools[0].function.description"),
    ({"tools": [_tool(parameters="{}")]}, "tools[0].function.parameters"),
    ({"tools": [_tool(parameters={"type": "string"})]}, "tools[0].function.parameters"),
    ({"tools": [_tool(strict="yes")]}, "tools[0].function.strict"),
    ({"tools": [_tool(description="\ud800")]}, "tools[0]"),
    ({"tools": [_tool()], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [_tool()], "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tools": [_tool()], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [], "tool_choice": "auto"}, "tool_choice"),
    ({"tools": [_tool()], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
])
def test_parse_tools_rejects_with_the_field(body, param):
    with pytest.raises(BadRequest) as err:
        parse_tools(body)
    assert err.value.param == param and err.value.status == 400
    assert param.split(".")[-1].split("[")[0] in err.value.message


# ---- chat template -----------------------------------------------------------------------------------
def test_template_messages_turns_arguments_into_objects():
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "a", "type": "function", "function": {"name": "search", "arguments": '{"query": "x"}'}},
                    {"id": "b", "type": "function", "function": {"name": "search", "arguments": "{not json"}},
                    {"id": "c", "type": "function", "function": {"name": "search", "arguments": "[1]"}}]},
                {"role": "tool", "tool_call_id": "a", "content": "found"}]
    before = copy.deepcopy(messages)
    out = template_messages(messages)
    assert messages == before  # input untouched
    assert [c["function"]["arguments"] for c in out[1]["tool_calls"]] == [{"query": "x"}, "{not json", "[1]"]
    assert out[0] == messages[0] and out[2] == messages[2] and out[1]["tool_calls"][0]["id"] == "a"


QWEN_LIKE = ("{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}|{% endif %}"
             "{% for m in messages %}<{{ m.role }}>{% for c in m.tool_calls or [] %}<function={{ c.function.name }}>"
             "{% for k, v in c.function.arguments|items %}<parameter={{ k }}>{{ v }}</parameter>{% endfor %}"
             "</function>{% endfor %}{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")


def test_encode_chat_renders_tools_and_calls(tmp_path):
    make_tokenizer(tmp_path, vocab_size=300)
    tok = load_tokenizer(tmp_path)
    messages = [{"role": "user", "content": "weather?"}]
    plain = encode_chat(tok, messages)
    assert encode_chat(tok, messages, tools=None) == plain
    assert decode(tok, encode_chat(tok, messages, tools=TOOLS)) == decode(tok, plain)  # the template ignores tools
    tok.chat_template = QWEN_LIKE
    assert decode(tok, encode_chat(tok, messages, tools=request().template_tools())).startswith(
        "TOOLS:get_weather;search;|<user>weather?")
    assert "TOOLS" not in decode(tok, encode_chat(tok, messages, tools=request(tool_choice="none").template_tools()))
    history = template_messages(messages + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}])
    assert "<function=get_weather><parameter=city>Oslo</parameter></function>" in decode(tok, encode_chat(tok, history))


def test_detect_style():
    assert detect_style("{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}") == "xml"
    assert detect_style('{"name": <function-name>, "arguments": <args-json-object>}') == "hermes"
    assert detect_style({"default": "x", "tool_use": "<function="}) == "xml"
    assert detect_style(None) == "hermes"


# ---- parser ------------------------------------------------------------------------------------------
WEATHER_CALL = {"city": "Paris", "days": 3}
# (text, content, [(name, arguments)]) as the one-shot parse must read them
CASES = [
    ("Hello there.\n", "Hello there.\n", []),
    ("  indented <b>bold</b> and <tool", "  indented <b>bold</b> and <tool", []),
    (hermes("get_weather", WEATHER_CALL), None, [("get_weather", WEATHER_CALL)]),
    ("Let me check.\n\n" + hermes("get_weather", WEATHER_CALL) + "\n",
     "Let me check.", [("get_weather", WEATHER_CALL)]),
    (hermes("get_weather", WEATHER_CALL) + "\n" + hermes("search", {"query": "é \"q\""}),
     None, [("get_weather", WEATHER_CALL), ("search", {"query": "é \"q\""})]),
    (xml("get_weather", {"city": "Paris", "days": 3}), None, [("get_weather", WEATHER_CALL)]),
    ("Sure:\n" + xml("get_weather", {"city": "Rome", "days": 2}) + "\n" + xml("search", {"query": "a\nb"}),
     "Sure:", [("get_weather", {"city": "Rome", "days": 2}), ("search", {"query": "a\nb"})]),
    (xml("search", {"query": "x"}) + "\n" + hermes("get_weather", WEATHER_CALL) + "\nDone.",
     "Done.", [("search", {"query": "x"}), ("get_weather", WEATHER_CALL)]),
    ("Hi\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {bad}\n</tool_call>",
     "Hi\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {bad}\n</tool_call>", []),
    ("a " + hermes("launch_rocket", {}) + " b", "a " + hermes("launch_rocket", {}) + " b", []),
    (xml("launch_rocket", {"when": "now"}), xml("launch_rocket", {"when": "now"}), []),
    (hermes("search", {"query": "q"}) + "\n<tool_call>\n{\"name\": \"search\", \"argu",
     "<tool_call>\n{\"name\": \"search\", \"argu", [("search", {"query": "q"})]),
    ("<tool_call>\n<function=search>\n<parameter=query>\nq\n</parameter>\njunk</function>\n</tool_call>",
     "<tool_call>\n<function=search>\n<parameter=query>\nq\n</parameter>\njunk</function>\n</tool_call>", []),
    ("x <tool_call>nothing</tool_call> y", "x <tool_call>nothing</tool_call> y", []),
]


def _collect(deltas):
    """(content or None, [(name, arguments dict)]) from a stream of deltas, checking OpenAI's stream shape."""
    content, calls = "", {}
    for d in deltas:
        if isinstance(d, TextDelta):
            content += d.text
        elif d.index not in calls:
            assert d.index == len(calls) and re.fullmatch(r"call_[0-9a-f]{8,}", d.id) and d.name
            calls[d.index] = [d.name, d.arguments]
        else:
            assert d.id is None and d.name is None
            calls[d.index][1] += d.arguments
    return content or None, [(name, json.loads(arguments)) for name, arguments in calls.values()]


def _one_shot(req, text):
    content, calls = parse_tool_calls(req, text)
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
    return content, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("text, content, calls", CASES)
def test_parse_reads_content_and_calls(text, content, calls):
    assert _one_shot(request(), text) == (content, calls)


def test_streaming_in_any_chunks_equals_one_shot():
    rng = random.Random(0)
    req = request()
    for text, content, calls in CASES:
        chunkings = [[1] * len(text)] + [[rng.randint(1, 12) for _ in text] for _ in range(20)]
        for sizes in chunkings:
            parser, deltas, pos = ToolCallParser(req), [], 0
            for size in sizes:
                if pos >= len(text):
                    break
                deltas += parser.feed(text[pos:pos + size])
                pos += size
            deltas += parser.finish()
            assert _collect(deltas) == (content, calls), (text, sizes)
            assert parser.calls == len(calls)


def test_partial_tag_is_held_back_then_released():
    parser = ToolCallParser(request())
    assert parser.feed("Use a ") == [TextDelta("Use a")]  # the space may touch a tag
    assert parser.feed("<tool") == []
    assert parser.feed("box> now") == [TextDelta(" <toolbox> now")]
    assert parser.feed("\n<tool_call>\n{\"name\": \"search\", ") == []
    assert parser.finish() == [TextDelta("\n<tool_call>\n{\"name\": \"search\", ")]  # cut short: content


def test_call_delta_is_openai_stream_entry():
    parser = ToolCallParser(request())
    (delta,) = parser.feed(hermes("search", {"query": "q"}))
    assert isinstance(delta, CallDelta) and delta.index == 0
    assert delta.openai() == {"index": 0, "id": delta.id, "type": "function",
                              "function": {"name": "search", "arguments": '{"query": "q"}'}}
    assert CallDelta(0, None, None, "}").openai() == {"index": 0, "function": {"arguments": "}"}}


def test_xml_values_follow_the_schema_types():
    text = xml("search", {"query": "123", "tags": '["a", "b"]', "filters": '{"year": 2024}', "limit": "null",
                          "extra": "7"})
    assert _one_shot(request(), text)[1] == [("search", {"query": "123", "tags": ["a", "b"],
                                                        "filters": {"year": 2024}, "limit": None, "extra": "7"})]
    text = xml("get_weather", {"city": " Paris ", "days": "three", "detailed": "True"})
    assert _one_shot(request(), text)[1] == [("get_weather", {"city": " Paris ", "days": "three", "detailed": True})]
    text = xml("get_weather", {"days": "2.5", "detailed": "false", "unit": "celsius"})
    assert _one_shot(request(), text)[1] == [("get_weather", {"days": 2.5, "detailed": False, "unit": "celsius"})]


def test_parallel_false_keeps_only_the_first_call():
    text = hermes("search", {"query": "a"}) + "\n" + hermes("search", {"query": "b"})
    assert _one_shot(request(parallel_tool_calls=False), text) == (
        hermes("search", {"query": "b"}), [("search", {"query": "a"})])


def test_no_tools_or_choice_none_is_all_content():
    text = "a\n" + hermes("search", {"query": "q"}) + "\n"
    for req in (None, request(tool_choice="none")):
        assert parse_tool_calls(req, text) == (text, [])
        parser = ToolCallParser(req)
        assert parser.feed(text) == [TextDelta(text)] and parser.finish() == [] and parser.calls == 0


def test_finish_reason():
    assert finish_reason("stop", 1) == "tool_calls"
    assert finish_reason("stop", 0) == "stop"
    assert finish_reason("length", 2) == "length"


# ---- grammar -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    make_tokenizer(folder, vocab_size=300)
    hf = load_tokenizer(folder)
    return hf, llguidance.hf.from_tokenizer(hf)


def accepts(tokenizers, spec, text) -> bool:
    """Whether the grammar takes `text` whole and then the end token (the tiny byte-level tokenizer spells
    any text)."""
    hf, ll = tokenizers
    ids = hf.encode(text, add_special_tokens=False)
    assert hf.decode(ids) == text
    matcher = llguidance.LLMatcher(ll, llguidance.LLMatcher.grammar_from_lark(spec.source), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return (matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()
            and matcher.consume_token(ll.eos_token) and matcher.is_stopped())


def write(style, name, arguments) -> str:
    """A call as the Qwen templates write it."""
    if style == "hermes":
        return hermes(name, arguments)
    return xml(name, {k: v if isinstance(v, str) else json.dumps(v) for k, v in arguments.items()})


GOOD_WEATHER = {"city": "Paris", "days": 3, "unit": "celsius"}


@pytest.mark.parametrize("style", TOOL_STYLES)
def test_named_tool_grammar(tokenizers, style):
    req = request(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    spec = tool_grammar(req, style)
    assert spec.kind == "lark"
    grammar = llguidance.LLMatcher.grammar_from_lark(spec.source)
    assert llguidance.LLMatcher.validate_grammar(grammar) == ""
    assert llguidance.LLMatcher.validate_grammar(grammar, tokenizers[1]) == ""
    good = write(style, "get_weather", GOOD_WEATHER)
    assert accepts(tokenizers, spec, good)
    assert _one_shot(req, good) == (None, [("get_weather", GOOD_WEATHER)])  # what the grammar takes parses back
    assert accepts(tokenizers, spec, write(style, "get_weather", {"city": "x" * 12, "days": 7, "detailed": False}))
    for bad in (write(style, "search", {"query": "q"}),  # another listed tool
                write(style, "get_wether", GOOD_WEATHER),
                write(style, "get_weather", {"city": "Paris"}),  # required days missing
                write(style, "get_weather", {"city": "Paris", "days": 8}),
                write(style, "get_weather", {"city": "x" * 13, "days": 1}),
                write(style, "get_weather", {"city": "Paris", "days": 3, "unit": "kelvin"}),
                write(style, "get_weather", {"city": "Paris", "days": 3, "wind": 1}),
                "Sure. " + good, good + "\n" + good, good[:-1]):
        assert not accepts(tokenizers, spec, bad), bad
    if style == "hermes":
        assert not accepts(tokenizers, spec, good.replace('"days": 3', '"days":3'))
    else:
        assert accepts(tokenizers, spec, good.replace("Paris", "Pa<b>\nris"))


@pytest.mark.parametrize("style", TOOL_STYLES)
@pytest.mark.parametrize("parallel", [True, False])
def test_required_grammar(tokenizers, style, parallel):
    req = request(tool_choice="required", parallel_tool_calls=parallel)
    spec = tool_grammar(req, style)
    assert llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(spec.source)) == ""
    weather = write(style, "get_weather", GOOD_WEATHER)
    search = write(style, "search", {"query": "a </b>", "tags": ["x"], "limit": 2})
    assert accepts(tokenizers, spec, weather) and accepts(tokenizers, spec, search)
    assert accepts(tokenizers, spec, weather + "\n" + search) == parallel
    assert not accepts(tokenizers, spec, "")
    assert not accepts(tokenizers, spec, write(style, "launch_rocket", {}))
    assert not accepts(tokenizers, spec, write(style, "search", {"tags": ["x"]}))
    if style == "xml":  # a text value ends at the first </parameter>
        assert not accepts(tokenizers, spec, write(style, "search", {"query": "a</parameter>b"}))
        assert accepts(tokenizers, spec, write(style, "search", {"query": "a</param>\n</b>"}))
    content, calls = _one_shot(req, weather + "\n" + search)
    assert [name for name, _ in calls] == ["get_weather", "search"][:1 + parallel]
    assert content == (None if parallel else search)  # a call past the first is content when not parallel


def test_no_grammar_for_auto_or_none():
    assert tool_grammar(request(), "hermes") is None
    assert tool_grammar(request(tool_choice="none"), "xml") is None


@pytest.mark.parametrize("style", TOOL_STYLES)
def test_grammar_names_the_tool_with_a_bad_schema(style):
    tools = copy.deepcopy(TOOLS) + [_tool(parameters={"type": "object", "properties": {"x": {"type": "decimal"}}})]
    with pytest.raises(BadRequest) as err:
        tool_grammar(parse_tools({"tools": tools, "tool_choice": "required"}), style)
    assert err.value.param == "tools[2].function.parameters"
    # a named choice compiles only its own tool
    assert tool_grammar(parse_tools({"tools": tools, "tool_choice": {"type": "function",
                                                                      "function": {"name": "search"}}}), style)


def test_xml_grammar_refuses_parameter_names_it_cannot_write():
    req = parse_tools({"tools": [_tool(parameters={"type": "object", "properties": {"a>b": {}}})],
                       "tool_choice": "required"})
    assert tool_grammar(req, "hermes") is not None
    with pytest.raises(BadRequest) as err:
        tool_grammar(req, "xml")
    assert err.value.param == "tools[0].function.parameters.properties"


@pytest.mark.parametrize("string, param", [
    ({"type": "string", "maxLength": "5"}, "tools[0].function.parameters.properties.s.maxLength"),
    ({"type": "string", "minLength": -1}, "tools[0].function.parameters.properties.s.minLength"),
    ({"type": "string", "minLength": 5, "maxLength": 2}, "tools[0].function.parameters"),
])
def test_xml_grammar_checks_string_bounds(string, param):
    req = parse_tools({"tools": [_tool(parameters={"type": "object", "properties": {"s": string}})],
                       "tool_choice": "required"})
    with pytest.raises(BadRequest) as err:
        tool_grammar(req, "xml")
    assert err.value.param == param


# ---- end to end: a random model, forced to call --------------------------------------------------------
E2E_SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 14},
    "note": {"type": "string", "maxLength": 6},
    "metric": {"type": "boolean"},
}, "required": ["city", "days", "note"], "additionalProperties": False}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from deltaflash.engine.engine import Engine
    from tests.server_process import tiny_pair

    target, draft = tiny_pair(tmp_path_factory.mktemp("tools-e2e"))
    return Engine.from_pretrained(target, draft, device="cpu", progress=False, max_slots=2, max_model_len=1024)


@pytest.mark.parametrize("style", TOOL_STYLES)
def test_grammar_makes_a_random_model_call_the_named_tool(engine, style):
    tools = [_tool(name="get_weather", parameters=E2E_SCHEMA), _tool(name="other")]
    req = parse_tools({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    spec = tool_grammar(req, style)
    prompt = encode_chat(engine.tokenizer, template_messages([{"role": "user", "content": "weather?"}]),
                         tools=req.template_tools())
    seeds = range(4)
    params = [SamplingParams(max_new_tokens=300, temperature=1.0, seed=s, grammar=spec) for s in seeds]
    completions, _ = engine.generate([prompt] * len(params), params)
    for completion in completions:
        text = decode(engine.tokenizer, completion.token_ids)
        content, calls = parse_tool_calls(req, text)
        assert completion.finish_reason == "stop", text
        assert content is None and len(calls) == 1, text
        assert calls[0]["function"]["name"] == "get_weather"
        jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), E2E_SCHEMA)
        assert finish_reason(completion.finish_reason, len(calls)) == "tool_calls"
    assert len({decode(engine.tokenizer, c.token_ids) for c in completions}) > 1  # the seeds differ
