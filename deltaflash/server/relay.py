"""Relaying a request's outputs to its client: SSE chunks or one JSON body. A request has one engine job
per choice; the outputs of all of them arrive on one queue as (choice index, Output). A client that
goes away (or a handler that is cancelled) cancels every job, which the engine worker retires at the
next round. A job that ends in an error (a server failure, a shutdown) ends a stream with an SSE error
event and [DONE], or answers with the error's status; the request's other jobs are cancelled. A chat
request with tools runs each choice's text through a tool-call parser: content and `tool_calls`; with a
reasoning parser, the thinking is split off first (server/reasoning.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from fastapi.responses import JSONResponse, Response

from deltaflash.server.reasoning import ReasoningParser
from deltaflash.server.responses import DONE, Choice, Formatter, sse
from deltaflash.server.textstream import TextLogprob
from deltaflash.server.tools import CallDelta, TextDelta, ToolCallParser, ToolRequest, finish_reason
from deltaflash.server.worker import Output

CLIENT_CLOSED = 499  # nginx's status for "client closed the request"; nobody reads it


@dataclass
class _Progress:
    """One choice's outputs so far. `thinking`: the reasoning parser of a chat choice whose thinking is split
    off (`reasoning`), the rest going on as its text; `parser`: the tool-call parser of a chat choice with
    tools, which turns its text into `content` and `calls`; without one the content is the text. Logprobs and
    token ids are the tokens', as they come, whether the parsers have decided their text yet or not."""

    parser: ToolCallParser | None = None
    echo: str | None = None       # the prompt's text, which the first output's text follows (completions' echo)
    thinking: ReasoningParser | None = None
    shows_reasoning: bool = True  # False (include_reasoning): the thinking is split off and dropped
    reasoning: list[str] = field(default_factory=list)
    content: list[str] = field(default_factory=list)
    calls: list[CallDelta] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TextLogprob] = field(default_factory=list)
    prompt_logprobs: tuple[TextLogprob, ...] = ()  # its prompt's, when scored
    text_offset: int = 0          # summed length of the token texts of its logprobs so far
    completion_tokens: int = 0
    cached_tokens: int = 0  # its prompt's tokens the engine did not prefill for it
    finish_reason: str | None = None  # "tool_calls" when it stopped after a call

    def add(self, out: Output) -> tuple[str, list[CallDelta], tuple[TextLogprob, ...], str]:
        """Take `out`; returns the content, the calls, the logprobs (an echo's first: the prompt's too) and the
        reasoning it adds."""
        text, calls, logprobs, reasoning = out.text, [], out.logprobs or (), ""
        self.prompt_logprobs = out.prompt_logprobs or self.prompt_logprobs
        if self.echo is not None:
            text, logprobs, self.echo = self.echo + text, (*(out.prompt_logprobs or ()), *logprobs), None
        if self.thinking is not None:
            reasoning, text = self.thinking.feed(text)
            if out.finish_reason:
                held = self.thinking.finish()
                reasoning, text = reasoning + held[0], text + held[1]
            reasoning = reasoning if self.shows_reasoning else ""
            self.reasoning.append(reasoning)
        if self.parser is not None:
            pieces = self.parser.feed(text) + (self.parser.finish() if out.finish_reason else [])
            text = "".join(p.text for p in pieces if isinstance(p, TextDelta))
            calls = [p for p in pieces if isinstance(p, CallDelta)]
        self.content.append(text)
        self.calls.extend(calls)
        self.token_ids.extend(out.token_ids)
        self.logprobs.extend(logprobs)
        self.text_offset += sum(len(e.token) for e in logprobs)
        self.completion_tokens = out.completion_tokens
        self.cached_tokens = max(self.cached_tokens, out.cached_tokens)
        self.finish_reason = out.finish_reason and finish_reason(out.finish_reason, len(self.calls))
        return text, calls, logprobs, reasoning

    def choice(self, index: int, prompt_ids: tuple[int, ...]) -> Choice:
        content = "".join(self.content)
        return Choice(index, None if self.calls and not content else content, tuple(self.token_ids),
                      tuple(self.logprobs), self.finish_reason, prompt_ids, tuple(c.message() for c in self.calls),
                      self.prompt_logprobs,
                      "".join(self.reasoning) if self.thinking is not None and self.shows_reasoning else None)


