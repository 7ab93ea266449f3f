"""`deltaflash bench serve`: a bounded load test of the HTTP server on loopback.

C concurrent streaming clients send R greedy completions (random token-id prompts drawn from a small
set); a fraction disconnect at a random point. Reports requests/s, time to first token and
inter-token latency percentiles and errors, and checks every completed output against the same
prompt served alone, and (CUDA) how long the device waited for the host during the load (the server's
deltaflash_device_idle_seconds). Starts its own `deltaflash serve` on 127.0.0.1 unless --url is given.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from deltaflash.bench.common import machine, print_table, write_json
from deltaflash.bench.e2e_stats import latency_summary
from deltaflash.engine.args import add_engine_args, add_scheduler_args, given_flags


@dataclass
class Trace:
    """One load request as the client saw it. Times are seconds from its send."""

    prompt_index: int
    leave_after: int | None           # tokens after which the client disconnects (None: stays)
    status: int = 0
    token_ids: list[int] = field(default_factory=list)
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    done: bool = False                # saw [DONE]
    error: str | None = None


def register(sub) -> None:
    p = sub.add_parser("serve", help="load test of `deltaflash serve`: concurrent streaming clients on loopback")
    add_engine_args(p)
    add_scheduler_args(p)
    p.add_argument("--url", default=None, help="an already running server (default: start one on 127.0.0.1)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--max-concurrency", type=int, default=8, help="slots of the server this bench starts")
    p.add_argument("--clients", type=int, default=64, help="concurrent streaming clients")
    p.add_argument("--requests", type=int, default=256, help="requests in total (the bound of the run)")
    p.add_argument("--disconnect-fraction", type=float, default=0.2)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt-len", type=int, nargs=2, default=(8, 64), metavar=("MIN", "MAX"))
    p.add_argument("--distinct-prompts", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600, help="seconds for the whole run")
    p.add_argument("--no-host-overlap", action="store_true",
                   help="the started server routes tokens after each step, not during the next (before / after)")
    p.add_argument("--json", default=None, help="write results here")
    p.set_defaults(func=run)


def run(args) -> int:
    # a SIGTERM (`timeout`, a job runner) unwinds like Ctrl-C, so the server this bench started is stopped
    # too instead of living on, still holding the GPU
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    server = None if args.url else _start_server(args)
    try:
        url = args.url or server[0]
        result = asyncio.run(asyncio.wait_for(_bench(args, url), args.timeout))
    finally:
        if server is not None:
            _stop_server(*server[1:])
    result["machine"] = machine()
    row = {k: result[k] for k in ("requests", "completed", "disconnected", "errors", "mismatches", "requests_per_s",
                                  "output_tokens_per_s", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "itl_p50_ms",
                                  "itl_p90_ms", "itl_p99_ms", "gap_p99_ms", "device_idle_share",
                                  "device_idle_per_step_us")}
    print_table(f"deltaflash serve: {args.clients} streaming clients, {args.disconnect_fraction:.0%} disconnecting", [row])
    for problem in result["problems"][:10]:
        print("  problem:", problem)
    write_json(args.json, result)
    ok = result["errors"] == 0 and result["mismatches"] == 0 and result["idle_after"]
    return 0 if ok else 1


async def _bench(args, url: str) -> dict:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.clients + 4, max_keepalive_connections=args.clients + 4)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=args.timeout, limits=limits) as http:
        card = (await http.get("/v1/models")).raise_for_status().json()["data"][0]
        rng = random.Random(args.seed)
        vocab = min(card["vocab_size"], 256)
        prompts = [[rng.randrange(vocab) for _ in range(rng.randint(*args.prompt_len))]
                   for _ in range(args.distinct_prompts)]
        body = {"model": card["id"], "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        solo = []  # each prompt alone on the server
        for prompt in prompts:
            r = (await http.post("/v1/completions", json=body | {"prompt": prompt})).raise_for_status()
            solo.append(r.json()["choices"][0]["token_ids"])

        n_leave = round(args.disconnect_fraction * args.requests)
        leaving = set(rng.sample(range(args.requests), n_leave))
        traces = [Trace(rng.randrange(len(prompts)), rng.randint(1, max(args.max_tokens - 1, 1)) if i in leaving else None)
                  for i in range(args.requests)]
        pending = iter(traces)

        async def client():
            for trace in pending:
                await _stream(http, body | {"prompt": prompts[trace.prompt_index], "stream": True}, trace)

        before = scrape((await http.get("/metrics")).text)
        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(args.clients)))
        wall = time.perf_counter() - t0
        idle = await _wait_idle(http)
        after = scrape((await http.get("/metrics")).text)
    return _summarize(traces, solo, wall, idle, args) | device_idle(before, after, wall)


METRICS = {"accepted_sum": r"^deltaflash_accepted_length_sum (\S+)",
           "accepted_count": r"^deltaflash_accepted_length_count (\S+)",
           "phase_prefill": r'^deltaflash_round_phase_seconds_sum\{phase="prefill"\} (\S+)',
           "phase_decode": r'^deltaflash_round_phase_seconds_sum\{phase="decode"\} (\S+)',
           "idle_sum": r"^deltaflash_device_idle_seconds_sum (\S+)",
           "idle_count": r"^deltaflash_device_idle_seconds_count (\S+)"}


def scrape(text: str) -> dict:
    """The server metrics the benches read (METRICS) from a Prometheus text page (absent ones left out)."""
    found = {}
    for key, pattern in METRICS.items():
        m = re.search(pattern, text, re.MULTILINE)
        if m:
            found[key] = float(m.group(1))
    return found


def device_idle(before: dict, after: dict, wall: float) -> dict:
    """How long the device waited for the host between `before` and `after` (two scrapes), in all, as a
    share of `wall` seconds and per step; None where the server measured nothing (not on CUDA)."""
    waited = after.get("idle_sum", 0.0) - before.get("idle_sum", 0.0)
    steps = after.get("idle_count", 0.0) - before.get("idle_count", 0.0)
    return {"device_idle_s": waited if steps else None, "device_idle_share": waited / wall if steps else None,
            "device_idle_per_step_us": waited / steps * 1e6 if steps else None}


async def _stream(http, body: dict, trace: Trace) -> None:
    t0 = time.perf_counter()
    try:
        async with http.stream("POST", "/v1/completions", json=body) as r:
            trace.status = r.status_code
            if r.status_code != 200:
                trace.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    trace.done = True
                    break
                choice = json.loads(line[6:])["choices"][0]
                if choice["token_ids"]:
                    trace.chunk_times.append(time.perf_counter() - t0)
                    trace.chunk_tokens.append(len(choice["token_ids"]))
                    trace.token_ids += choice["token_ids"]
                trace.finish_reason = choice["finish_reason"] or trace.finish_reason
                if trace.leave_after is not None and len(trace.token_ids) >= trace.leave_after:
                    return  # leaving the block drops the connection mid-stream
    except Exception as exc:  # noqa: BLE001 (every failure is counted and reported)
        trace.error = f"{type(exc).__name__}: {exc}"


async def _wait_idle(http, timeout_s: float = 30) -> bool:
    """After the load: every slot comes back (disconnected clients were retired)."""
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline:
        h = (await http.get("/health")).json()
        if h["active_slots"] == 0 and h["queued"] == 0:
            return True
        await asyncio.sleep(0.05)
    return False


def _summarize(traces: list[Trace], solo: list[list[int]], wall: float, idle: bool, args) -> dict:
    problems = []
    completed = [t for t in traces if t.leave_after is None]
    for i, t in enumerate(traces):
        if t.error is not None:
            problems.append(f"request {i}: {t.error}")
        elif t.leave_after is None and not (t.done and t.finish_reason == "length"):
            problems.append(f"request {i}: stream ended without [DONE] or finish_reason length ({t.finish_reason})")
    errors = len(problems)
    mismatches = [i for i, t in enumerate(traces)
                  if t.leave_after is None and t.error is None and t.token_ids != solo[t.prompt_index]]
    problems += [f"request {i}: output differs from its solo output" for i in mismatches]
    if not idle:
        problems.append("slots still live 30 s after the load ended")
    tokens = sum(len(t.token_ids) for t in traces)
    out = {"requests": len(traces), "completed": len(completed), "disconnected": len(traces) - len(completed),
           "errors": errors, "mismatches": len(mismatches), "idle_after": idle, "wall_s": wall,
           "requests_per_s": len(traces) / wall, "output_tokens_per_s": tokens / wall,
           "clients": args.clients, "max_tokens": args.max_tokens, "problems": problems}
    # chunk times are from each request's send: TTFT, inter-token latency and stream gaps as bench e2e's
    return out | latency_summary([(t.chunk_times[0], t.chunk_times[-1], list(zip(t.chunk_times, t.chunk_tokens)),
                                   len(t.token_ids)) for t in traces if t.chunk_times])


def server_command(args) -> list[str]:
    """The `deltaflash serve` command this bench starts: every engine and scheduler flag it was given."""
    return [sys.executable, "-m", "deltaflash", "serve", "--host", "127.0.0.1", "--port", "0",
            "--max-concurrency", str(args.max_concurrency), "--max-queue", str(args.clients),
            *given_flags(args, add_engine_args), *given_flags(args, add_scheduler_args),
            *(["--api-key", args.api_key] if args.api_key else []),
            *(["--no-host-overlap"] if args.no_host_overlap else [])]


def _start_server(args):
    """`deltaflash serve` on 127.0.0.1, any free port; returns (url, process, log file)."""
    cmd = server_command(args)
    log = tempfile.NamedTemporaryFile("w+", prefix="deltaflash-bench-serve-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    try:
        while time.monotonic() < deadline:
            match = re.search(r"on (http://127\.0\.0\.1:\d+) ", Path(log.name).read_text())
            if match:
                return match.group(1), proc, log
            if proc.poll() is not None:
                break
            time.sleep(0.1)
    except BaseException:  # interrupted while the server starts: it must not outlive this process
        _stop_server(proc, log)
        raise
    text = Path(log.name).read_text()  # before _stop_server removes the file
    _stop_server(proc, log)
    raise RuntimeError(f"the server did not start; its log:\n{text}")


def _stop_server(proc, log) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    log.close()
    Path(log.name).unlink(missing_ok=True)

