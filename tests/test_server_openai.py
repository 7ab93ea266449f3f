"""OpenAI sampling features of `deltaflash serve` through the official openai client: logprobs, n > 1 and
batched prompts, penalties / logit_bias / min_p / min_tokens, structured output. Two real servers on
the same tiny target: one speculative (DFlash drafter), one target-only; greedy results must agree."""

import asyncio
import json
import re

import httpx
import jsonschema
import openai
import pytest

from deltaflash.server.frontend import sample_seed
from tests.server_process import ServerProcess, sse_payloads, tiny_pair

SLOTS, QUEUE, CONTEXT = 8, 32, 512
PROMPT = [11, 42, 7, 99, 23]
SCHEMA = {  # bounded, so that even a random model ends within max_tokens
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "kind": {"enum": ["cat", "dog", "fish"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "owner": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                                   "vip": {"type": "boolean"}},
                  "required": ["id", "vip"], "additionalProperties": False},
    },
    "required": ["name", "kind", "age", "tags", "owner"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_pair(tmp_path_factory.mktemp("openai"))


def _serve(pair, tmp_path_factory, speculative: bool, *more: str):
    flags = ("--max-concurrency", str(SLOTS), "--max-queue", str(QUEUE), "--max-model-len", str(CONTEXT), *more)
    log = tmp_path_factory.mktemp("log") / "server.log"
    proc = ServerProcess(pair[0], log, *flags, draft=pair[1] if speculative else None)
    return proc


@pytest.fixture(scope="module")
def spec(pair, tmp_path_factory):
    proc = _serve(pair, tmp_path_factory, speculative=True)
    yield proc
    assert proc.stop() == 0, proc.log.read_text()


@pytest.fixture(scope="module")
def plain(pair, tmp_path_factory):
    proc = _serve(pair, tmp_path_factory, speculative=False)
    yield proc
    assert proc.stop() == 0, proc.log.read_text()


def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)


def completion(server, **kw):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0} | kw
    extra = {k: body.pop(k) for k in list(body) if k in ("ignore_eos", "return_token_ids", "min_tokens",
                                                          "repetition_penalty", "min_p", "guided_regex",
                                                          "guided_choice", "structured_outputs", "tree_budget")}
    return client(server).completions.create(extra_body=extra, **body)


def chat(server, **kw):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "def hello"}], "max_tokens": 12,
            "temperature": 0} | kw
    extra = {k: body.pop(k) for k in list(body) if k in ("ignore_eos", "return_token_ids")}
    return client(server).chat.completions.create(extra_body=extra, **body)


def sorted_desc(values) -> bool:
    return all(a >= b for a, b in zip(values, values[1:]))


def token_texts(server, ids) -> list[str]:
    """Each token's text on its own, as /detokenize gives it (special tokens kept)."""
    with httpx.Client(base_url=server.url, timeout=60) as http:
        return [http.post("/detokenize", json={"tokens": [t]}).json()["prompt"] for t in ids]


# ---- logprobs -----------------------------------------------------------------------------------------
def test_completion_logprobs_greedy_agree_with_and_without_drafter(spec, plain):
    results = []
    for server in (spec, plain):
        r = completion(server, logprobs=3, ignore_eos=True, return_token_ids=True).choices[0]
        lp = r.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(r.token_ids) == 12
        assert lp.tokens == token_texts(server, r.token_ids)
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(12)]
        for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
            assert chosen <= 0 and 1 <= len(top) <= 3 and sorted_desc(list(top.values()))
            assert chosen == pytest.approx(max(top.values()), abs=1e-6)  # greedy took the most likely
        results.append((r.token_ids, lp))
    (ids, lp), (plain_ids, plain_lp) = results
    assert ids == plain_ids
    assert lp.token_logprobs == pytest.approx(plain_lp.token_logprobs, abs=1e-4)
    for top, plain_top in zip(lp.top_logprobs, plain_lp.top_logprobs):
        assert list(top.values()) == pytest.approx(list(plain_top.values()), abs=1e-4)

    zero = completion(spec, logprobs=0, ignore_eos=True).choices[0].logprobs  # the chosen token's alone
    assert [list(t.items()) for t in zero.top_logprobs] == [[(t, p)] for t, p in zip(zero.tokens,
                                                                                      zero.token_logprobs)]
    assert zero.token_logprobs == pytest.approx(lp.token_logprobs, abs=1e-5)  # rows of other widths: fp32 rounding
    assert completion(spec, ignore_eos=True).choices[0].logprobs is None

    chunks = list(completion(spec, logprobs=3, ignore_eos=True, stream=True))
    streamed = [ch.choices[0].logprobs for ch in chunks if ch.choices[0].logprobs]
    assert sum((s.token_logprobs for s in streamed), []) == pytest.approx(lp.token_logprobs, abs=1e-5)
    assert sum((s.text_offset for s in streamed), []) == lp.text_offset  # offsets run on across chunks
    assert sum((s.tokens for s in streamed), []) == lp.tokens


