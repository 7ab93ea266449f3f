"""The engine worker thread and incremental detokenization, in process (no HTTP)."""

import threading
import time

import pytest
import torch

from deltaflash.engine.engine import Engine
from deltaflash.core.request import SamplingParams
from deltaflash.server.errors import QueueFull, ServerUnavailable
from deltaflash.server.metrics import Metrics
from deltaflash.server.worker import EngineWorker, Job, WorkerConfig
from deltaflash.server.textstream import TextStream
from tests.server_process import tiny_pair


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield tiny_pair(tmp_path_factory.mktemp("sched"), drafter=False)[0]
    torch.set_num_threads(before)


class Log:
    """Outputs of every job in delivery order (sinks run on the engine worker thread)."""

    def __init__(self):
        self.entries, self.finished, self.lock = [], {}, threading.Lock()

    def sink(self, rid):
        def put(out):
            with self.lock:
                self.entries.append((rid, out))
                if out.finish_reason or out.error:
                    self.finished.setdefault(rid, threading.Event()).set()
        return put

    def wait(self, rid, timeout_s=60):
        with self.lock:
            event = self.finished.setdefault(rid, threading.Event())
        assert event.wait(timeout_s), f"{rid} did not finish"
        return [o for r, o in self.entries if r == rid]


def job(rid, prompt, log, max_tokens, stop=()):
    return Job(rid, tuple(prompt), SamplingParams(max_new_tokens=max_tokens, ignore_eos=True), stop, log.sink(rid))


def solo(folder, prompt, n):
    engine = Engine.from_pretrained(folder, device="cpu", progress=False, max_slots=1, max_model_len=256)
    return engine.generate([prompt], SamplingParams(max_new_tokens=n, ignore_eos=True))[0][0].token_ids


def test_long_prompt_prefills_in_chunks_while_others_stream(folder):
    engine = Engine.from_pretrained(folder, device="cpu", progress=False, max_slots=2, max_model_len=256,
                                    max_num_batched_tokens=8, idle_prefill_tokens=8)
    sched, log = EngineWorker(engine, WorkerConfig(), Metrics()), Log()
    sched.start()
    sched.submit(job("a", [5, 6, 7], log, 60))
    while not log.entries:
        time.sleep(0.001)
    mark, long_prompt = len(log.entries), list(range(10, 74))  # 64 tokens = 8 prefill chunks
    sched.submit(job("b", long_prompt, log, 4))
    out_b, out_a = log.wait("b"), log.wait("a")
    sched.close()
    first_b = next(i for i, (rid, _) in enumerate(log.entries) if rid == "b")
    a_while_b_prefills = sum(rid == "a" for rid, _ in log.entries[mark:first_b])
    assert a_while_b_prefills >= 64 // 8 - 1  # a got a token in every round of b's prefill
    assert sum((o.token_ids for o in out_a), ()) == tuple(solo(folder, [5, 6, 7], 60))
    assert sum((o.token_ids for o in out_b), ()) == tuple(solo(folder, long_prompt, 4))
    assert engine.num_live == 0 and sched.load.active_slots == 0


def test_request_timeout_retires_at_a_round_boundary(folder):
    engine = Engine.from_pretrained(folder, device="cpu", progress=False, max_slots=2, max_model_len=256)
    metrics, log = Metrics(), Log()
    sched = EngineWorker(engine, WorkerConfig(request_timeout_s=0.3), metrics)
    sched.start()
    t0 = time.monotonic()
    sched.submit(job("slow", [1, 2, 3], log, 250))
    outs = log.wait("slow")
    assert outs[-1].finish_reason == "cancelled" and outs[-1].completion_tokens < 250
    assert time.monotonic() - t0 >= 0.3  # not before its timeout
    sched.close()
    assert metrics.requests.labels(outcome="timeout")._value.get() == 1
    assert engine.num_live == 0


def test_stop_string_cuts_text_and_frees_the_slot(folder):
    engine = Engine.from_pretrained(folder, device="cpu", progress=False, max_slots=2, max_model_len=256)
    sched, log = EngineWorker(engine, WorkerConfig(), Metrics()), Log()
    sched.start()
    ref = solo(folder, [9, 8, 7], 30)
    text = engine.tokenizer.decode(ref)
    start = next(i for i in range(4, len(text) - 3) if "\ufffd" not in text[i:i + 3])
    stop = text[start:start + 3]
    sched.submit(job("s", [9, 8, 7], log, 30, stop=(stop,)))
    outs = log.wait("s")
    assert "".join(o.text for o in outs) == text[:text.index(stop)]
    assert outs[-1].finish_reason == "stop" and outs[-1].completion_tokens < 30
    ids = sum((o.token_ids for o in outs), ())
    assert ids == tuple(ref[:len(ids)]) and stop in engine.tokenizer.decode(list(ids))
    sched.close()
    assert engine.num_live == 0


