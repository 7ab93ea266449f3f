"""`deltaflash serve` as clients use it: a real server process (tiny target + DFlash drafter, 3 slots)
on 127.0.0.1, driven by the official openai client and by raw HTTP."""

import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import httpx
import openai
import pytest
import torch
import uvicorn

from deltaflash.engine.engine import Engine
from deltaflash.core.request import SamplingParams
from deltaflash.server import app as server_app
from deltaflash.server.app import ServerSettings, build_app
from deltaflash.server.frontend import Frontend, ModelCard
from deltaflash.server.metrics import Metrics
from deltaflash.server.worker import EngineWorker, WorkerConfig
from deltaflash.tokenizer import load_tokenizer
from tests.server_process import ServerProcess, child_env, sse_payloads, tiny_pair

KEY = "sk-test-key"
SLOTS, QUEUE, CONTEXT = 3, 4, 512
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_pair(tmp_path_factory.mktemp("serve"))


@pytest.fixture(scope="module")
def server(pair, tmp_path_factory):
    target, draft = pair
    proc = ServerProcess(target, tmp_path_factory.mktemp("log") / "server.log", "--max-concurrency", str(SLOTS),
                         "--max-queue", str(QUEUE), "--max-model-len", str(CONTEXT), "--api-key", KEY,
                         "--speculation", "fixed", draft=draft)  # every round speculates: the metrics test counts them
    yield proc
    assert proc.stop() == 0, proc.log.read_text()


@pytest.fixture(scope="module")
def solo(pair, one_thread):
    """Each prompt alone on a one-slot engine with the same target and drafter."""
    engine = Engine.from_pretrained(pair[0], pair[1], device="cpu", progress=False, max_slots=1, max_model_len=CONTEXT)

    def run(prompt_ids, max_tokens, **sampling):
        params = SamplingParams(max_new_tokens=max_tokens, ignore_eos=True, **sampling)
        (done,), _ = engine.generate([list(prompt_ids)], params)
        return done.token_ids

    run.tokenizer = engine.tokenizer
    return run


def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 320, (int(length),), generator=g).tolist()
            for length in torch.randint(3, 40, (n,), generator=g)]


def test_openai_client_matches_deltaflash_generate(server, pair):
    target, draft = pair
    base = [sys.executable, "-m", "deltaflash", "generate", "--model", str(target), "--draft", str(draft),
            "--prompt", "def hello", "--max-new-tokens", "24", "--device", "cpu", "--json", "--ignore-eos"]
    procs = [subprocess.Popen(base + extra, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env())
             for extra in ([], ["--chat"])]
    raw, chat = [json.loads(p.communicate(timeout=300)[0]) for p in procs]
    c, common = client(server), dict(model="tiny", max_tokens=24, temperature=0)
    extra = {"ignore_eos": True, "return_token_ids": True}

    r = c.completions.create(prompt="def hello", extra_body=extra, **common)
    assert r.choices[0].token_ids == raw["token_ids"] and r.choices[0].text == raw["text"]
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (raw["stats"]["prompt_tokens"], 24)

    chunks = list(c.completions.create(prompt="def hello", stream=True, stream_options={"include_usage": True},
                                       extra_body=extra, **common))
    assert sum((ch.choices[0].token_ids for ch in chunks if ch.choices), []) == raw["token_ids"]
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == raw["text"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"

    messages = [{"role": "user", "content": "def hello"}]
    r = c.chat.completions.create(messages=messages, extra_body=extra, **common)
    assert r.choices[0].token_ids == chat["token_ids"] and r.choices[0].message.content == chat["text"]
    assert r.usage.prompt_tokens == chat["stats"]["prompt_tokens"] != raw["stats"]["prompt_tokens"]

    chunks = list(c.chat.completions.create(messages=messages, stream=True, stream_options={"include_usage": True},
                                            extra_body=extra, **common))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert sum((ch.choices[0].token_ids for ch in chunks[1:] if ch.choices), []) == chat["token_ids"]
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == chat["text"]
    assert chunks[-1].usage.total_tokens == chat["stats"]["prompt_tokens"] + 24


def test_seeded_sampling_and_stops_match_solo(server, solo):
    c, prompt = client(server), prompts(1, seed=5)[0]
    sampled = dict(temperature=0.9, top_p=0.95, seed=1234)
    r = c.completions.create(model="tiny", prompt=prompt, max_tokens=20, extra_body={"top_k": 50, "ignore_eos": True,
                             "return_token_ids": True}, **sampled)
    assert r.choices[0].token_ids == solo(prompt, 20, top_k=50, **sampled)

    ref = solo(prompt, 20, temperature=0.0)
    r = c.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0, stop=[ref[6]],
                             extra_body={"return_token_ids": True})  # a stop token id (int in `stop`)
    first = ref.index(ref[6])
    assert r.choices[0].token_ids == ref[:first + 1] and r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == solo.tokenizer.decode(ref[:first])  # the stop token itself is not text

    text = solo.tokenizer.decode(ref)
    stop = next(text[i:i + 2] for i in range(3, len(text) - 2) if "\ufffd" not in text[i:i + 2])
    for stream in (False, True):
        r = c.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0, stop=stop, stream=stream)
        got = "".join(ch.choices[0].text for ch in r) if stream else r.choices[0].text
        assert got == text[:text.index(stop)]