def test_echo_scores_the_prompt_with_and_without_drafter(spec, plain):
    """echo with logprobs: the text and the logprobs begin with the prompt's (its first token: null), as
    evaluation harnesses score a text; max_tokens 0 scores it alone. Both servers agree, the prompt's entries
    do not depend on what follows, and the generated part is the plain request's."""
    prompt_text = "".join(token_texts(spec, PROMPT))
    scored = []
    for server in (spec, plain):
        alone = completion(server, echo=True, logprobs=2, max_tokens=0).choices[0]
        assert alone.text == prompt_text and alone.finish_reason == "length"
        lp = alone.logprobs
        assert lp.tokens == token_texts(server, PROMPT) and lp.text_offset == [sum(len(t) for t in lp.tokens[:i])
                                                                               for i in range(len(PROMPT))]
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        for chosen, token, top in zip(lp.token_logprobs[1:], lp.tokens[1:], lp.top_logprobs[1:]):
            assert chosen <= 0 and top[token] >= chosen and 1 <= len(top) <= 3  # (same-text tokens: the likelier)
        scored.append(lp.token_logprobs[1:])
        response = completion(server, echo=True, logprobs=2, ignore_eos=True, return_token_ids=True)
        both = response.choices[0]
        alone_generated = completion(server, logprobs=2, ignore_eos=True, return_token_ids=True).choices[0]
        assert both.text == prompt_text + alone_generated.text and both.token_ids == alone_generated.token_ids
        assert both.logprobs.token_logprobs[1:len(PROMPT)] == pytest.approx(scored[-1], abs=1e-5)
        assert both.logprobs.token_logprobs[len(PROMPT):] == pytest.approx(alone_generated.logprobs.token_logprobs,
                                                                          abs=1e-4)
        assert response.usage.prompt_tokens == len(PROMPT) and response.usage.completion_tokens == 12
    assert scored[0] == pytest.approx(scored[1], abs=1e-5)

    chunks = list(completion(spec, echo=True, logprobs=1, max_tokens=3, ignore_eos=True, stream=True))
    first = chunks[0].choices[0]
    assert first.text.startswith(prompt_text) and first.logprobs.token_logprobs[0] is None
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == \
        prompt_text + completion(spec, max_tokens=3, ignore_eos=True).choices[0].text
    plain_echo = completion(plain, echo=True, ignore_eos=True).choices[0]  # no logprobs: the text alone
    assert plain_echo.text.startswith(prompt_text) and plain_echo.logprobs is None
    with pytest.raises(openai.BadRequestError, match="max_tokens must be >= 1"):
        completion(plain, max_tokens=0)  # without echo there is nothing to return


