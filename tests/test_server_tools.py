"""OpenAI function tools through `deltaflash serve` and the official openai client: the tools in the chat template,
calls forced by tool_choice (named, "required") and kept well formed by the grammar, Qwen's calls parsed into
`tool_calls` streaming and not, and a call's result sent back into the prompt. The test chat template writes
calls in the xml style (Qwen3.5's), so forced calls use it; the parser reads hermes calls too."""

import json

import httpx
import jsonschema
import openai
import pytest

from deltaflash.server.tools import template_messages
from deltaflash.tokenizer import encode_chat, load_tokenizer
from tests.server_process import ServerProcess, tiny_pair

CONTEXT = 2048
WEATHER = {  # bounded, so that even a random model ends its call within max_tokens
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "note": {"type": "string", "maxLength": 6},
        "metric": {"type": "boolean"},
    },
    "required": ["city", "days", "note"],
    "additionalProperties": False,
}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
USER = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_pair(tmp_path_factory.mktemp("tools"))


@pytest.fixture(scope="module")
def server(pair, tmp_path_factory):
    proc = ServerProcess(pair[0], tmp_path_factory.mktemp("log") / "server.log", "--max-concurrency", "4",
                         "--max-queue", "16", "--max-model-len", str(CONTEXT), "--reasoning-parser", "qwen3",
                         draft=pair[1])  # (the template opens no think block: answers are content unless they do)
    yield proc
    assert proc.stop() == 0, proc.log.read_text()


def chat(server, **kw):
    body = {"model": "tiny", "messages": USER, "tools": TOOLS, "max_tokens": 1000, "temperature": 0} | kw
    extra = {k: body.pop(k) for k in list(body) if k in ("ignore_eos", "guided_choice")}
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)
    return client.chat.completions.create(extra_body=extra, **body)


def streamed(chunks) -> dict[int, dict]:
    """Each choice of a chat stream put together: content, tool_calls (OpenAI's message format, by their
    index), finish_reason, logprobs entries."""
    out: dict[int, dict] = {}
    for chunk in chunks:
        for c in chunk.choices:
            choice = out.setdefault(c.index, {"content": "", "calls": {}, "finish_reason": None, "logprobs": []})
            choice["content"] += c.delta.content or ""
            for call in c.delta.tool_calls or []:
                assert call.index not in choice["calls"]  # each call comes whole, in one delta
                choice["calls"][call.index] = {"id": call.id, "type": call.type, "function": call.function.model_dump()}
            choice["finish_reason"] = choice["finish_reason"] or c.finish_reason
            choice["logprobs"] += c.logprobs.content if c.logprobs else []
    return out


def check_calls(calls, names) -> list[tuple[str, dict]]:
    """The calls' (name, arguments) after checking each is well formed and its arguments follow its tool."""
    out = []
    for call in calls:
        assert call["id"].startswith("call_") and call["type"] == "function"
        name, arguments = call["function"]["name"], json.loads(call["function"]["arguments"])
        assert name in names
        jsonschema.validate(arguments, SCHEMAS[name])
        out.append((name, arguments))
    return out


def tokenize(server, messages, tools=None) -> list[int]:
    body = {"messages": messages} | ({"tools": tools} if tools is not None else {})
    return httpx.post(server.url + "/tokenize", json=body, timeout=60).json()["tokens"]


def detokenize(server, tokens) -> str:
    return httpx.post(server.url + "/detokenize", json={"tokens": tokens}, timeout=60).json()["prompt"]


@pytest.mark.parametrize("choice, names", [(NAMED, ["get_weather"]), ("required", ["get_weather", "get_time"])])
def test_forced_call_is_well_formed_streaming_and_not(server, choice, names):
    kw = dict(tool_choice=choice, parallel_tool_calls=False, n=3, seed=0, temperature=1.0)
    whole = chat(server, **kw)
    calls = []
    for c in whole.choices:
        assert c.finish_reason == "tool_calls" and c.message.content is None, c.message
        assert len(c.message.tool_calls) == 1
        calls += check_calls([t.model_dump() for t in c.message.tool_calls], names)
    assert len({json.dumps(c) for c in calls}) > 1  # the samples differ
    parts = streamed(chat(server, stream=True, **kw))
    assert sorted(parts) == [0, 1, 2]
    for i, part in parts.items():
        assert part["finish_reason"] == "tool_calls" and part["content"] == "" and list(part["calls"]) == [0]
        assert check_calls(part["calls"].values(), names) == calls[i:i + 1]  # seeded: the same calls

    several = chat(server, tool_choice="required", n=2, seed=1, temperature=1.0)  # parallel: one or more calls
    for c in several.choices:
        assert c.finish_reason == "tool_calls" and c.message.content is None and c.message.tool_calls
        check_calls([t.model_dump() for t in c.message.tool_calls], names=["get_weather", "get_time"])