async def _stream_tokens(http, prompt, max_tokens):
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "return_token_ids": True}
    async with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        events = sse_payloads([line async for line in r.aiter_lines()])
    assert events[-1] == "[DONE]"
    return sum((e["choices"][0]["token_ids"] for e in events[:-1]), [])


async def _in_client(server, work):
    async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=120) as http:
        return await work(http)


def test_2n_concurrent_requests_on_n_slots_equal_solo(server, solo):
    batch = prompts(2 * SLOTS, seed=1)
    lengths = [12 + 5 * i for i in range(len(batch))]

    async def main():
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=120) as http:
            return await asyncio.gather(*(_stream_tokens(http, p, n) for p, n in zip(batch, lengths)))

    outputs = asyncio.run(main())
    for prompt, n, out in zip(batch, lengths, outputs):
        assert out == solo(prompt, n)
    server.wait_idle()


async def _next_event(lines):
    async for line in lines:
        if line.startswith("data: "):
            return line


async def _health_until(http, predicate, timeout_s=10):
    for _ in range(int(timeout_s / 0.02)):
        health = (await http.get("/health")).json()
        if predicate(health):
            return health
        await asyncio.sleep(0.02)
    raise AssertionError(f"/health never satisfied the condition: {health}")


def test_disconnected_clients_free_their_slots(server, solo):
    cancelled_before = server.metric("deltaflash_requests_total", outcome="cancelled")
    body = {"model": "tiny", "max_tokens": 400, "temperature": 0, "stream": True, "ignore_eos": True}

    async def main():
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=120) as http:
            held = []
            for i, prompt in enumerate(prompts(SLOTS, seed=2)):  # every slot streaming
                r = await http.send(http.build_request("POST", "/v1/completions", json=body | {"prompt": prompt}),
                                    stream=True)
                lines = r.aiter_lines()
                await _next_event(lines)
                held.append((r, lines))
            waiting = await http.send(http.build_request("POST", "/v1/completions", json=body | {"prompt": [7, 8]}),
                                      stream=True)
            await _health_until(http, lambda h: h["queued"] == 1)
            await waiting.aclose()  # leaves while waiting for a slot
            await _health_until(http, lambda h: h["queued"] == 0 and h["active_slots"] == SLOTS)
            assert server.metric("deltaflash_slot_usage_ratio") == 1.0
            for i, (r, lines) in enumerate(held):  # leave mid-stream, after different amounts
                for _ in range(2 * i):
                    await _next_event(lines)
                await r.aclose()
            with pytest.raises(httpx.ReadTimeout):  # a non-streaming client that gives up
                await http.post("/v1/completions", json=body | {"prompt": [9], "stream": False}, timeout=0.5)

    asyncio.run(main())
    assert server.wait_idle(timeout_s=3) == {"status": "ok", "active_slots": 0, "queued": 0, "max_slots": SLOTS}
    assert server.metric("deltaflash_active_slots") == 0
    assert server.metric("deltaflash_requests_total", outcome="cancelled") == cancelled_before + SLOTS + 2
    prompt = prompts(1, seed=3)[0]
    r = client(server).completions.create(model="tiny", prompt=prompt, max_tokens=30, temperature=0,
                                          extra_body={"ignore_eos": True, "return_token_ids": True})
    assert r.choices[0].token_ids == solo(prompt, 30)