def _cached(progress: list[_Progress], n: int) -> int:
    """The request's cached prompt tokens: each prompt's (counted once, as usage counts prompt tokens) those its
    choices all had: where its n choices forked from one of them, that one's."""
    return sum(min(p.cached_tokens for p in progress[i:i + n]) for i in range(0, len(progress), n))


def _progress(choices: int, fmt: Formatter, tools: ToolRequest | None, echo: tuple[str, ...] | None, n: int,
              reasoning: bool | None = None) -> list[_Progress]:
    """Choice i continues prompt i // n (echo: those prompts' texts; reasoning: Prepared.reasoning, the thinking
    kept as fmt.include_reasoning says)."""
    return [_Progress(ToolCallParser(tools) if tools is not None else None, None if echo is None else echo[i // n],
                      None if reasoning is None else ReasoningParser(reasoning), fmt.include_reasoning)
            for i in range(choices)]


async def stream(outputs: asyncio.Queue, fmt: Formatter, choices: int, prompt_tokens: int, include_usage: bool,
                 cancel: Callable[[], None], tools: ToolRequest | None = None, echo: tuple[str, ...] | None = None,
                 n: int = 1, reasoning: bool | None = None) -> AsyncIterator[bytes]:
    """SSE events: chunks of the choices interleaved as they come, each with its index, a finish chunk
    per choice, then (include_usage) one usage chunk and [DONE]. Starlette cancels this generator when
    the client disconnects. `prompt_tokens`: those of every prompt, each counted once. `tools`: a chat
    request's, whose calls stream as `delta.tool_calls`. `echo`: the prompts' texts (choice i continues
    prompt i // n), each choice's first chunk begins with its prompt's (and its logprobs). `reasoning`:
    Prepared.reasoning (the thinking streams as delta.reasoning)."""
    progress = _progress(choices, fmt, tools, echo, n, reasoning)
    finished = 0
    try:
        if fmt.chat:
            for index in range(choices):
                yield sse(fmt.role_chunk(index, include_usage))
        while finished < choices:
            index, out = await outputs.get()
            if out.error is not None:
                yield sse(out.error.body())
                break
            offset = progress[index].text_offset
            text, calls, logprobs, thought = progress[index].add(out)
            if text or calls or out.finish_reason or logprobs or thought or (fmt.return_token_ids and out.token_ids):
                yield sse(fmt.chunk(index, text, out.token_ids, logprobs, progress[index].finish_reason, offset,
                                    include_usage, [c.openai() for c in calls], thought))
            if out.finish_reason is not None:
                finished += 1
        if finished == choices and include_usage:
            yield sse(fmt.usage_chunk(prompt_tokens, sum(p.completion_tokens for p in progress), _cached(progress, n)))
        yield DONE
    finally:
        if finished < choices:
            cancel()


async def collect(outputs: asyncio.Queue, fmt: Formatter, prompts: tuple[tuple[int, ...], ...], n: int, receive,
                  cancel: Callable[[], None], tools: ToolRequest | None = None,
                  echo: tuple[str, ...] | None = None, reasoning: bool | None = None) -> Response:
    """Wait for every choice (choice i continues prompts[i // n]), watching the connection: a client
    gone before the end cancels the jobs. `tools`: a chat request's, whose calls become `tool_calls`.
    `echo`: the prompts' texts, which the choices' texts begin with. `reasoning`: Prepared.reasoning (the
    thinking becomes message.reasoning)."""
    progress = _progress(len(prompts) * n, fmt, tools, echo, n, reasoning)
    finished = 0
    gone = asyncio.ensure_future(_disconnected(receive))
    try:
        while finished < len(progress):
            getter = asyncio.ensure_future(outputs.get())
            await asyncio.wait({getter, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
                return Response(status_code=CLIENT_CLOSED)
            index, out = getter.result()
            if out.error is not None:
                return out.error.response()
            progress[index].add(out)
            if out.finish_reason is not None:
                finished += 1
        choices = [p.choice(i, prompts[i // n]) for i, p in enumerate(progress)]
        return JSONResponse(fmt.body(choices, sum(len(p) for p in prompts),
                                     sum(p.completion_tokens for p in progress), _cached(progress, n)))
    finally:
        gone.cancel()
        if finished < len(progress):
            cancel()


async def _disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
