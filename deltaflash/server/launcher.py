"""Building the server from `deltaflash serve` flags and running it under uvicorn until a signal."""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import uvicorn

from deltaflash.engine.args import engine_from_args, scheduler_config
from deltaflash.engine.engine import Engine
from deltaflash.errors import DeltaflashError
from deltaflash.server.app import ServerSettings, build_app
from deltaflash.server.frontend import Frontend, ModelCard
from deltaflash.server.metrics import Metrics
from deltaflash.server.worker import EngineWorker, WorkerConfig
from deltaflash.tokenizer import load_tokenizer


def serve(args) -> int:
    """`deltaflash serve` with flags `cli.check_flags` accepted: listen first (a busy port fails before
    the weights load), then build the engine, then answer."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    t0 = time.perf_counter()
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as exc:
        raise DeltaflashError(f"--host {args.host} --port {args.port}: cannot listen there ({exc})") from None
    port = sock.getsockname()[1]
    if args.tensor_parallel_size > 1:
        import torch

        from deltaflash.parallel.launch import MirroredEngine, ranks

        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        with ranks(args.tensor_parallel_size, device.type, _follow, args) as tp:
            engine = MirroredEngine(build_engine(args, tp), tp)
            try:
                return _serve(args, sock, port, engine, t0)
            finally:
                engine.close()
    return _serve(args, sock, port, build_engine(args), t0)


def _follow(tensor_parallel, args) -> None:
    """A follower rank of a tensor-parallel server: its engine, stepped as rank 0's (MirroredEngine) says."""
    from deltaflash.parallel.launch import follow

    follow(build_engine(args, tensor_parallel), tensor_parallel)


def _serve(args, sock, port: int, engine, t0: float) -> int:
    """Answer on `sock` with `engine` (loaded, compiled, captured) until a signal."""
    block = engine.config.block_size if engine.config.speculative else 0
    card = ModelCard(args.served_model_name or Path(args.model).resolve().name, engine.cfg.vocab_size,
                     engine.config.max_model_len, block, int(time.time()))
    metrics = Metrics(block)
    worker = EngineWorker(engine, WorkerConfig(max_queue=args.max_queue, request_timeout_s=args.request_timeout,
                                                overlap_host=not args.no_host_overlap),
                          metrics)
    started_s = time.perf_counter() - t0

    def ready() -> None:
        print(f"deltaflash serve: model {card.name!r} on http://{args.host}:{port} "
              f"({engine.config.max_slots} slots, queue {args.max_queue}); started in {started_s:.1f} s "
              f"(of which {engine.startup_s:.1f} s compiling kernels and capturing CUDA graphs); "
              f"{engine.runner.page_plan.describe(engine.config.max_model_len, engine.config.block_size)}",
              file=sys.stderr, flush=True)

    app = build_app(Frontend(card, load_tokenizer(args.model), args.reasoning_parser), worker, metrics,
                    ServerSettings(api_key=args.api_key, strict_fields=args.strict_fields), on_ready=ready)
    config = uvicorn.Config(app, log_level=args.log_level, access_log=args.log_level in ("debug", "info"),
                            timeout_graceful_shutdown=args.shutdown_timeout + 5, lifespan="on")
    DrainingServer(config, worker, args.shutdown_timeout).run(sockets=[sock])
    print("deltaflash serve: stopped", file=sys.stderr, flush=True)
    return 0


def build_engine(args, tensor_parallel=None) -> Engine:
    return engine_from_args(args, max_slots=args.max_concurrency,
                            progress=tensor_parallel is None or tensor_parallel.rank == 0,
                            tensor_parallel=tensor_parallel, **scheduler_config(args))


class DrainingServer(uvicorn.Server):
    """uvicorn where SIGTERM/SIGINT first drain the worker (stop admitting; in-flight requests finish,
    or at the deadline are answered with a 503 "server_shutdown" error, so every client gets an answer)
    and the process then exits 0 instead of re-raising the signal."""

    def __init__(self, config: uvicorn.Config, worker: EngineWorker, deadline_s: float):
        super().__init__(config)
        self.worker, self.deadline_s = worker, deadline_s

    def handle_exit(self, sig, frame) -> None:
        self.worker.drain(self.deadline_s)
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
