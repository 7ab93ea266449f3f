"""`deltaflash serve`: the OpenAI-compatible server (FastAPI + uvicorn, one engine worker thread)."""

from __future__ import annotations

import os

from deltaflash.engine.args import add_engine_args, add_scheduler_args, check_engine_flags, check_scheduler_flags
from deltaflash.errors import DeltaflashError


def register(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    add_engine_args(p)
    p.add_argument("--max-concurrency", type=int, default=8, help="slots: sequences served together")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests admitted beyond the slots to wait for one; more get HTTP 429")
    add_scheduler_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0: any free port (the chosen one is printed)")
    p.add_argument("--api-key", default=os.environ.get("DELTAFLASH_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $DELTAFLASH_API_KEY)")
    p.add_argument("--served-model-name", default=None, help="model id clients use (default: the model folder's name)")
    p.add_argument("--request-timeout", type=float, default=0.0,
                   help="seconds; a request running longer is cancelled (0: no limit)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM/SIGINT; then they are answered "
                        "with HTTP 503 (code server_shutdown)")
    p.add_argument("--reasoning-parser", choices=["qwen3"], default=None,
                   help="chat answers' thinking (<think> ... </think>, Qwen3 / Qwen3.5) apart from their content: "
                        "message.reasoning (and reasoning_content), streamed as delta.reasoning (default: off, "
                        "the thinking is content)")
    p.add_argument("--strict-fields", action="store_true",
                   help="reject request fields deltaflash does not know with HTTP 400 (default: ignore them, "
                        "logging each name once)")
    p.add_argument("--no-host-overlap", action="store_true",
                   help="route each step's tokens to the clients after the step instead of while the device runs "
                        "the next one (for measuring what the overlap saves: deltaflash_device_idle_seconds)")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=cmd_serve)


def cmd_serve(args) -> int:
    check_flags(args)  # before the heavy imports, the port and the weights
    from deltaflash.server.launcher import serve

    return serve(args)


def check_flags(args) -> None:
    """The numeric flags' ranges (the engine's flags that need files are checked before loading, in
    engine/args.py)."""
    check_engine_flags(args)
    check_scheduler_flags(args)
    for name, value, low, high in (("--max-concurrency", args.max_concurrency, 1, None),
                                   ("--max-queue", args.max_queue, 0, None),
                                   ("--request-timeout", args.request_timeout, 0, None),
                                   ("--shutdown-timeout", args.shutdown_timeout, 0, None),
                                   ("--port", args.port, 0, 65535)):
        if value < low or (high is not None and value > high):
            span = f"in [{low}, {high}]" if high is not None else f">= {low}"
            raise DeltaflashError(f"{name} must be {span}, got {value}")
