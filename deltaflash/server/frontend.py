"""Validated API requests -> engine inputs: chat template, tokenization, checks against the model.

The frontend owns its tokenizer instance (the engine worker detokenizes with the engine's) and the one
thread that uses it: handlers hand it their work through `run`, so templates and tokenization never
block the event loop and no tokenizer is shared between threads.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from deltaflash.core.request import SamplingParams
from deltaflash.errors import RequestError
from deltaflash.server.errors import BadRequest, ModelNotFound
from deltaflash.server.protocol import ApiRequest, DetokenizeRequest, Sampling, TokenizeRequest
from deltaflash.server.reasoning import REASONING_PARSERS, end_token, opens_reasoning
from deltaflash.server.tools import ToolRequest, detect_style, template_messages, tool_grammar
from deltaflash.speculative.grammar import grammar_text
from deltaflash.tokenizer import ChatOptions, DecodeOptions, decode, encode_chat, encode_prompt

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context
# Text longer than max_model_len * MAX_BYTES_PER_TOKEN bytes of UTF-8 is refused without tokenizing it.
# BPE tokens of prose, code and CJK text average 3-5 bytes, so text of more than 8 bytes per token of
# the context would not fit it anyway (bar pathological runs of long tokens); the bound also caps the
# text one request can make the tokenizer thread work through.
MAX_BYTES_PER_TOKEN = 8
REASONING_TAIL = 16  # a chat prompt's last tokens, decoded: does the template leave a think block open?


@dataclass(frozen=True)
class ModelCard:
    """The served model as clients see it (/v1/models) and as requests are checked against it."""

    name: str
    vocab_size: int
    max_model_len: int   # prompt + generated tokens of one request
    block_size: int      # speculative block W; 0 without a drafter
    created: int         # unix seconds


@dataclass(frozen=True)
class Prepared:
    """One API request as engine requests: the token ids of each prompt and one SamplingParams per choice.
    Choice i samples prompts[i // n] (OpenAI's order: each prompt's n samples together). `echo`: each
    prompt's text, which its choices' texts begin with (a completions request's echo), else None. `reasoning`:
    a chat answer's thinking is split off (server/reasoning.py) - True where the prompt leaves a think block
    open, False where the answer may open one - or None (not parsed)."""

    prompts: tuple[tuple[int, ...], ...]
    params: tuple[SamplingParams, ...]
    stop_strings: tuple[str, ...]
    decode: DecodeOptions
    echo: tuple[str, ...] | None = None
    reasoning: bool | None = None

    @property
    def n(self) -> int:
        return len(self.params) // len(self.prompts)

    def prompt_of(self, choice: int) -> tuple[int, ...]:
        return self.prompts[choice // self.n]


def sample_seed(seed: int | None, sample: int) -> int | None:
    """The seed of a prompt's sample `sample` (0 .. n-1) when the request gives `seed`: sample 0 uses the
    seed itself (n = 1 is unchanged), sample i > 0 the first 63 bits of BLAKE2b-64 of "{seed}:{i}", so
    each sample draws its own reproducible stream. No seed: None (each engine request draws a fresh one)."""
    if seed is None or sample == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{sample}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


class Frontend:
    def __init__(self, card: ModelCard, tokenizer, reasoning_parser: str | None = None):
        """reasoning_parser: "qwen3" splits chat answers' thinking from their content (server/reasoning.py)."""
        if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning parser {reasoning_parser!r}: one of {', '.join(REASONING_PARSERS)}")
        self.card, self.tokenizer, self.reasoning_parser = card, tokenizer, reasoning_parser
        self.reasoning_end = end_token(tokenizer) if reasoning_parser is not None else None  # `</think>`'s id
        self.tool_style = detect_style(getattr(tokenizer, "chat_template", None))  # how the model writes calls
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="deltaflash-frontend")

    async def run(self, work: Callable, *args):
        """`work(*args)` on the frontend's thread (parsing, templates, tokenization)."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, work, *args)

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)

    # ---- on the frontend thread ------------------------------------------------------------------
    def prepare(self, req: ApiRequest) -> Prepared:
        """A generation request's engine inputs, checked against the model (BadRequest naming the field). A
        chat request's tools go into the chat template; a tool_choice that forces calls becomes the grammar
        of calls in the checkpoint's style (server/tools.py)."""
        self._check_model(req.model)
        s = req.sampling
        grammar = tool_grammar(req.tools, self.tool_style) if req.tools is not None else None
        if grammar is not None:  # tool_choice forces calls; protocol.py refused a structured output beside it
            s = replace(s, grammar=grammar, grammar_param="tool_choice")
        self._check_sampling(s, req.echo)
        if req.chat:
            prompts = {"messages": self._prompt_ids(None, req.messages, "messages", req.text_bytes, req.chat_options,
                                                    tools=req.tools)}
        else:
            fields = ["prompt"] if len(req.prompts) == 1 else [f"prompt[{i}]" for i in range(len(req.prompts))]
            prompts = {field: self._prompt_ids(prompt, None, field, n_bytes)
                       for field, prompt, n_bytes in zip(fields, req.prompts, req.prompt_bytes)}
        reasoning = None
        if req.chat and self.reasoning_parser is not None:
            reasoning, s = self._reasoning(prompts["messages"], s)
        params = []
        for field, ids in prompts.items():
            base = self._params(s, field, len(ids), req.chat)
            params += [replace(base, seed=sample_seed(s.seed, i)) for i in range(req.n)]
        echo = None
        if req.echo:  # the prompt as given; token ids as text
            echo = tuple(p if isinstance(p, str) else decode(self.tokenizer, p, req.decode) for p in req.prompts)
        return Prepared(tuple(tuple(ids) for ids in prompts.values()), tuple(params), s.stop_strings, req.decode, echo,
                        reasoning)

    def _reasoning(self, prompt_ids: list[int], s: Sampling) -> tuple[bool | None, Sampling]:
        """(Prepared.reasoning: whether a chat answer to this prompt starts inside a think block; the sampling
        fields, a grammar in them moved past the thinking where it does: server/reasoning.py)."""
        tail = decode(self.tokenizer, prompt_ids[-REASONING_TAIL:], DecodeOptions(False, False))
        if not opens_reasoning(tail):
            return False, s
        if s.grammar is None:
            return True, s
        if self.reasoning_end is None:  # no `</think>` token to start it at: it holds from the first token
            return None, s
        return True, replace(s, grammar=replace(s.grammar, after=self.reasoning_end))

    def _check_sampling(self, s: Sampling, echo: bool = False) -> None:
        """The request's sampling fields against the model: token ids in the vocabulary, a tokenizer for
        what needs one, a grammar llguidance accepts."""
        vocab = self.card.vocab_size
        for field, ids in (("stop", s.stop_token_ids), ("logit_bias", [t for t, _ in s.logit_bias])):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise BadRequest(f"{field}: token id {bad[0]} is outside the vocabulary 0..{vocab - 1}", param=field)
        if self.tokenizer is None:
            for field, used in (("stop", s.stop_strings), ("logprobs", s.logprobs is not None),
                                (s.grammar_param, s.grammar is not None), ("echo", echo),
                                ("prompt_logprobs", s.prompt_logprobs is not None)):
                if used:
                    raise BadRequest(f"{field} needs the model's tokenizer and this model folder has none",
                                     param=field)
        if s.grammar is not None:
            try:
                grammar_text(s.grammar)
            except (RequestError, ValueError) as exc:  # llguidance raises ValueError on text it cannot read
                raise BadRequest(f"{s.grammar_param}: {exc}", param=s.grammar_param) from None

    def _params(self, s: Sampling, field: str, prompt_len: int, chat: bool) -> SamplingParams:
        """The engine's sampling parameters for one prompt (`field`) of `prompt_len` tokens."""
        room = self.card.max_model_len - prompt_len
        if room < (s.max_tokens != 0):  # (max_tokens 0, echo: the prompt scored alone may fill the context)
            raise BadRequest(f"{field} is {prompt_len} tokens; the context is {self.card.max_model_len} tokens "
                             "and must leave room for at least one generated token", param=field,
                             code="context_length_exceeded")
        max_tokens = s.max_tokens
        if max_tokens is None:
            max_tokens = room if chat else min(COMPLETION_DEFAULT_MAX_TOKENS, room)
        elif max_tokens > room:
            raise BadRequest(f"max_tokens ({max_tokens}) + {field} ({prompt_len} tokens) exceeds the context of "
                             f"{self.card.max_model_len} tokens; at most {room} tokens can be generated",
                             param="max_tokens", code="context_length_exceeded")
        if s.min_tokens > max_tokens:
            raise BadRequest(f"min_tokens ({s.min_tokens}) exceeds max_tokens ({max_tokens})", param="min_tokens")
        params = SamplingParams(
            max_new_tokens=max_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=s.seed,
            stop_token_ids=s.stop_token_ids, ignore_eos=s.ignore_eos, min_p=s.min_p,
            presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
            repetition_penalty=s.repetition_penalty, logit_bias=s.logit_bias, min_tokens=s.min_tokens,
            logprobs=s.logprobs, prompt_logprobs=s.prompt_logprobs, grammar=s.grammar, tree_budget=s.tree_budget)
        try:
            params.validate()
        except RequestError as exc:
            raise BadRequest(str(exc)) from None
        return params

    def tokenize(self, req: TokenizeRequest) -> list[int]:
        self._check_model(req.model)
        field = "prompt" if req.prompt is not None else "messages"
        return self._prompt_ids(req.prompt, req.messages, field, req.text_bytes, req.chat_options,
                                check_vocab=False, tools=req.tools)

    def detokenize(self, req: DetokenizeRequest) -> str:
        self._check_model(req.model)
        if self.tokenizer is None:
            raise BadRequest("this model folder has no tokenizer, so token ids cannot become text", param="tokens")
        bad = [t for t in req.tokens if not 0 <= t < self.card.vocab_size]
        if bad:
            raise BadRequest(f"token id {bad[0]} is outside the vocabulary 0..{self.card.vocab_size - 1}",
                             param="tokens")
        return decode(self.tokenizer, req.tokens, req.decode)

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.card.name:
            raise ModelNotFound(f"model {model!r} does not exist; this server serves {self.card.name!r}",
                                param="model")

    def _prompt_ids(self, prompt, messages, field: str, text_bytes: int, chat: ChatOptions = ChatOptions(),
                    check_vocab: bool = True, tools: ToolRequest | None = None) -> list[int]:
        """Token ids of a completion prompt (text or ids) or of chat messages (and the tools the template
        renders, as `chat` says); text too long for the context is refused before the tokenizer sees it."""
        limit = self.card.max_model_len * MAX_BYTES_PER_TOKEN
        if text_bytes > limit:
            raise BadRequest(f"{field} is {text_bytes} bytes of text; more than {limit} bytes ({MAX_BYTES_PER_TOKEN} "
                             f"per token of the {self.card.max_model_len}-token context) is refused without "
                             "tokenizing", param=field, code="context_length_exceeded")
        try:
            if messages is not None:
                ids = encode_chat(self.tokenizer, template_messages(messages),
                                  tools.template_tools() if tools is not None else None, chat)
            else:
                ids = list(prompt) if isinstance(prompt, tuple) else encode_prompt(self.tokenizer, prompt)
        except RequestError as exc:
            raise BadRequest(f"{field}: {exc}", param=field) from None
        except Exception as exc:
            if messages is None:  # the tokenizer failing on valid Unicode is a server bug (500)
                raise
            # text is valid Unicode (protocol.py checks): the template failed (jinja TemplateError, ...)
            raise BadRequest(f"{field}: the chat template failed: {exc}", param=field) from None
        if check_vocab and not ids:
            raise BadRequest(f"{field} tokenizes to no tokens", param=field)
        if check_vocab and len(ids) <= self.card.max_model_len:  # longer ones fail the context check
            bad = [t for t in ids if not 0 <= t < self.card.vocab_size]
            if bad:
                raise BadRequest(f"prompt token id {bad[0]} is outside the vocabulary 0..{self.card.vocab_size - 1}",
                                 param=field)
        return ids
