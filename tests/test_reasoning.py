"""A chat answer's thinking apart from its content (`--reasoning-parser qwen3`): the parser over text cut anywhere,
the prompt deciding where an answer starts, and the bodies and SSE chunks clients read."""

import asyncio
import copy
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
def engine(tmp_path_factory):
    """The tiny pair's engine (a DFlash drafter: speculative rounds), with its tokenizer."""
    from deltaflash.engine.engine import Engine

    target, draft = tiny_pair(tmp_path_factory.mktemp("think-engine"))
    return Engine.from_pretrained(target, draft, device="cpu", progress=False, max_slots=2, max_model_len=256)


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
    # a grammar: this tokenizer has no `</think>` token to start it after, so it holds from the first token
    unparsed = parsing.prepare(parse_chat(structured))
    assert unparsed.reasoning is None and unparsed.params[0].grammar.after is None
    assert plain.prepare(parse_chat(body)).reasoning is None
    with pytest.raises(ValueError, match="qwen3"):
        Frontend(card, tokenizer, "deepseek")


def test_a_grammar_holds_for_the_answer_after_the_thinking(tokenizer):
    """With a `</think>` token, a grammar starts after it where the prompt leaves a block open (vLLM's rule:
    the answer is structured, the thinking free), and from the first token where the prompt closed it."""
    tok = copy.deepcopy(tokenizer)
    tok.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    end = tok.convert_tokens_to_ids("</think>")
    frontend = Frontend(ModelCard("tiny", 320, 256, 0, 0), tok, "qwen3")
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "response_format": {"type": "json_object"}}
    thinking = frontend.prepare(parse_chat(body))
    assert thinking.reasoning is True and thinking.params[0].grammar.after == end
    assert thinking.params[0].grammar.kind == "json_object"
    quiet = frontend.prepare(parse_chat(body | {"chat_template_kwargs": {"enable_thinking": False}}))
    assert quiet.reasoning is False and quiet.params[0].grammar.after is None


def test_a_grammar_after_a_token_allows_everything_up_to_it(engine):
    """GrammarAfter's masks: every token up to and including the first `after` token, the grammar's after it
    (in a chain of drafts too); then an engine whose first token is pushed to `after` (logit bias) answers
    after it in the grammar, speculative and target-only rounds alike, greedy and sampled."""
    import torch

    from deltaflash.core.request import GrammarSpec, SamplingParams
    from deltaflash.speculative.grammar import GrammarCompiler

    tok = engine.tokenizer
    end, digit, letter = (tok.encode(t, add_special_tokens=False)[0] for t in ("(", "1", "d"))
    compiler = GrammarCompiler(tok, 320)
    gate = compiler.matcher(GrammarSpec("regex", "[0-9]+", after=end))
    free = torch.full((compiler.words,), -1, dtype=torch.int32)

    def allows(mask, token):
        return bool((int(mask[token // 32]) >> (token % 32)) & 1)

    masks = gate.row_masks([letter, end, digit])  # rows: before d, before (, after (, after ( 1
    assert torch.equal(masks[0], free) and torch.equal(masks[1], free)
    assert allows(masks[2], digit) and not allows(masks[2], letter) and not allows(masks[2], end)
    assert not gate.advance(letter) and not gate.advance(end)
    assert not allows(gate.row_masks([])[0], letter) and allows(gate.row_masks([])[0], digit)

    prompt = tok.encode("def hello", add_special_tokens=False)
    params = [SamplingParams(max_new_tokens=12, grammar=GrammarSpec("regex", "[0-9]{3}", after=end),
                             logit_bias=((end, 100.0),), temperature=t, seed=1) for t in (0.0, 1.0)]
    for done in engine.generate([prompt] * 2, params)[0]:
        text = tok.decode(done.token_ids)
        assert done.token_ids[0] == end and done.finish_reason == "stop" and text[1:].isdigit() and \
            len(text) == 4, text
    plain = SamplingParams(max_new_tokens=12, grammar=GrammarSpec("regex", "[0-9]{3}"), logit_bias=((end, 100.0),))
    assert tok.decode(engine.generate([prompt], plain)[0][0].token_ids).isdigit()  # without `after`: from the first


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