def test_queue_bound_gives_429(server):
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 450, "stream": True, "ignore_eos": True}

    async def main():
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=120) as http:
            held = []
            for _ in range(SLOTS + QUEUE):
                held.append(await http.send(http.build_request("POST", "/v1/completions", json=body), stream=True))
            assert [r.status_code for r in held] == [200] * (SLOTS + QUEUE)
            over = await http.post("/v1/completions", json=body | {"stream": False})
            for r in held:
                await r.aclose()
            return over

    over = asyncio.run(main())
    assert over.status_code == 429
    assert over.json()["error"]["code"] == "queue_full" and "--max-queue" in over.json()["error"]["message"]
    assert over.headers["Retry-After"] == "1"
    server.wait_idle()


BAD = [  # (endpoint, body or raw bytes, status, param, words the message must contain)
    ("completions", b'{"prompt": "x", ', 400, None, "not valid JSON"),
    ("completions", b"[1, 2]", 400, None, "JSON object"),
    ("completions", b"[" * 100_000, 400, None, "not valid JSON"),
    ("completions", {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens", "integer"),
    ("completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature", "number"),
    ("completions", {"prompt": "x", "stream": "yes"}, 400, "stream", "true or false"),
    ("completions", {"prompt": 5}, 400, "prompt", "prompt"),
    ("completions", {"prompt": "x", "top_k": 1.5}, 400, "top_k", "integer"),
    ("completions", {"prompt": "x", "seed": "s"}, 400, "seed", "integer"),
    ("completions", {"prompt": "x", "seed": -1}, 400, "seed", "[0, 9223372036854775807]"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "seed": 2 ** 63}, 400, "seed",
     "[0, 9223372036854775807]"),
    ("completions", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens", ">= 1"),
    ("completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", ">= 1"),
    ("completions", {"prompt": "x", "max_tokens": 10 ** 12}, 400, "max_tokens", "context"),
    ("completions", {"prompt": [1] * (CONTEXT + 5)}, 400, "prompt", "context"),
    ("completions", {"prompt": [1, 400]}, 400, "prompt", "400"),
    ("completions", {"prompt": "x", "temperature": -0.5}, 400, "temperature", ">= 0"),
    ("completions", {"prompt": "x", "top_p": 0}, 400, "top_p", "(0.0, 1.0]"),
    ("completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p", "(0.0, 1.0]"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "echo": True}, 400, "echo",
     "echo = true is not supported"),
    ("completions", {"prompt": "x", "echo": True, "max_tokens": -1}, 400, "max_tokens", ">= 0"),
    ("completions", {"prompt": "x", "prompt_logprobs": 21}, 400, "prompt_logprobs", "[0, 20]"),
    ("completions", {"prompt": "x", "stop": [1000]}, 400, "stop", "1000"),
    ("completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options", "stream"),
    ("completions", {"prompt": []}, 400, "prompt", "non-empty"),
    ("completions", {"prompt": "x", "model": "gpt-4"}, 404, "model", "gpt-4"),
    ("chat/completions", {"messages": []}, 400, "messages", "messages"),
    ("chat/completions", {"messages": "hi"}, 400, "messages", "messages"),
    ("chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role", "role"),
    ("chat/completions", {"messages": [{"role": "user", "content": 3}]}, 400, "messages[0].content", "content"),
    ("completions", b'{"prompt": "a\\ud800b"}', 400, "prompt", "not valid Unicode"),
    ("chat/completions", b'{"messages": [{"role": "user", "content": "\\udc00"}]}', 400, "messages[0].content",
     "not valid Unicode"),
    ("completions", {"prompt": "\u00e9" * (4 * CONTEXT + 1)}, 400, "prompt", "without tokenizing"),  # bytes, not chars
    ("completions", {"prompt": "x", "suffix": "y"}, 400, "suffix", 'suffix = "y" is not supported'),
    ("completions", {"prompt": "x", "skip_special_tokens": "no"}, 400, "skip_special_tokens", "true or false"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x", "name": 5}]}, 400, "messages[0].name",
     "string"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, 400,
     "messages[0].tool_calls", "assistant"),
    ("chat/completions", {"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                                              "function": {"name": "f"}}]}]},
     400, "messages[0].tool_calls[0]", "arguments"),
    ("chat/completions", {"messages": [{"role": "assistant", "content": None}]}, 400, "messages[0].content", "null"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": "think"}, 400,
     "chat_template_kwargs", "object"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"tokenize": False}},
     400, "chat_template_kwargs", "may not set tokenize"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True}, 400,
     "continue_final_message", "add_generation_prompt to false"),
]