def stop_string_of(folder, engine, prompt, n):
    """Three characters from inside the greedy text of `prompt` (n tokens): a stop string it meets."""
    text = engine.tokenizer.decode(solo(folder, prompt, n))
    start = next(i for i in range(4, len(text) - 3) if "\ufffd" not in text[i:i + 3])
    return text[start:start + 3]


def test_tokens_reach_clients_while_the_device_runs_the_next_step(folder):
    """With overlap_host (the default) a step's events are routed - detokenised, stop strings checked,
    sent - inside the next engine step, while the device computes it; without it, between steps. The
    clients get the same text, tokens and finish reasons either way, a stop string's included."""
    got, inside = {}, {}
    for overlap in (True, False):
        engine = Engine.from_pretrained(folder, device="cpu", progress=False, max_slots=2, max_model_len=256)
        stop = stop_string_of(folder, engine, [9, 8, 7], 30)
        stepping, delivered = [False], []
        real_step = engine.step

        def step(*args, real_step=real_step, stepping=stepping, **kwargs):
            stepping[0] = True
            try:
                return real_step(*args, **kwargs)
            finally:
                stepping[0] = False

        engine.step = step
        log = Log()

        def sink(rid, log=log, stepping=stepping, delivered=delivered):
            put = log.sink(rid)

            def record(out):
                delivered.append(stepping[0])
                put(out)
            return record

        worker = EngineWorker(engine, WorkerConfig(overlap_host=overlap), Metrics())
        jobs = [Job("a", (9, 8, 7), SamplingParams(max_new_tokens=30, ignore_eos=True), (stop,), sink("a")),
                Job("b", (1, 2, 3), SamplingParams(max_new_tokens=30, ignore_eos=True), (), sink("b")),
                Job("c", (4, 5), SamplingParams(max_new_tokens=12, ignore_eos=True), (), sink("c"))]
        worker.submit(*jobs)  # before the thread starts: its first step takes all three
        worker.start()
        got[overlap] = {rid: ("".join(o.text for o in outs), [t for o in outs for t in o.token_ids], outs[-1].finish_reason)
                        for rid in "abc" for outs in [log.wait(rid)]}
        worker.close()
        assert engine.num_live == 0
        inside[overlap] = delivered
    assert got[True] == got[False]
    assert got[True]["a"][2] == "stop" and got[True]["b"][2] == got[True]["c"][2] == "length"
    assert not any(inside[False])
    # with the overlap only the outputs of the last step before the engine ran dry are routed outside a step
    assert len(inside[True]) - sum(inside[True]) <= 3 < sum(inside[True])


def test_the_devices_wait_is_a_metric_where_it_was_measured(folder):
    """On the CPU nothing is measured (its kernels run on the host): no step reports a wait. A step that
    reports one is observed; bench serve reads the sum and count back from the page."""
    from deltaflash.bench.serve import device_idle, scrape
    from deltaflash.core.request import StepReport

    engine = Engine.from_pretrained(folder, device="cpu", progress=False, max_slots=1, max_model_len=64)
    reports = []
    engine.add_request([1, 2], SamplingParams(max_new_tokens=5, ignore_eos=True))
    while engine.has_work():
        engine.step(reports.append)
    assert len(reports) > 2 and all(r.device_idle_s is None for r in reports)
    metrics = Metrics()
    before = scrape(metrics.render().decode())
    for r in reports:
        metrics.observe_step(r)
    metrics.observe_step(StepReport(0, 0, 0.0, 1, 0.001, device_idle_s=2e-4))
    metrics.observe_step(StepReport(0, 0, 0.0, 1, 0.001, device_idle_s=6e-4))
    after = scrape(metrics.render().decode())
    idle = device_idle(before, after, wall=0.01)
    assert idle["device_idle_s"] == pytest.approx(8e-4) and idle["device_idle_share"] == pytest.approx(0.08)
    assert idle["device_idle_per_step_us"] == pytest.approx(400)
    assert device_idle(before, before, wall=1.0)["device_idle_share"] is None