def test_prompt_logprobs_as_vllm_returns_them(spec):
    """vLLM's prompt_logprobs field: per prompt token (the first: null) its id's logprob and rank, and the row's k
    likeliest with ranks 1..k - on each completions choice, and at the top of a chat body; the values are the
    echo's; not with stream."""
    with httpx.Client(base_url=spec.url, timeout=120) as http:
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 1, "temperature": 0}
        scored = http.post("/v1/completions", json=body | {"prompt_logprobs": 2}).json()["choices"][0]
        echo = http.post("/v1/completions", json=body | {"echo": True, "logprobs": 0}).json()["choices"][0]
        entries = scored["prompt_logprobs"]
        assert len(entries) == len(PROMPT) and entries[0] is None and echo["logprobs"]["top_logprobs"][1] is not None
        for token, entry, logprob in zip(PROMPT[1:], entries[1:], echo["logprobs"]["token_logprobs"][1:]):
            chosen = entry[str(token)]
            assert chosen["logprob"] == pytest.approx(logprob, abs=1e-5)
            by_rank = sorted(entry.values(), key=lambda e: e["rank"])
            assert [e["rank"] for e in by_rank] == [1, 2] + ([chosen["rank"]] if chosen["rank"] > 2 else [])
            assert sorted_desc([e["logprob"] for e in by_rank])
            assert all(isinstance(e["decoded_token"], str) for e in entry.values())
        assert "prompt_logprobs" not in echo  # only when asked
        chat_body = http.post("/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "def hello"}], "max_tokens": 1,
            "prompt_logprobs": 0}).json()
        assert len(chat_body["prompt_logprobs"]) == chat_body["usage"]["prompt_tokens"]
        assert chat_body["prompt_logprobs"][0] is None and all(len(e) == 1 for e in chat_body["prompt_logprobs"][1:])
        refused = http.post("/v1/completions", json=body | {"prompt_logprobs": 1, "stream": True})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_logprobs"


def test_chat_logprobs_greedy_agree_with_and_without_drafter(spec, plain):
    results = []
    for server in (spec, plain):
        content = chat(server, logprobs=True, top_logprobs=2, ignore_eos=True).choices[0].logprobs.content
        assert len(content) == 12
        for entry in content:
            assert entry.logprob <= 0 and entry.bytes == list(entry.token.encode())
            assert [t.token for t in entry.top_logprobs][0] == entry.token
            assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-6)
            assert len(entry.top_logprobs) == 2 and sorted_desc([t.logprob for t in entry.top_logprobs])
        results.append(content)
        streamed = [e for ch in chat(server, logprobs=True, top_logprobs=2, ignore_eos=True, stream=True)
                    if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
        assert [e.token for e in streamed] == [e.token for e in content]  # logprobs: rows of other widths
        assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-5)
    assert [e.token for e in results[0]] == [e.token for e in results[1]]
    assert [e.logprob for e in results[0]] == pytest.approx([e.logprob for e in results[1]], abs=1e-4)
    assert chat(spec, logprobs=True, ignore_eos=True).choices[0].logprobs.content[0].top_logprobs == []
    assert chat(spec, ignore_eos=True).choices[0].logprobs is None


def test_logprobs_stop_with_a_stop_string_at_the_kept_tokens(spec):
    """Only tokens the response keeps have logprobs: a stop string cuts them with the text."""
    ref = completion(spec, max_tokens=20, ignore_eos=True, return_token_ids=True).choices[0]
    stop = next(ref.text[i:i + 2] for i in range(4, len(ref.text) - 2) if "\ufffd" not in ref.text[i:i + 2])
    for stream in (False, True):
        r = completion(spec, max_tokens=20, logprobs=1, stop=stop, stream=stream, return_token_ids=True)
        choices = [ch.choices[0] for ch in r] if stream else r.choices
        token_ids = sum((c.token_ids for c in choices), [])
        tokens = sum((c.logprobs.tokens for c in choices if c.logprobs), [])
        assert choices[-1].finish_reason == "stop" and len(tokens) == len(token_ids) < 20
        assert "".join(c.text for c in choices) == ref.text[:ref.text.index(stop)]