def test_bad_input_gets_4xx_and_serving_continues(server, solo):
    bystander, meanwhile = prompts(1, seed=6)[0], {}

    def stream_meanwhile():
        meanwhile["ids"] = asyncio.run(_in_client(server, lambda http: _stream_tokens(http, bystander, 120)))

    thread = threading.Thread(target=stream_meanwhile)
    thread.start()
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for endpoint, body, status, param, words in BAD:
            kw = {"content": body} if isinstance(body, bytes) else {"json": body}
            r = http.post(f"/v1/{endpoint}", headers=AUTH, **kw)
            err = r.json()["error"]
            assert r.status_code == status, (body, r.text)
            assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, (body, err)
            assert words in err["message"] and (param is None or param.split("[")[0] in err["message"]), err
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = http.post("/v1/completions", headers=headers, json={"prompt": "x"})
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert "Authorization" in r.json()["error"]["message"]
        assert http.get("/v1/models").status_code == 401
        assert http.get("/v1/models", headers=AUTH).json()["data"][0]["id"] == "tiny"
    thread.join(60)
    assert meanwhile["ids"] == solo(bystander, 120)  # a request running through all of it is undisturbed
    prompt = prompts(1, seed=4)[0]
    r = client(server).completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0,
                                          extra_body={"ignore_eos": True, "return_token_ids": True})
    assert r.choices[0].token_ids == solo(prompt, 16)
    assert server.metric("deltaflash_requests_total", outcome="invalid") >= len(BAD)
    assert server.metric("deltaflash_requests_total", outcome="unauthorized") >= 3


def test_metrics_report_rounds_and_tokens(server):
    """Counters move by exactly what one request did (the server is shared with the other tests)."""
    server.wait_idle()
    names = [("deltaflash_requests_total", {"outcome": "length"}), ("deltaflash_generated_tokens_total", {}),
             ("deltaflash_prompt_tokens_total", {}), ("deltaflash_accepted_length_count", {}),
             ("deltaflash_accepted_length_sum", {}), ("deltaflash_round_phase_seconds_count", {"phase": "decode"}),
             ("deltaflash_round_phase_seconds_count", {"phase": "prefill"}),
             ("deltaflash_time_to_first_token_seconds_count", {}), ("deltaflash_queue_time_seconds_count", {}),
             ("deltaflash_request_latency_seconds_count", {}), ("deltaflash_time_per_output_token_seconds_count", {}),
             ("deltaflash_time_per_output_token_seconds_sum", {})]
    before = [server.metric(name, **labels) for name, labels in names]
    client(server).completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
    server.wait_idle()
    delta = dict(zip([n + str(sorted(lb.values())) for n, lb in names],
                     [server.metric(name, **labels) - b for (name, labels), b in zip(names, before)]))
    assert delta["deltaflash_requests_total['length']"] == 1
    assert delta["deltaflash_generated_tokens_total[]"] == 12 and delta["deltaflash_prompt_tokens_total[]"] == 3
    assert delta["deltaflash_time_to_first_token_seconds_count[]"] == 1
    assert delta["deltaflash_queue_time_seconds_count[]"] == 1
    assert delta["deltaflash_request_latency_seconds_count[]"] == 1
    assert delta["deltaflash_time_per_output_token_seconds_count[]"] == 1
    assert 0 < delta["deltaflash_time_per_output_token_seconds_sum[]"] < 5
    assert delta["deltaflash_round_phase_seconds_count['prefill']"] == 1
    rounds = delta["deltaflash_round_phase_seconds_count['decode']"]
    assert 1 <= rounds <= 11 and delta["deltaflash_accepted_length_count[]"] in (rounds, rounds - 1)
    assert delta["deltaflash_accepted_length_sum[]"] >= 11 - 1  # the tokens after the first, less a last plain row
    assert server.metric("deltaflash_queue_depth") == 0 and server.metric("deltaflash_active_slots") == 0
    assert server.metric("deltaflash_slot_usage_ratio") == 0


