"""The HTTP layer: FastAPI routes. Handlers hand the body to the frontend's thread (parse, template,
tokenize), submit a job to the worker and relay its outputs; they never touch the engine. Besides the
OpenAI routes: /health (GET, HEAD), /metrics, and vLLM's /tokenize and /detokenize.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import time
import uuid
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from deltaflash.server.errors import (
    ApiError, BadRequest, ModelNotFound, NotFound, PayloadTooLarge, QueueFull, ServerFailure, ServerUnavailable,
    Unauthorized,
)
from deltaflash.server.frontend import Frontend, Prepared
from deltaflash.server.metrics import Metrics
from deltaflash.server.protocol import (
    ApiRequest, parse_chat, parse_completion, parse_detokenize, parse_json, parse_tokenize,
)
from deltaflash.server.relay import collect, stream
from deltaflash.server.responses import Formatter
from deltaflash.server.worker import EngineWorker, Job, Output

log = logging.getLogger("deltaflash.server")


@dataclass(frozen=True)
class ServerSettings:
    api_key: str | None = None         # when set, /v1/*, /tokenize and /detokenize need "Authorization: Bearer <key>"
    max_body_bytes: int = 32 << 20
    strict_fields: bool = False        # unknown request fields: a 400 instead of a logged warning


def build_app(frontend: Frontend, worker: EngineWorker, metrics: Metrics, settings: ServerSettings,
              on_ready: Callable[[], None] | None = None) -> FastAPI:
    card = frontend.card

    @asynccontextmanager
    async def lifespan(app):
        worker.start()
        if on_ready is not None:
            on_ready()
        yield
        await asyncio.to_thread(worker.close)
        frontend.close()

    app = FastAPI(title="deltaflash", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        outcome = {Unauthorized: "unauthorized", QueueFull: "queue_full", ServerUnavailable: "unavailable"}
        metrics.requests.labels(outcome=outcome.get(type(exc), "invalid")).inc()
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        err = NotFound(f"no route {request.method} {request.url.path}") if exc.status_code == 404 else \
            ApiError(f"{request.method} {request.url.path}: {exc.detail}", code=f"http_{exc.status_code}")
        return JSONResponse(err.body(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):
        return JSONResponse(ServerFailure(f"internal error: {type(exc).__name__}: {exc}").body(), status_code=500)

    def authorize(request: Request) -> None:
        if settings.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Unauthorized("missing API key: send the header 'Authorization: Bearer <key>'")
        if not hmac.compare_digest(token.strip().encode(), settings.api_key.encode()):
            raise Unauthorized("incorrect API key in the Authorization header")

    warned: set[str] = set()  # unknown field names already logged

    async def read(request: Request, parse: Callable, prepare: Callable):
        """(request, prepare(request)): the body parsed by `parse` and prepared, on the frontend's thread."""
        authorize(request)
        raw = await _read_body(request, settings.max_body_bytes)

        def work():
            req = parse(parse_json(raw), settings.strict_fields)
            return req, prepare(req)

        req, prepared = await frontend.run(work)
        for name in set(req.ignored_fields) - warned:
            warned.add(name)
            log.warning("ignoring the unknown request field %r (logged once; --strict-fields rejects it)", name)
        return req, prepared

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health(request: Request):
        load = worker.load
        status = "ok" if load.alive and not load.draining else ("draining" if load.alive else "failed")
        body = {"status": status, "active_slots": load.active_slots, "queued": load.queued,
                "max_slots": load.max_slots}
        code, headers = (200, None) if status == "ok" else (503, {"Retry-After": str(ServerUnavailable.retry_after)})
        if request.method == "HEAD":
            return Response(status_code=code, headers=headers, media_type="application/json")
        return JSONResponse(body, status_code=code, headers=headers)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def model_entry() -> dict:
        return {"id": card.name, "object": "model", "created": card.created, "owned_by": "deltaflash",
                "max_model_len": card.max_model_len, "vocab_size": card.vocab_size}

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        return {"object": "list", "data": [model_entry()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request):
        authorize(request)
        if model_id != card.name:
            raise ModelNotFound(f"model {model_id!r} does not exist; this server serves {card.name!r}", param="model")
        return model_entry()

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        _, ids = await read(request, parse_tokenize, frontend.tokenize)
        return {"tokens": ids, "count": len(ids), "max_model_len": card.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        _, text = await read(request, parse_detokenize, frontend.detokenize)
        return {"prompt": text}

    async def generate(request: Request, chat: bool):
        """One engine job per choice (`{request id}-{choice index}`), submitted together."""
        req: ApiRequest
        prep: Prepared
        req, prep = await read(request, parse_chat if chat else parse_completion, frontend.prepare)
        if len(prep.params) > worker.capacity:
            raise BadRequest(f"{len(prep.params)} choices (n x prompts) exceed the {worker.capacity} requests this "
                             "server holds at once (--max-concurrency + --max-queue)", param="n")
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        outputs: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def sink(index: int) -> Callable[[Output], None]:
            return lambda out: loop.call_soon_threadsafe(outputs.put_nowait, (index, out))

        jobs = [Job(f"{request_id}-{i}", prep.prompt_of(i), params, prep.stop_strings, sink(i), prep.decode)
                for i, params in enumerate(prep.params)]
        worker.submit(*jobs)
        fmt = Formatter(chat, request_id, card.name, int(time.time()), req.return_token_ids,
                        logprobs=req.sampling.logprobs is not None, top_logprobs=req.sampling.logprobs or 0,
                        prompt_logprobs=req.prompt_logprobs, include_reasoning=req.include_reasoning)
        cancel = functools.partial(worker.cancel, *(job.request_id for job in jobs))
        if req.stream:
            events = stream(outputs, fmt, len(jobs), sum(map(len, prep.prompts)), req.include_usage, cancel,
                            req.tools, prep.echo, prep.n, prep.reasoning)
            return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await collect(outputs, fmt, prep.prompts, prep.n, request.receive, cancel, req.tools, prep.echo,
                             prep.reasoning)

    return app


async def _read_body(request: Request, limit: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body exceeds {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)
