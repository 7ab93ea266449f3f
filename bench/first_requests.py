"""Start-up and first requests of `deltaflash serve`: nothing may compile or capture inside a request.

Usage: python bench/first_requests.py [--requests 10] [--max-tokens 64] [--out FILE] [-- SERVE FLAGS...]

Starts `deltaflash serve` on a free loopback port (the bundled demo pair unless SERVE FLAGS say
otherwise), times it until it reports ready, then sends the same greedy completion `--requests` times,
one after another, and prints each latency and the first / last ratio (the issue's bar: within 2x).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx


def main() -> int:
    argv = sys.argv[1:]
    serve_flags = argv[argv.index("--") + 1:] if "--" in argv else []
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=10)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--timeout", type=float, default=600, help="seconds to wait for the server to be ready")
    p.add_argument("--out", default=None, help="write the figures here as JSON")
    args = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)

    log = tempfile.NamedTemporaryFile("w+", prefix="deltaflash-first-requests-", suffix=".log", delete=False)
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "deltaflash", "serve", "--host", "127.0.0.1", "--port", "0",
                             *serve_flags], stdout=log, stderr=subprocess.STDOUT)
    try:
        url, ready_s = None, None
        while time.perf_counter() - t0 < args.timeout and proc.poll() is None:
            match = re.search(r"on (http://127\.0\.0\.1:\d+) .*started in ([0-9.]+) s \(of which ([0-9.]+) s",
                              Path(log.name).read_text())
            if match:
                url, ready_s = match.group(1), time.perf_counter() - t0
                reported, capture = float(match.group(2)), float(match.group(3))
                break
            time.sleep(0.05)
        if url is None:
            print(Path(log.name).read_text()[-4000:], file=sys.stderr)
            return 1
        while httpx.get(url + "/health", timeout=5).status_code != 200:
            time.sleep(0.05)
        body = {"prompt": "def fibonacci(n):\n    ", "max_tokens": args.max_tokens, "temperature": 0,
                "ignore_eos": True}
        latencies, tokens = [], None
        for _ in range(args.requests):
            t = time.perf_counter()
            reply = httpx.post(url + "/v1/completions", json=body, timeout=120)
            latencies.append((time.perf_counter() - t) * 1e3)
            reply.raise_for_status()
            usage = reply.json()["usage"]["completion_tokens"]
            assert tokens in (None, usage), "the same greedy request gave another length"
            tokens = usage
    finally:
        proc.terminate()
        proc.wait(60)
    result = {"ready_s_wall": ready_s, "started_s_reported": reported, "compile_and_capture_s": capture,
              "completion_tokens": tokens, "latencies_ms": latencies, "first_over_last": latencies[0] / latencies[-1],
              "serve_flags": serve_flags}
    print(f"ready after {ready_s:.1f} s (server reports {reported:.1f} s, of which {capture:.1f} s compiling kernels "
          f"and capturing CUDA graphs)")
    print("request latencies (ms): " + ", ".join(f"{x:.1f}" for x in latencies))
    print(f"first / last = {result['first_over_last']:.2f} ({tokens} tokens each)")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