def test_calls_the_model_writes_are_parsed_with_auto(server):
    """tool_choice "auto" puts no grammar on the answer; guided_choice here makes the model write text, a
    hermes call and an xml call, which the parser reads into content and two tool_calls."""
    arguments = {"city": "Oslo", "days": 2, "note": "hi"}
    hermes = "<tool_call>\n" + json.dumps({"name": "get_weather", "arguments": arguments}) + "\n</tool_call>"
    xml = "<tool_call>\n<function=get_time>\n<parameter=zone>\nCET\n</parameter>\n</function>\n</tool_call>"
    text = "Let me check.\n" + hermes + "\n" + xml
    expected = [("get_weather", arguments), ("get_time", {"zone": "CET"})]
    kw = dict(guided_choice=[text], logprobs=True, top_logprobs=1)
    whole = chat(server, **kw).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content == "Let me check."
    assert check_calls([t.model_dump() for t in whole.message.tool_calls], SCHEMAS) == expected
    assert len({t.id for t in whole.message.tool_calls}) == 2
    tokens = [e.token for e in whole.logprobs.content]
    assert "".join(tokens) == text  # logprobs cover every token, those of the calls too

    part = streamed(chat(server, stream=True, **kw))[0]
    assert part["finish_reason"] == "tool_calls" and part["content"] == "Let me check."
    assert list(part["calls"]) == [0, 1] and check_calls(part["calls"].values(), SCHEMAS) == expected
    assert [e.token for e in part["logprobs"]] == tokens

    serial = chat(server, guided_choice=[text], parallel_tool_calls=False).choices[0]  # later calls are content
    assert check_calls([t.model_dump() for t in serial.message.tool_calls], SCHEMAS) == expected[:1]
    assert serial.message.content == "Let me check." + xml


def test_tool_choice_none_and_auto_answer_with_content(server):
    """A random model writes no call by itself; "none" also keeps the tools out of the prompt. The reasoning
    parser finds no thinking in answers that open no think block."""
    with_tools, without = len(tokenize(server, USER, TOOLS)), len(tokenize(server, USER))
    assert with_tools > without
    for choice, prompt_tokens in (("none", without), ("auto", with_tools)):
        r = chat(server, tool_choice=choice, max_tokens=8, ignore_eos=True)
        c = r.choices[0]
        assert c.finish_reason == "length" and c.message.tool_calls is None and isinstance(c.message.content, str)
        assert c.message.model_extra == {"reasoning": None, "reasoning_content": None}
        assert r.usage.prompt_tokens == prompt_tokens
        part = streamed(chat(server, tool_choice=choice, max_tokens=8, ignore_eos=True, stream=True))[0]
        assert part["finish_reason"] == "length" and part["calls"] == {} and part["content"] == c.message.content


def test_tool_result_round_trips_into_the_prompt(server, pair):
    call = chat(server, tool_choice=NAMED, seed=2, temperature=1.0).choices[0].message.tool_calls[0]
    arguments = json.loads(call.function.arguments)
    result = '{"forecast": "sunny", "high": 21}'
    messages = USER + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                       {"role": "tool", "tool_call_id": call.id, "content": result}]
    tokens = tokenize(server, messages, TOOLS)
    # the server renders as encode_chat does, with the call's arguments as an object for the template
    assert tokens == encode_chat(load_tokenizer(pair[0]), template_messages(messages), tools=TOOLS)
    prompt = detokenize(server, tokens)
    assert prompt.startswith("<tools>\n" + "".join(json.dumps(t) + "\n" for t in TOOLS) + "</tools>\n")
    assert f"<tool_call>\n<function=get_weather>\n<parameter=city>\n{arguments['city']}\n</parameter>\n" in prompt
    assert f"<tool id={call.id}><tool_response>{result}</tool_response>\n<assistant>" in prompt

    answer = chat(server, messages=messages, max_tokens=8, ignore_eos=True)
    assert answer.usage.prompt_tokens == len(tokens) and answer.choices[0].finish_reason == "length"
    chunks = list(chat(server, messages=messages, max_tokens=8, ignore_eos=True, stream=True,
                       stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens == len(tokens)
    assert streamed(chunks)[0]["content"] == answer.choices[0].message.content
    assert chat(server, messages=messages, tool_choice="none", max_tokens=1).usage.prompt_tokens == \
        len(tokenize(server, messages))


BAD = [  # (body fields, param, words the message must contain)
    ({"tool_choice": {"type": "function", "function": {"name": "launch"}}}, "tool_choice.function.name", "launch"),
    ({"tool_choice": "maybe"}, "tool_choice", "required"),
    ({"tools": None, "tool_choice": "auto"}, "tool_choice", "only allowed when tools are given"),
    ({"tools": "get_weather"}, "tools", "list"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type", "function"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls", "boolean"),
    ({"tool_choice": "required", "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": WEATHER}}}, "response_format", 'tool_choice "required"'),
    ({"tool_choice": NAMED, "guided_json": WEATHER}, "guided_json", "tool_choice function 'get_weather'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a>b": {}}}}}], "tool_choice": "required"},
     "tools[0].function.parameters.properties", "xml"),  # the checkpoint's style cannot write this parameter
]


def test_bad_tool_requests_get_400_naming_the_field(server):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for fields, param, words in BAD:
            body = {"messages": USER, "tools": TOOLS, "max_tokens": 4} | fields
            r = http.post("/v1/chat/completions", json={k: v for k, v in body.items() if v is not None})
            assert r.status_code == 400, (fields, r.text)
            err = r.json()["error"]
            assert err["param"] == param and words in err["message"], (fields, err)
    assert server.health()["status"] == "ok"
