"""Incremental detokenization of one request's output, cut at the first stop string; and the text of
single tokens, which logprobs name tokens by.

Text advances over a window of token ids [prefix, ...): the window's first tokens give the decoder
its left context (leading spaces), and the read offset only moves when the newest text ends on a
complete character, so the concatenated deltas equal `decode(all ids)` (deltaflash.tokenizer's rule,
special tokens dropped unless the request keeps them). A fast (Rust) tokenizer whose decode is its
backend's alone (no clean-up pass) runs that same window in Rust (`tokenizers.decoders.DecodeStream`):
about a third of the host time per token (bench/textstream_cost.py), on the engine worker's thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from deltaflash.core.request import TokenLogprob
from deltaflash.tokenizer import DecodeOptions, decode

_INCOMPLETE = "\ufffd"  # what a decoder shows for a UTF-8 sequence cut by a token boundary


class TextStream:
    """`push(token)` adds one generated token; `take()` returns the text not yet taken that is safe to
    send: complete characters, minus a tail that could still grow into a stop string. After a stop
    string `stopped` is True and the text ends just before it."""

    def __init__(self, tokenizer, stop_strings: tuple[str, ...] = (), options: DecodeOptions = DecodeOptions()):
        self.tokenizer, self.stop_strings, self.options = tokenizer, stop_strings, options
        self.longest_stop = max((len(s) for s in stop_strings), default=0)
        self.ids: list[int] = []
        self.prefix_offset = 0  # window start: context tokens already turned into text
        self.read_offset = 0    # tokens before this are in `text`
        self.text = ""
        self.taken = 0          # characters of `text` handed out by take()
        self.emitted = 0        # characters decoded so far (a stop string's cut included)
        self.stopped = False
        self._backend, self._stream = _decode_stream(tokenizer, options)

    def push(self, token_id: int) -> None:
        if self.stopped:
            return
        self.ids.append(token_id)
        if self.tokenizer is None:
            return
        if self._stream is not None:
            delta = self._stream.step(self._backend, token_id)
            if delta:
                self._append(delta)
            return
        before = self._decode(self.ids[self.prefix_offset:self.read_offset])
        after = self._decode(self.ids[self.prefix_offset:])
        if len(after) > len(before) and not after.endswith(_INCOMPLETE):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self._append(after[len(before):])

    def finish(self) -> None:
        """No more tokens: flush text still held for an incomplete character."""
        if self.tokenizer is None or self.stopped:
            return
        if self._stream is not None:  # what it still holds back: the full decode's tail
            self._append(self._decode(self.ids)[self.emitted:])
            return
        if self.read_offset == len(self.ids):
            return
        before = self._decode(self.ids[self.prefix_offset:self.read_offset])
        after = self._decode(self.ids[self.prefix_offset:])
        self.read_offset = len(self.ids)
        self._append(after[len(before):])

    def take(self, final: bool = False) -> str:
        end = len(self.text)
        if not (final or self.stopped):
            end -= self._stop_prefix_len()
        out = self.text[self.taken:end]
        self.taken = max(self.taken, end)
        return out

    def _append(self, delta: str) -> None:
        if not delta:
            return
        self.emitted += len(delta)
        search_from = max(0, len(self.text) - self.longest_stop + 1)
        self.text += delta
        hits = [i for i in (self.text.find(s, search_from) for s in self.stop_strings) if i >= 0]
        if hits:
            self.text, self.stopped = self.text[:min(hits)], True

    def _stop_prefix_len(self) -> int:
        """Length of the longest tail of `text` that is a proper prefix of a stop string."""
        for k in range(min(self.longest_stop - 1, len(self.text) - self.taken), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self.stop_strings):
                return k
        return 0

    def _decode(self, ids: list[int]) -> str:
        return decode(self.tokenizer, ids, self.options)


def _decode_stream(tokenizer, options: DecodeOptions):
    """(backend, a fresh DecodeStream) when the tokenizer's decode is exactly its Rust backend's (a fast
    tokenizer without the clean-up pass), else (None, None): TextStream then runs the window in Python."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None, None
    try:
        from tokenizers.decoders import DecodeStream
    except ImportError:  # tokenizers before 0.21
        return None, None
    return backend, DecodeStream(skip_special_tokens=options.skip_special_tokens)


@dataclass(frozen=True)
class TextLogprob:
    """A generated token's log probability, named by its text (`TokenTexts`), and its row's `top`
    (text, logprob) pairs, most likely first (`top_ids`: their token ids). A prompt's first token has none
    (logprob None); a scored prompt token has its `rank` in its row (1: the likeliest)."""

    token: str
    logprob: float | None
    top: tuple[tuple[str, float], ...] = ()
    token_id: int = -1
    rank: int | None = None
    top_ids: tuple[int, ...] = ()


class TokenTexts:
    """Each token id's text on its own: decoded alone, special tokens kept (so they stay visible and
    distinct), memoized (at most one entry per vocabulary token). A token that is part of a UTF-8
    character shows as U+FFFD."""

    _OPTIONS = DecodeOptions(skip_special_tokens=False)

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = decode(self.tokenizer, [token_id], self._OPTIONS)
        return text

    def logprobs(self, entries: Sequence[TokenLogprob]) -> tuple[TextLogprob, ...]:
        return tuple(TextLogprob(self.text(e.token_id), e.logprob, tuple((self.text(t), lp) for t, lp in e.top),
                                 e.token_id, e.rank, tuple(t for t, _ in e.top)) for e in entries)