def test_stop_string_and_cancels_in_the_same_step(folder):
    """Step n: request a's text hits its stop string (answered "stop" at once, its slot freed a step
    later) while b streams. Before step n+1 both clients cancel: a stays "stop" (one final output),
    b ends "cancelled"; each outcome is counted once and every slot is free."""
    engine = Engine.from_pretrained(folder, device="cpu", progress=False, max_slots=2, max_model_len=256)
    metrics, log = Metrics(), Log()
    worker = EngineWorker(engine, WorkerConfig(), metrics)  # driven step by step here, no thread
    worker.submit(job("a", [9, 8, 7], log, 30, stop=(stop_string_of(folder, engine, [9, 8, 7], 30),)))
    worker.submit(job("b", [1, 2, 3], log, 30))

    def iterate():
        worker._take_inbox()
        for event in engine.step():
            worker._route(event)
        worker._publish()

    while not any(o.finish_reason for r, o in log.entries if r == "a"):
        iterate()
    worker.cancel("a")
    worker.cancel("b")
    for _ in range(3):
        iterate()
    finals = [(r, o.finish_reason) for r, o in log.entries if o.finish_reason]
    assert sorted(finals) == [("a", "stop"), ("b", "cancelled")]
    assert metrics.requests.labels(outcome="stop")._value.get() == 1
    assert metrics.requests.labels(outcome="cancelled")._value.get() == 1
    assert engine.num_live == 0 and not engine.has_work() and worker.load.active_slots == 0


def test_failing_engine_fails_requests_and_refuses_new_ones(folder):
    engine = Engine.from_pretrained(folder, device="cpu", progress=False, max_slots=1, max_model_len=64)

    def broken_step(on_report=None, overlap=None):
        raise RuntimeError("device lost")

    engine.step = broken_step
    sched, log = EngineWorker(engine, WorkerConfig(), Metrics()), Log()
    sched.start()
    sched.submit(job("x", [1, 2], log, 4))
    error = log.wait("x")[-1].error
    assert error.status == 500 and "device lost" in error.message
    with pytest.raises(ServerUnavailable):
        sched.submit(job("y", [1, 2], log, 4))


def test_jobs_of_one_request_are_admitted_all_or_none(folder):
    """n choices are n jobs: a request whose jobs do not all fit is refused whole (429), taking no room; the
    jobs of one request reach the engine together (its choices fork from one prefill)."""
    engine = Engine.from_pretrained(folder, device="cpu", progress=False, max_slots=1, max_model_len=64)
    worker, log = EngineWorker(engine, WorkerConfig(max_queue=2), Metrics()), Log()  # holds 3; not started
    worker.submit(job("a0", [1], log, 4), job("a1", [1], log, 4))
    with pytest.raises(QueueFull):
        worker.submit(job("b0", [2], log, 4), job("b1", [2], log, 4))
    worker.submit(job("c0", [3], log, 4))
    assert worker.capacity == 3 and [[j.request_id for j in jobs] for jobs in worker._inbox_items()] == \
        [["a0", "a1"], ["c0"]]


class PieceTokenizer:
    """decode(ids) concatenates fixed pieces: text boundaries exactly where the test wants them."""

    pieces = {1: "he", 2: "l", 3: "lo", 4: " w", 5: "orld"}

    def decode(self, ids, **options):
        return "".join(self.pieces[i] for i in ids)


def test_text_stream_holds_back_possible_stop_prefixes():
    ts = TextStream(PieceTokenizer(), ("lo w",))
    taken = []
    for tok in (1, 2, 3, 4, 5):
        ts.push(tok)
        taken.append(ts.take())
    # text "he" "hel" "hello" "hello w": an "l" or "lo" tail may start the stop string, so it waits
    assert taken == ["he", "", "l", "", ""] and ts.stopped and ts.text == "hel"
    ts = TextStream(PieceTokenizer(), ("xyz",))
    for tok in (1, 2, 3):
        ts.push(tok)
    assert ts.take() == "hello" and not ts.stopped


def test_text_stream_deltas_equal_full_decode(folder):
    """Incremental text equals the full decode (random bytes: cut and invalid UTF-8; a special token at
    every place), in the Rust window (DecodeStream) and the Python one alike, piece by piece."""
    from deltaflash.tokenizer import DecodeOptions, decode, load_tokenizer

    tok = load_tokenizer(folder)
    assert TextStream(tok)._stream is not None and TextStream(PythonDecode(tok))._stream is None
    g = torch.Generator().manual_seed(0)
    for i in range(20):
        ids = torch.randint(0, 320, (40,), generator=g).tolist()  # random bytes: cut and invalid UTF-8
        ids[i] = 0  # the special end-of-text token, at every place
        for options in (DecodeOptions(), DecodeOptions(skip_special_tokens=False)):
            streamed = []
            for stream in (TextStream(tok, options=options), TextStream(PythonDecode(tok), options=options)):
                pieces = []
                for t in ids:
                    stream.push(t)
                    pieces.append(stream.take())
                stream.finish()
                pieces.append(stream.take(final=True))
                assert "".join(pieces) == decode(tok, ids, options)
                assert ("<|endoftext|>" in "".join(pieces)) == (not options.skip_special_tokens)
                streamed.append(pieces)
            assert streamed[0] == streamed[1]  # the Rust window releases text exactly when the Python one does
    ids = tok.encode("the quick brown fox jumps over the lazy dog", add_special_tokens=False)
    full = decode(tok, ids)
    for stream in (TextStream(tok, ("fox",)), TextStream(PythonDecode(tok), ("fox",))):
        for t in ids:
            stream.push(t)
        assert stream.stopped and stream.text == full[:full.index("fox")] == stream.take()