def test_the_samples_of_one_prompt_share_its_prefill(server):
    """n = 3: the prompt is prefilled once, in one step, and the two other choices fork from it."""
    server.wait_idle()
    names = ["deltaflash_shared_prompt_tokens_total", "deltaflash_prompt_tokens_total", "deltaflash_queue_time_seconds_count"]
    before = [server.metric(name) for name in names] + [server.metric("deltaflash_round_phase_seconds_count",
                                                                      phase="prefill")]
    r = client(server).completions.create(model="tiny", prompt=[1, 2, 3, 4, 5], max_tokens=6, n=3, temperature=1.0,
                                          seed=4, extra_body={"ignore_eos": True})
    server.wait_idle()
    after = [server.metric(name) for name in names] + [server.metric("deltaflash_round_phase_seconds_count",
                                                                     phase="prefill")]
    assert [a - b for a, b in zip(after, before)] == [10, 15, 3, 1]
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 18 and len({c.text for c in r.choices}) > 1
    assert r.usage.prompt_tokens_details.cached_tokens == 0  # (the prompt, counted once, was prefilled)


def test_a_prompt_that_begins_with_an_earlier_one_starts_from_its_state(server):
    """The prefix cache over HTTP: a 70-token prompt, then the same prompt and 6 more tokens (an agent's
    next turn): the second prefills 6 tokens, the first 70 come from the cache (its outputs against a
    prefill of the whole prompt: tests/test_prefix_cache.py), and its usage says so, as OpenAI's prompt
    caching does - in a body and in a stream's usage chunk."""
    server.wait_idle()
    first = [3 + (i * 7) % 250 for i in range(70)]
    body = dict(model="tiny", max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    alone = client(server).completions.create(prompt=first, **body)
    server.wait_idle()
    before = server.metric("deltaflash_prefix_cache_hit_tokens_total")
    turn = client(server).completions.create(prompt=first + [5, 6, 7, 8, 9, 10], **body)
    server.wait_idle()
    assert server.metric("deltaflash_prefix_cache_hit_tokens_total") - before == 70
    assert turn.choices[0].text
    assert (alone.usage.prompt_tokens_details.cached_tokens, turn.usage.prompt_tokens_details.cached_tokens) == (0, 70)
    chunks = list(client(server).completions.create(prompt=first + [5, 6, 7, 8, 9, 10, 11], stream=True,
                                                    stream_options={"include_usage": True}, **body))
    assert chunks[-1].usage.prompt_tokens == 77 and chunks[-1].usage.prompt_tokens_details.cached_tokens == 76


def test_unknown_fields_are_ignored_and_logged_once(server):
    """Fields deltaflash does not know (OpenAI's newer ones, other servers' extensions) change nothing
    and are logged once per name; --strict-fields makes them a 400 (test_strict_fields_...)."""
    c, messages = client(server), [{"role": "user", "content": "def hello"}]
    plain = c.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    for _ in range(2):
        r = c.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "def hello", "x_note": "n"}], max_tokens=8,
            temperature=0, metadata={"run": "a"}, service_tier="auto", stream=True,
            extra_body={"stream_options": {"include_usage": True, "continuous_usage_stats": True}, "x_knob": 1})
        chunks = list(r)
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == \
            plain.choices[0].message.content
        assert chunks[-1].usage.completion_tokens == 8
    log = server.log.read_text()
    for name in ("'metadata'", "'service_tier'", "'x_knob'", "'messages[].x_note'",
                 "'stream_options.continuous_usage_stats'"):
        assert log.count(f"ignoring the unknown request field {name}") == 1, (name, log)


