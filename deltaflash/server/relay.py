"""Relaying a job's outputs to its client: SSE chunks or one JSON body. A client that goes away
(or a handler that is cancelled) cancels its job, which the engine worker retires at the next round."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from fastapi.responses import JSONResponse, Response

from deltaflash.server.errors import ServerFailure
from deltaflash.server.responses import DONE, Formatter, sse
from deltaflash.server.worker import Output

CLIENT_CLOSED = 499  # nginx's status for "client closed the request"; nobody reads it


async def stream(outputs: asyncio.Queue, fmt: Formatter, include_usage: bool,
                 cancel: Callable[[], None]) -> AsyncIterator[bytes]:
    """SSE events. Starlette cancels this generator when the client disconnects."""
    finished = False
    try:
        if fmt.chat:
            yield sse(fmt.role_chunk(include_usage))
        while True:
            out: Output = await outputs.get()
            if out.error is not None:
                finished = True
                yield sse(ServerFailure(out.error).body())
                break
            if out.text or out.finish_reason or (fmt.return_token_ids and out.token_ids):
                yield sse(fmt.chunk(out.text, out.token_ids, out.finish_reason, include_usage))
            if out.finish_reason is not None:
                finished = True
                if include_usage:
                    yield sse(fmt.usage_chunk(out.prompt_tokens, out.completion_tokens))
                break
        yield DONE
    finally:
        if not finished:
            cancel()


async def collect(outputs: asyncio.Queue, fmt: Formatter, prompt_ids: tuple[int, ...], receive,
                  cancel: Callable[[], None]) -> Response:
    """Wait for the whole result, watching the connection: a client gone before it cancels the job."""
    text, token_ids, finished = [], [], False
    gone = asyncio.ensure_future(_disconnected(receive))
    try:
        while True:
            getter = asyncio.ensure_future(outputs.get())
            await asyncio.wait({getter, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
                return Response(status_code=CLIENT_CLOSED)
            out: Output = getter.result()
            if out.error is not None:
                finished = True
                raise ServerFailure(out.error)
            text.append(out.text)
            token_ids.extend(out.token_ids)
            if out.finish_reason is not None:
                finished = True
                return JSONResponse(fmt.body("".join(text), token_ids, out.finish_reason, prompt_ids,
                                             out.completion_tokens))
    finally:
        gone.cancel()
        if not finished:
            cancel()


async def _disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