class PythonDecode:
    """The tokenizer without its Rust backend in view: TextStream's window runs in Python."""

    def __init__(self, tokenizer):
        self.decode = tokenizer.decode


def test_drain_deadline_answers_503_and_queue_time_is_per_admission(folder):
    """One slot, two jobs: the second's queue time spans the first's run. At the drain deadline the
    running job gets a ServerUnavailable "server_shutdown" error, never finish_reason "cancelled"."""
    engine = Engine.from_pretrained(folder, device="cpu", progress=False, max_slots=1, max_model_len=256)
    metrics, log = Metrics(), Log()
    sample = metrics.registry.get_sample_value
    worker = EngineWorker(engine, WorkerConfig(), metrics)
    worker.start()
    t0 = time.monotonic()
    worker.submit(job("first", [1, 2, 3], log, 20))
    worker.submit(job("second", [4, 5], log, 250))
    log.wait("first")
    first_s = time.monotonic() - t0
    while sum(r == "second" for r, _ in log.entries) < 2:  # admitted, and a step published since
        time.sleep(0.001)
    assert sample("deltaflash_queue_time_seconds_count") == 2
    assert sample("deltaflash_queue_time_seconds_sum") >= 0.8 * first_s  # the second waited for the slot
    assert sample("deltaflash_slot_usage_ratio") == 1.0
    worker.drain(0)
    last = log.wait("second")[-1]
    assert last.finish_reason is None and last.error.status == 503 and last.error.code == "server_shutdown"
    worker.close()
    assert sample("deltaflash_requests_total", {"outcome": "shutdown"}) == 1
    assert sample("deltaflash_requests_total", {"outcome": "cancelled"}) == 0
    assert sample("deltaflash_request_latency_seconds_count") == 1  # only "first" finished
    assert sample("deltaflash_time_per_output_token_seconds_count") == 1
    assert engine.num_live == 0 and sample("deltaflash_slot_usage_ratio") == 0


def test_a_kernel_loaded_while_serving_is_counted_and_logged(folder, caplog):
    """The worker listens to Triton's compiles while it serves: each load (a request waited for it) goes to
    /metrics and the log; the listener is gone once the worker stops. (No GPU here: the test calls the
    listener as Triton's compiler does.)"""
    import triton

    engine = Engine.from_pretrained(folder, device="cpu", progress=False, max_slots=1, max_model_len=64)
    metrics = Metrics()
    worker = EngineWorker(engine, WorkerConfig(), metrics)
    knobs = triton.knobs.compilation
    assert knobs.listener is None
    worker.start()
    deadline = time.monotonic() + 30
    while knobs.listener is None and time.monotonic() < deadline:
        time.sleep(0.001)

    class Source:
        name = "paged_attention_kernel"

    with caplog.at_level("WARNING", logger="deltaflash.server"):
        for cache_hit in (False, True, False):
            knobs.listener(src=Source(), metadata={}, metadata_group={}, times=None, cache_hit=cache_hit)
    worker.close()
    text = metrics.render().decode()
    assert 'deltaflash_kernel_loads_total{source="compiled"} 2.0' in text
    assert 'deltaflash_kernel_loads_total{source="disk cache"} 1.0' in text
    assert sum("paged_attention_kernel was compiled while serving" in r.getMessage() for r in caplog.records) == 2
    assert knobs.listener is None


def test_rounds_are_counted_by_kind():
    """/metrics counts decode rounds as trees, chains or plain decoding (the trees-or-chains choice)."""
    from deltaflash.core.request import StepReport

    metrics = Metrics()
    for widths, budget in (((8, 1), 16), ((8, 8), 0), ((1, 1), 0), ((8,), 16), ((), 0)):
        metrics.observe_step(StepReport(0, 0, 0.0, len(widths), 0.001, widths=widths, tree_budget=budget))
    counts = {s.labels["kind"]: s.value for f in metrics.registry.collect() for s in f.samples
              if s.name == "deltaflash_rounds_total"}
    assert counts == {"tree": 2, "chain": 1, "plain": 1}