def test_strict_fields_rejects_unknown_fields(pair, tmp_path):
    proc = ServerProcess(pair[0], tmp_path / "strict.log", "--strict-fields", "--max-model-len", "64")
    try:
        c = openai.OpenAI(base_url=proc.url + "/v1", api_key="none", max_retries=0, timeout=60)
        cases = [(dict(metadata={"run": "a"}), "metadata"),
                 (dict(messages=[{"role": "user", "content": "hi", "x_note": 1}]), "messages[0].x_note"),
                 (dict(stream=True, stream_options={"include_usage": True},
                       extra_body={"stream_options": {"continuous_usage_stats": True}}),
                  "stream_options.continuous_usage_stats")]
        for kw, param in cases:
            with pytest.raises(openai.BadRequestError) as err:
                c.chat.completions.create(**({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                              "max_tokens": 2} | kw))
            assert err.value.param == param and f"unknown field '{param}'" in err.value.message
        r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                      extra_body={"skip_special_tokens": True, "spaces_between_special_tokens": True})
        assert r.choices[0].finish_reason == "length"
    finally:
        assert proc.stop() == 0


@contextlib.contextmanager
def in_process_server(target):
    """`deltaflash serve`'s app (target-only, CPU) under uvicorn on a thread of this process, on any free port,
    so that a test can reach inside it. Yields its base URL."""
    engine = Engine.from_pretrained(target, device="cpu", progress=False, max_slots=SLOTS, max_model_len=CONTEXT)
    card = ModelCard("tiny", engine.cfg.vocab_size, CONTEXT, 0, int(time.time()))
    metrics = Metrics(0)
    app = build_app(Frontend(card, load_tokenizer(target)), EngineWorker(engine, WorkerConfig(), metrics), metrics,
                    ServerSettings(api_key=KEY))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        for _ in range(1200):  # a guard against a server that never starts, not a timing
            if server.started or not thread.is_alive():
                break
            time.sleep(0.05)
        assert server.started, "the in-process server did not start"
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(60)
        sock.close()


