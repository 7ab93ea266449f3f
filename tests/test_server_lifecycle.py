"""Request timeouts, graceful shutdown and the `deltaflash bench serve` load script, each against a real
server process on 127.0.0.1."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.server_process import ServerProcess, child_env, sse_payloads, tiny_pair


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return tiny_pair(tmp_path_factory.mktemp("life"), drafter=False)[0]


@pytest.fixture(scope="module")
def server(target, tmp_path_factory):
    proc = ServerProcess(target, tmp_path_factory.mktemp("log") / "server.log", "--max-concurrency", "2",
                         "--request-timeout", "4", "--shutdown-timeout", "1.5")
    yield proc
    proc.stop()


def stream(url, max_tokens, out: dict, started: threading.Event | None = None):
    body = {"prompt": [4, 5, 6], "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    t0 = time.monotonic()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        lines = []
        for line in r.iter_lines():
            lines.append(line)
            if started is not None and len(lines) > 2:
                started.set()
    out["events"], out["elapsed"] = sse_payloads(lines), time.monotonic() - t0
    out["finish"] = [e["choices"][0]["finish_reason"] for e in out["events"][:-1] if "choices" in e][-1]


def complete(url, max_tokens, out: dict):
    body = {"prompt": [4, 5, 6], "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    out["response"] = httpx.post(url + "/v1/completions", json=body, timeout=60)


def test_request_timeout_cancels_and_frees_the_slot(server):
    out = {}
    stream(server.url, 4000, out)
    assert out["finish"] == "cancelled" and out["events"][-1] == "[DONE]"
    assert out["elapsed"] >= 4  # not before its --request-timeout
    server.wait_idle()
    assert server.metric("deltaflash_requests_total", outcome="timeout") == 1


def test_sigterm_finishes_short_requests_answers_long_ones_503_and_exits_0(server):
    """Requests the drain deadline cuts get an OpenAI-shaped 503 "server_shutdown" (an SSE error event then
    [DONE] when streaming), never the non-OpenAI finish_reason "cancelled"."""
    long, short, whole = {}, {}, {}
    threads = []
    for out, n in ((long, 4000), (short, 60)):
        started = threading.Event()
        threads.append(threading.Thread(target=stream, args=(server.url, n, out, started)))
        threads[-1].start()
        assert started.wait(30)
    threads.append(threading.Thread(target=complete, args=(server.url, 4000, whole)))
    threads[-1].start()
    deadline = time.monotonic() + 30
    while (h := server.health())["active_slots"] + h["queued"] < 3:  # all three submitted (2 slots)
        assert time.monotonic() < deadline
        time.sleep(0.02)
    server.proc.send_signal(signal.SIGTERM)  # drain: 1.5 s for in-flight requests, then a 503
    for t in threads:
        t.join(30)
    assert server.proc.wait(30) == 0
    assert short["finish"] == "length" and short["events"][-1] == "[DONE]"
    error = long["events"][-2]["error"]
    assert error["code"] == "server_shutdown" and error["type"] == "server_error" and long["events"][-1] == "[DONE]"
    assert all(e["choices"][0]["finish_reason"] is None for e in long["events"][:-2])
    r = whole["response"]
    assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutdown"  # (the drain cut it, not the timeout)
    assert r.headers["Retry-After"] == "5"
    assert "stopped" in server.log.read_text()
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url + "/health", timeout=5)


def test_bench_serve_load_script(target, tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "deltaflash", "bench", "serve", "--model", str(target),
                           "--device", "cpu", "--clients", "64", "--requests", "64", "--max-tokens", "8",
                           "--max-concurrency", "4", "--distinct-prompts", "6", "--no-host-overlap", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, env=child_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["errors"] == 0 and result["mismatches"] == 0 and result["idle_after"]
    assert result["disconnected"] == round(0.2 * 64) and result["completed"] == 64 - result["disconnected"]
    streamed = round(result["output_tokens_per_s"] * result["wall_s"])  # every token any client received
    assert 8 * result["completed"] <= streamed < 8 * result["requests"]  # none lost, none doubled
    assert result["requests_per_s"] > 0 and 0 < result["ttft_p50_ms"] < result["wall_s"] * 1e3
    assert "requests_per_s" in proc.stdout


def children(pid: int) -> list[int]:
    """Live child processes of `pid` (from /proc: field 4 of /proc/<child>/stat is the parent)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def test_bench_serve_stopped_by_sigterm_stops_its_server(target, tmp_path):
    """`timeout` (SIGTERM) on a bench serve run must not leave the server it started running, holding
    the device: the bench stops it on the way out, even while it is still starting."""
    bench = subprocess.Popen([sys.executable, "-m", "deltaflash", "bench", "serve", "--model", str(target),
                              "--device", "cpu", "--clients", "2", "--requests", "100000", "--max-tokens", "64"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=child_env(), start_new_session=True)
    servers = []
    deadline = time.monotonic() + 120
    while not servers and time.monotonic() < deadline:  # its `deltaflash serve` child exists
        time.sleep(0.2)
        servers = children(bench.pid)
    assert servers, "bench serve started no server"
    time.sleep(3)
    bench.send_signal(signal.SIGTERM)
    bench.wait(120)
    for pid in servers:
        for _ in range(600):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            os.kill(pid, signal.SIGKILL)
            raise AssertionError(f"the server {pid} outlived its bench")
