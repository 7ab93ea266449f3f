"""A chat answer's thinking apart from its content (`--reasoning-parser qwen3`): the parser over text cut anywhere,
the prompt deciding where an answer starts, and the bodies and SSE chunks clients read."""

import asyncio
import json
import random

import pytest

from deltaflash.server.frontend import Frontend, ModelCard
from deltaflash.server.errors import BadRequest
from deltaflash.server.protocol import parse_chat, parse_tokenize
from deltaflash.server.reasoning import ReasoningParser
from deltaflash.server.relay import collect, stream
from deltaflash.server.responses import Formatter
from deltaflash.server.tools import parse_tools
from deltaflash.server.worker import Output
from deltaflash.tokenizer import load_tokenizer
from tests.server_process import tiny_pair

CASES = [  # (text, the prompt left a think block open, (reasoning, content))
    ("I think x.\n</think>\n\nThe answer.", True, ("I think x.\n", "The answer.")),
    ("<think>\nhmm</think>\n\nok", False, ("\nhmm", "ok")),  # an answer that opens its own block
    ("  <think>a</think>b", False, ("a", "b")),
    ("plain answer", False, ("", "plain answer")),
    ("<thin", False, ("", "<thin")),  # held as a possible tag, then content
    ("cut short inside", True, ("cut short inside", "")),
    ("let me call\n<tool_call>\n{}</tool_call>", True, ("let me call\n", "<tool_call>\n{}</tool_call>")),
    ("a < b </thinking? no</think>x", True, ("a < b </thinking? no", "x")),
    ("", True, ("", "")),
]


@pytest.mark.parametrize("text, open_block, expected", CASES)
def test_the_parser_splits_text_cut_anywhere_alike(text, open_block, expected):
    for seed in range(40):
        rng, parser, parts = random.Random(seed), ReasoningParser(open_block), []
        i = 0
        while i < len(text):
            j = i + rng.randint(1, 5)
            parts.append(parser.feed(text[i:j]))
            i = j
        parts.append(parser.finish())
        assert ("".join(r for r, _ in parts), "".join(c for _, c in parts)) == expected, seed


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    tok = load_tokenizer(tiny_pair(tmp_path_factory.mktemp("think"), drafter=False)[0])
    # Qwen3.5's way: the assistant's turn opens a think block, or writes an empty one without thinking
    tok.chat_template = ("{% for m in messages %}<{{ m.role }}>{% if m.reasoning_content %}<think>"
                         "{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<assistant><think>\n{% if enable_thinking is defined and "
                         "not enable_thinking %}\n</think>\n\n{% endif %}{% endif %}")
    return tok


def test_the_prompt_decides_where_an_answer_starts(tokenizer):
    card = ModelCard("tiny", 320, 256, 0, 0)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    quiet = body | {"chat_template_kwargs": {"enable_thinking": False}}
    structured = body | {"response_format": {"type": "json_object"}}
    parsing, plain = Frontend(card, tokenizer, "qwen3"), Frontend(card, tokenizer)
    assert parsing.prepare(parse_chat(body)).reasoning is True
    assert parsing.prepare(parse_chat(quiet)).reasoning is False
    assert parsing.prepare(parse_chat(structured)).reasoning is None  # a grammar holds from the first token
    assert plain.prepare(parse_chat(body)).reasoning is None
    with pytest.raises(ValueError, match="qwen3"):
        Frontend(card, tokenizer, "deepseek")


def test_an_earlier_answers_thinking_goes_back_into_the_template(tokenizer):
    """An assistant message's `reasoning` (vLLM's name) or `reasoning_content` reaches the template as
    `reasoning_content`, the name Qwen's templates read; on another role it is a 400."""
    frontend = Frontend(ModelCard("tiny", 320, 256, 0, 0), tokenizer, "qwen3")
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello", "reasoning": "greet"}]
    older = [history[0], {"role": "assistant", "content": "hello", "reasoning_content": "greet"}]
    rendered = [tokenizer.decode(frontend.tokenize(parse_tokenize({"messages": m, "add_generation_prompt": False})))
                for m in (history, older)]
    assert rendered == ["<user>hi\n<assistant><think>greet</think>hello\n"] * 2
    with pytest.raises(BadRequest, match="only allowed on assistant messages"):
        parse_chat({"messages": [{"role": "user", "content": "hi", "reasoning": "x"}]})


def pieces(text: str, size: int = 3) -> list[Output]:
    """`text` as an engine job's outputs, `size` characters each (one per token), the last one finished."""
    cut = [text[i:i + size] for i in range(0, len(text), size)]
    return [Output(t, (i,), 5, i + 1, "stop" if i == len(cut) - 1 else None) for i, t in enumerate(cut)]


async def relayed(text: str, streaming: bool, tools=None, include_reasoning: bool = True):
    outputs = asyncio.Queue()
    for out in pieces(text):
        outputs.put_nowait((0, out))
    fmt = Formatter(True, "chatcmpl-1", "tiny", 0, False, include_reasoning=include_reasoning)
    if streaming:
        events = [e async for e in stream(outputs, fmt, 1, 5, False, lambda: None, tools, reasoning=True)]
        return [json.loads(e[len(b"data: "):]) for e in events[:-1]]

    async def receive():
        await asyncio.sleep(3600)
    return json.loads((await collect(outputs, fmt, ((1, 2, 3, 4, 5),), 1, receive, lambda: None, tools,
                                     reasoning=True)).body)


def test_bodies_and_chunks_carry_reasoning_apart_from_content():
    text = "Step one.\n</think>\n\nThe answer is 4."
    message = asyncio.run(relayed(text, streaming=False))["choices"][0]["message"]
    assert message["reasoning"] == message["reasoning_content"] == "Step one.\n"
    assert message["content"] == "The answer is 4."
    chunks = asyncio.run(relayed(text, streaming=True))
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("reasoning", "") for d in deltas) == "Step one.\n"
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Step one.\n"
    assert "".join(d.get("content", "") for d in deltas) == "The answer is 4."
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    # include_reasoning false (vLLM's field): the thinking is dropped, the content is the same
    message = asyncio.run(relayed(text, streaming=False, include_reasoning=False))["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "The answer is 4."}
    deltas = [c["choices"][0]["delta"] for c in asyncio.run(relayed(text, streaming=True, include_reasoning=False))]
    assert all("reasoning" not in d for d in deltas)
    assert "".join(d.get("content", "") for d in deltas) == message["content"]
    assert parse_chat({"messages": [{"role": "user", "content": "hi"}], "include_reasoning": False}).include_reasoning \
        is False


def test_a_call_inside_the_thinking_ends_it_and_is_a_tool_call():
    tools = parse_tools({"tools": [{"type": "function", "function": {"name": "add"}}]})
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    choice = asyncio.run(relayed("I should add.\n" + call, streaming=False, tools=tools))["choices"][0]
    assert choice["message"]["reasoning"] == "I should add.\n" and choice["message"]["content"] is None
    assert choice["finish_reason"] == "tool_calls"
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {"a": 1}