def test_a_body_being_parsed_holds_up_neither_health_nor_running_streams(pair, one_thread, monkeypatch):
    """Request bodies are parsed and checked on the frontend's thread, never on the event loop or the engine's:
    while a 16 MB prompt is held inside its JSON parse, /health answers and every running stream gets three more
    chunks; released, the prompt is refused (400 context_length_exceeded, without tokenizing it) and the streams
    finish whole. Order decides this test, not time: the parse waits for those events (a 60 s guard fails a
    hang - a parse on the event loop would be one)."""
    huge = json.dumps({"model": "tiny", "prompt": "def hello " * ((16 << 20) // 10), "max_tokens": 4}).encode()
    parse_json, held, release = server_app.parse_json, threading.Event(), threading.Event()

    def gated_parse(raw):
        if len(raw) >= len(huge):
            held.set()
            if not release.wait(60):
                raise RuntimeError("the parse was never released")
        return parse_json(raw)

    monkeypatch.setattr(server_app, "parse_json", gated_parse)
    chunks, finishes, refusal = {}, {}, {}
    batch = prompts(SLOTS, seed=9)

    async def one_stream(http, i):
        body = {"model": "tiny", "prompt": batch[i], "max_tokens": CONTEXT - len(batch[i]), "temperature": 0,
                "stream": True, "ignore_eos": True}
        async with http.stream("POST", "/v1/completions", json=body) as r:
            chunks[i] = 0
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    chunks[i] += 1
                    finishes[i] = json.loads(line[6:])["choices"][0]["finish_reason"]

    def wait_until(condition, what):
        for _ in range(1200):  # a guard, as above
            if condition():
                return
            time.sleep(0.05)
        raise AssertionError(f"never: {what}")

    def refuse(url):
        with httpx.Client(base_url=url, headers=AUTH, timeout=120) as http:
            r = http.post("/v1/completions", content=huge, headers={"Content-Type": "application/json"})
            refusal["status"], refusal["body"] = r.status_code, r.json()

    with in_process_server(pair[0]) as url:
        streams = threading.Thread(target=lambda: asyncio.run(_in_client(
            SimpleNamespace(url=url), lambda http: asyncio.gather(*(one_stream(http, i) for i in range(SLOTS))))))
        streams.start()
        wait_until(lambda: len(chunks) == SLOTS and min(chunks.values()) >= 3, "every stream flowing")
        refuser = threading.Thread(target=refuse, args=(url,))
        refuser.start()
        try:
            wait_until(held.is_set, "the huge body in its parse")
            before = dict(chunks)
            with httpx.Client(base_url=url, timeout=60) as http:
                assert http.get("/health").json()["status"] == "ok"
            wait_until(lambda: all(chunks[i] >= before[i] + 3 for i in range(SLOTS)), "streams moving beside the parse")
            assert not refusal  # no answer while its parse is held
        finally:
            release.set()
            refuser.join(120)
            streams.join(300)
    assert refusal["status"] == 400 and refusal["body"]["error"]["code"] == "context_length_exceeded", refusal
    assert refusal["body"]["error"]["param"] == "prompt" and "without tokenizing" in refusal["body"]["error"]["message"]
    assert finishes == {i: "length" for i in range(SLOTS)}


def test_special_tokens_are_dropped_unless_kept_alike_in_cli_and_server(server, pair, one_thread):
    """One decode rule: the end-of-text token (id 0, special) inside a greedy output is no text by default,
    in `deltaflash generate` and in the server; `skip_special_tokens: false` keeps it."""
    engine = Engine.from_pretrained(pair[0], device="cpu", progress=False, max_slots=16, max_model_len=CONTEXT)
    candidates = prompts(64, seed=7)
    done, _ = engine.generate(candidates, SamplingParams(max_new_tokens=40, ignore_eos=True))
    prompt, out = next((p, d.token_ids) for p, d in zip(candidates, done) if 0 in d.token_ids[1:])
    n = min(out.index(0, 1) + 3, len(out))
    cli = subprocess.Popen([sys.executable, "-m", "deltaflash", "generate", "--model", str(pair[0]), "--draft",
                            str(pair[1]), "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", str(n),
                            "--ignore-eos", "--device", "cpu", "--json"], stdout=subprocess.PIPE, text=True,
                           env=child_env())
    c, common = client(server), dict(model="tiny", prompt=prompt, max_tokens=n, temperature=0)
    skipped = c.completions.create(extra_body={"ignore_eos": True, "return_token_ids": True}, **common).choices[0]
    kept = c.completions.create(extra_body={"ignore_eos": True, "skip_special_tokens": False}, **common).choices[0]
    streamed = c.completions.create(stream=True, extra_body={"ignore_eos": True, "skip_special_tokens": False},
                                    **common)
    assert skipped.token_ids == out[:n]
    assert "<|endoftext|>" not in skipped.text and kept.text.count("<|endoftext|>") == out[:n].count(0)
    assert kept.text.replace("<|endoftext|>", "") == skipped.text
    assert "".join(ch.choices[0].text for ch in streamed) == kept.text
    assert json.loads(cli.communicate(timeout=300)[0])["text"] == skipped.text


def test_chat_messages_reach_the_template_with_name_and_tool_calls(server):
    calls = [{"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]
    messages = [{"role": "user", "content": "hi", "name": "bob"}, {"role": "assistant", "content": None,
                                                                   "tool_calls": calls},
                {"role": "tool", "content": "2", "tool_call_id": "call_1"}]
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as http:
        tokenized = http.post("/tokenize", json={"messages": messages}).json()
        text = http.post("/detokenize", json={"tokens": tokenized["tokens"]}).json()["prompt"]
        bare = http.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    assert text == ("<user name=bob>hi\n<assistant><tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n"
                    "</function>\n</tool_call>\n<tool id=call_1><tool_response>2</tool_response>\n<assistant>")
    assert tokenized["count"] == len(tokenized["tokens"]) > bare["count"] and tokenized["max_model_len"] == CONTEXT
    r = client(server).chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    assert r.usage.prompt_tokens == tokenized["count"]


def test_chat_template_fields_render_as_vllm_takes_them(server):
    """chat_template_kwargs reach the template as variables (here Qwen3's enable_thinking: an empty think block
    after the assistant's turn opens), continue_final_message leaves the last message open, and a chat request
    is prompted with what /tokenize renders from the same fields."""
    user = [{"role": "user", "content": "hi"}]
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as http:
        def rendered(**fields):
            r = http.post("/tokenize", json=fields).json()
            return r["count"], http.post("/detokenize", json={"tokens": r["tokens"]}).json()["prompt"]
        thinking = rendered(messages=user)
        quiet = rendered(messages=user, chat_template_kwargs={"enable_thinking": False})
        opened = rendered(messages=user + [{"role": "assistant", "content": "def f"}], add_generation_prompt=False,
                          continue_final_message=True)
    assert thinking[1] == "<user>hi\n<assistant>" and quiet[1] == "<user>hi\n<assistant><think></think>"
    assert opened[1] == "<user>hi\n<assistant>def f"
    r = client(server).chat.completions.create(model="tiny", messages=user, max_tokens=1,
                                               extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.usage.prompt_tokens == quiet[0] > thinking[0]


def test_tokenize_and_detokenize(server, solo):
    tok = solo.tokenizer
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as http:
        r = http.post("/tokenize", json={"model": "tiny", "prompt": "def hello"}).json()
        assert r == {"tokens": tok.encode("def hello", add_special_tokens=False), "count": len(r["tokens"]),
                     "max_model_len": CONTEXT}
        completion = client(server).completions.create(model="tiny", prompt="def hello", max_tokens=1)
        assert completion.usage.prompt_tokens == r["count"]
        assert http.post("/detokenize", json={"tokens": r["tokens"] + [0]}).json() == \
            {"prompt": "def hello<|endoftext|>"}
        assert http.post("/detokenize", json={"tokens": [0] + r["tokens"], "skip_special_tokens": True}).json() == \
            {"prompt": "def hello"}
        bad = [("/tokenize", {}, "prompt", "either"), ("/tokenize", {"prompt": 5}, "prompt", "string"),
               ("/tokenize", {"prompt": "x", "messages": []}, "messages", "either"),
               ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "role"),
               ("/tokenize", {"prompt": "x" * (8 * CONTEXT + 1)}, "prompt", "without tokenizing"),
               ("/tokenize", {"prompt": "x", "model": "gpt-4"}, "model", "gpt-4"),
               ("/detokenize", {"tokens": "abc"}, "tokens", "integer"),
               ("/detokenize", {"tokens": [1, 400]}, "tokens", "400")]
        for path, body, param, words in bad:
            r = http.post(path, json=body)
            assert 400 <= r.status_code < 500 and r.json()["error"]["param"] == param, (body, r.text)
            assert words in r.json()["error"]["message"], r.text
        for path in ("/tokenize", "/detokenize"):
            assert httpx.post(server.url + path, json={"prompt": "x", "tokens": [1]}).status_code == 401


def test_health_answers_head(server):
    r = httpx.head(server.url + "/health", timeout=10)
    assert r.status_code == 200 and r.content == b"" and "Retry-After" not in r.headers