# ---- n and batched prompts -------------------------------------------------------------------------------
def test_n_samples_are_seeded_distinct_and_reproducible(spec):
    kw = dict(n=3, seed=7, temperature=1.0, max_tokens=8, ignore_eos=True, return_token_ids=True)
    first, again = completion(spec, **kw), completion(spec, **kw)
    assert [c.index for c in first.choices] == [0, 1, 2]
    ids = [c.token_ids for c in first.choices]
    assert ids == [c.token_ids for c in again.choices] and len({tuple(i) for i in ids}) == 3
    assert first.usage.prompt_tokens == len(PROMPT) and first.usage.completion_tokens == 24
    alone = completion(spec, **(kw | {"n": 1})).choices[0].token_ids  # sample 0 keeps the request's seed
    assert alone == ids[0]
    assert sample_seed(7, 0) == 7 and sample_seed(7, 1) != sample_seed(7, 2) and sample_seed(None, 1) is None

    r = chat(spec, n=2, seed=3, temperature=1.0, max_tokens=6, ignore_eos=True)
    assert [c.index for c in r.choices] == [0, 1] and r.usage.completion_tokens == 12
    assert r.choices[0].message.content != r.choices[1].message.content


def test_batched_prompts_order_choices_prompt_major(spec):
    prompts, kw = [[1, 2, 3], [4, 5]], dict(n=2, seed=5, temperature=1.0, max_tokens=6, ignore_eos=True,
                                            return_token_ids=True)
    r = completion(spec, prompt=prompts, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 24
    for p, prompt in enumerate(prompts):
        alone = completion(spec, prompt=prompt, **kw)
        assert [c.token_ids for c in r.choices[2 * p:2 * p + 2]] == [c.token_ids for c in alone.choices]
        assert [c.prompt_token_ids for c in r.choices[2 * p:2 * p + 2]] == [prompt, prompt]
    texts = completion(spec, prompt=["def", "class"], n=1, max_tokens=4)
    assert [c.index for c in texts.choices] == [0, 1]


def test_streaming_n_interleaves_and_collects_to_the_same_texts(spec):
    kw = dict(n=2, seed=11, temperature=1.0, max_tokens=10, ignore_eos=True)
    whole = [c.text for c in completion(spec, prompt=["ab", "cd"], **kw).choices]
    with httpx.Client(base_url=spec.url, timeout=300) as http:
        body = {"prompt": ["ab", "cd"], "stream": True, "stream_options": {"include_usage": True}} | kw
        events = sse_payloads(http.post("/v1/completions", json=body).text.splitlines())
        chat_body = {"messages": [{"role": "user", "content": "hi"}], "n": 2, "seed": 1, "max_tokens": 5,
                     "stream": True, "ignore_eos": True}
        chat_events = sse_payloads(http.post("/v1/chat/completions", json=chat_body).text.splitlines())
    assert events.count("[DONE]") == 1 and events[-1] == "[DONE]"
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 40
    choices = [e["choices"][0] for e in events[:-2]]
    assert ["".join(c["text"] for c in choices if c["index"] == i) for i in range(4)] == whole
    assert sorted(c["index"] for c in choices if c["finish_reason"]) == [0, 1, 2, 3]
    chat_choices = [e["choices"][0] for e in chat_events[:-1]]
    assert [c["index"] for c in chat_choices if c["delta"].get("role")] == [0, 1]
    assert sorted(c["index"] for c in chat_choices if c["finish_reason"] == "length") == [0, 1]


def test_disconnect_cancels_every_choice(spec):
    cancelled = spec.metric("deltaflash_requests_total", outcome="cancelled")

    async def main():
        async with httpx.AsyncClient(base_url=spec.url, timeout=120) as http:
            body = {"prompt": PROMPT, "n": 3, "max_tokens": 400, "stream": True, "ignore_eos": True}
            async with http.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        break

    asyncio.run(main())
    spec.wait_idle(timeout_s=10)
    assert spec.metric("deltaflash_requests_total", outcome="cancelled") == cancelled + 3


# ---- penalties, logit_bias, min_p, min_tokens ---------------------------------------------------------------
def test_penalties_and_bias_greedy_agree_with_and_without_drafter(spec, plain):
    kw = dict(max_tokens=30, presence_penalty=0.5, frequency_penalty=0.7, repetition_penalty=1.5,
              logit_bias={"7": 4.0, "9": -50}, min_tokens=5, return_token_ids=True)
    ruled = [completion(server, **kw).choices[0].token_ids for server in (spec, plain)]
    assert ruled[0] == ruled[1]
    assert ruled[0] != completion(spec, max_tokens=30, return_token_ids=True).choices[0].token_ids
    for server in (spec, plain):
        forced = completion(server, logit_bias={"42": 100}, ignore_eos=True, return_token_ids=True).choices[0]
        assert forced.token_ids == [42] * 12
    greedy = completion(spec, ignore_eos=True, return_token_ids=True).choices[0].token_ids
    banned = completion(spec, logit_bias={str(greedy[0]): -100}, ignore_eos=True, return_token_ids=True)
    assert banned.choices[0].token_ids[0] != greedy[0]
    top_only = completion(spec, temperature=1.0, seed=3, min_p=1.0, ignore_eos=True, return_token_ids=True)
    assert top_only.choices[0].token_ids == greedy  # min_p 1 keeps only the most likely token


def test_min_tokens_holds_back_stop_tokens(spec, plain):
    greedy = completion(plain, max_tokens=20, ignore_eos=True, return_token_ids=True).choices[0].token_ids
    stop = greedy[2]
    kw = dict(max_tokens=20, stop=[stop], ignore_eos=True, return_token_ids=True)  # stop ids still stop
    early = completion(spec, **kw).choices[0]
    assert early.token_ids == greedy[:greedy.index(stop) + 1] and early.finish_reason == "stop"
    held = [completion(server, min_tokens=8, **kw).choices[0].token_ids for server in (spec, plain)]
    assert held[0] == held[1] and len(held[0]) >= 8 and stop not in held[0][:8]


BAD = [  # (endpoint, body, param, words the message must contain)
    ("completions", {"presence_penalty": 3}, "presence_penalty", "[-2.0, 2.0]"),
    ("completions", {"frequency_penalty": "x"}, "frequency_penalty", "number"),
    ("completions", {"repetition_penalty": 0}, "repetition_penalty", "(0.0, 10.0]"),
    ("completions", {"min_p": 1.5}, "min_p", "[0.0, 1.0]"),
    ("completions", {"min_tokens": -1}, "min_tokens", ">= 0"),
    ("completions", {"min_tokens": 20, "max_tokens": 10}, "min_tokens", "max_tokens"),
    ("completions", {"logit_bias": {"abc": 1}}, "logit_bias", "token ids"),
    ("completions", {"logit_bias": {"5": 200}}, "logit_bias", "[-100, 100]"),
    ("completions", {"logit_bias": {"400": 1}}, "logit_bias", "vocabulary"),
    ("completions", {"logit_bias": [1]}, "logit_bias", "object"),
    ("completions", {"logprobs": 21}, "logprobs", "[0, 20]"),
    ("completions", {"logprobs": True}, "logprobs", "integer"),
    ("chat/completions", {"top_logprobs": 2}, "top_logprobs", "logprobs: true"),
    ("chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "[0, 20]"),
    ("chat/completions", {"logprobs": 3}, "logprobs", "true or false"),
    ("completions", {"n": 0}, "n", "[1, 64]"),
    ("completions", {"n": 65}, "n", "[1, 64]"),
    ("completions", {"prompt": [[1], [2], [3]], "n": 30}, "n", "90 choices"),
    ("completions", {"n": 50}, "n", "--max-queue"),
    ("completions", {"n": 2, "best_of": 3}, "best_of", "best_of"),
    ("completions", {"prompt": ["a", 5]}, "prompt[1]", "prompt[1]"),
    ("completions", {"prompt": [[1], [999]]}, "prompt[1]", "999"),
    ("chat/completions", {"response_format": {"type": "xml"}}, "response_format", "json_schema"),
    ("chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", "schema"),
    ("chat/completions", {"response_format": {"type": "json_schema",
                                              "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format", "foo"),
    ("completions", {"guided_regex": "("}, "guided_regex", "regex"),
    ("completions", {"guided_regex": "\ud800"}, "guided_regex", "Unicode"),
    ("completions", {"guided_grammar": "start: foo"}, "guided_grammar", "foo"),
    ("completions", {"guided_choice": []}, "guided_choice", "list"),
    ("completions", {"structured_outputs": {"regex": "a+"}, "guided_regex": "b+"}, "structured_outputs.regex",
     "one structured output"),
    ("chat/completions", {"response_format": {"type": "json_object"}, "guided_json": {}}, "guided_json",
     "one structured output"),
]


def test_invalid_sampling_fields_get_400_naming_the_field(spec):
    with httpx.Client(base_url=spec.url, timeout=60) as http:
        for endpoint, body, param, words in BAD:
            base = {"prompt": PROMPT} if endpoint == "completions" else {"messages": [{"role": "user",
                                                                                       "content": "x"}]}
            r = http.post(f"/v1/{endpoint}", content=json.dumps(base | body))  # ASCII: lone surrogates too
            assert r.status_code == 400, (body, r.text)
            err = r.json()["error"]
            assert err["param"] == param and words in err["message"], (body, err)
    assert spec.health()["status"] == "ok"


# ---- structured output ----------------------------------------------------------------------------------
def test_json_schema_outputs_validate_and_greedy_agrees(spec, plain):
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}}
    r = chat(spec, n=20, seed=0, temperature=1.0, max_tokens=300, response_format=fmt)
    assert [c.index for c in r.choices] == list(range(20))
    for c in r.choices:
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
    assert len({c.message.content for c in r.choices}) > 1
    greedy = [chat(server, max_tokens=300, response_format=fmt, return_token_ids=True).choices[0]
              for server in (spec, plain)]
    assert greedy[0].token_ids == greedy[1].token_ids
    jsonschema.validate(json.loads(greedy[0].message.content), SCHEMA)

    # any JSON object: a random model rarely closes a string by chance, so closing characters are favoured
    with httpx.Client(base_url=spec.url, timeout=60) as http:
        close = {str(http.post("/tokenize", json={"prompt": c}).json()["tokens"][0]): bias
                 for c, bias in (('"', 4.0), ("}", 2.0), ("]", 2.0))}
    for server in (spec, plain):
        obj = chat(server, n=4, seed=1, temperature=1.0, max_tokens=300, logit_bias=close,
                   response_format={"type": "json_object"})
        objects = [json.loads(c.message.content) for c in obj.choices]
        assert all(isinstance(o, dict) for o in objects) and any(objects)


def test_regex_choice_and_grammar_outputs_match(spec):
    pattern = r"[a-z]{2,6}@[a-z]{2,4}\.(com|org)"
    r = completion(spec, n=4, seed=2, temperature=1.0, max_tokens=40, guided_regex=pattern)
    assert all(re.fullmatch(pattern, c.text) and c.finish_reason == "stop" for c in r.choices), r.choices
    choices = ["yes (a)", "no.", "maybe?"]
    r = completion(spec, n=4, seed=3, temperature=1.0, max_tokens=20, guided_choice=choices)
    assert all(c.text in choices for c in r.choices)
    grammar = 'start: "(" num ("," num)* ")"\nnum: /[0-9]{1,3}/'
    r = completion(spec, seed=4, temperature=1.0, max_tokens=120, structured_outputs={"grammar": grammar})
    assert re.fullmatch(r"\([0-9]{1,3}(,[0-9]{1,3})*\)", r.choices[0].text), r.choices[0].text


def test_tree_speculation_server_and_per_request_budgets(pair, plain, tmp_path_factory):
    """`serve --tree-budget 8`: greedy output equals target-only's, whatever budget a request asks for
    (the extension field, capped at the server's); a budget outside [1, 64] is a 400 naming it."""
    trees = _serve(pair, tmp_path_factory, True, "--tree-budget", "8", "--tree-top-k", "3")
    try:
        want = completion(plain, max_tokens=16, ignore_eos=True, return_token_ids=True).choices[0].token_ids
        for budget in (None, 1, 4, 64):
            extra = {} if budget is None else {"tree_budget": budget}
            got = completion(trees, max_tokens=16, ignore_eos=True, return_token_ids=True, **extra)
            assert got.choices[0].token_ids == want, budget
        with httpx.Client(base_url=trees.url, timeout=60) as http:
            r = http.post("/v1/completions", json={"prompt": PROMPT, "tree_budget": 0})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tree_budget"
    finally:
        assert trees.stop() == 0, trees.log.read_text()
