"""A chat answer's reasoning apart from its content (`deltaflash serve --reasoning-parser qwen3`, vLLM's flag):
Qwen3 and Qwen3.5 models think between `<think>` and `</think>`, then answer. The thinking comes back as the
message's `reasoning` (and `reasoning_content`, its older name that SGLang and older vLLM clients read), the
answer as `content`, streamed as `delta.reasoning` / `delta.content`.

Decisions:
- Qwen3.5's template opens the block in the prompt (`<think>\\n` after the assistant's turn opens; with
  `chat_template_kwargs: {"enable_thinking": false}` it writes an empty block, closed). So the prompt decides
  where an answer starts (`opens_reasoning`): inside an open block, the output is reasoning up to `</think>`;
  otherwise it is content, unless it begins with `<think>` (Qwen3 before 2507 writes the tag itself).
- A `<tool_call>` inside the block ends it too (Qwen3.5 sometimes calls a tool without closing it): the call
  and what follows are content, where the tool-call parser finds them.
- The whitespace between `</think>` and the answer is neither (the template's separator).
- An output cut short inside the block is all reasoning.
- A grammar (response_format, guided_*, a forced tool_choice) constrains the answer, not the thinking (vLLM's
  rule): where the prompt leaves a block open, it holds from the token after `</think>`
  (GrammarSpec.after), else from the first token. A tokenizer without a `</think>` token of its own
  leaves such requests unparsed, the grammar holding from the first token.
"""

from __future__ import annotations

from deltaflash.server.tools import OPEN as CALL

OPEN, CLOSE = "<think>", "</think>"
REASONING_PARSERS = ("qwen3",)


def end_token(tokenizer) -> int | None:
    """The id of the tokenizer's `</think>` token, or None when it has none of its own."""
    return tokenizer.get_vocab().get(CLOSE) if tokenizer is not None else None


def opens_reasoning(prompt_tail: str) -> bool:
    """Whether a prompt whose text ends with `prompt_tail` leaves a think block open for the answer."""
    return prompt_tail.rfind(OPEN) > prompt_tail.rfind(CLOSE)


def _held(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that begins one of `tags` (and may finish it in the next piece)."""
    return max((n for tag in tags for n in range(1, min(len(tag), len(text) + 1)) if text.endswith(tag[:n])),
               default=0)


class ReasoningParser:
    """Generated text -> (reasoning, content), incrementally: `feed` each new piece, then `finish` once. Text
    that may still be a tag is held back until the next piece decides it."""

    def __init__(self, open_block: bool):
        self._state = "reasoning" if open_block else "start"  # start -> reasoning? -> gap -> content
        self._pending = ""

    def feed(self, text: str) -> tuple[str, str]:
        self._pending += text
        reasoning, content = [], []
        while self._step(reasoning, content):
            pass
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What is held: reasoning inside the block, else content."""
        pending, self._pending = self._pending, ""
        return (pending, "") if self._state == "reasoning" else ("", pending)

    def _step(self, reasoning: list[str], content: list[str]) -> bool:
        """Decide the front of the pending text; True when the state changed and more may be decided."""
        text = self._pending
        if self._state == "start":  # an answer may open its own block
            bare = text.lstrip()
            if bare.startswith(OPEN):
                self._state, self._pending = "reasoning", bare[len(OPEN):]
                return True
            if not OPEN.startswith(bare):
                self._state = "content"
                return True
            return False
        if self._state == "reasoning":
            ends = [(i, tag) for tag in (CLOSE, CALL) if (i := text.find(tag)) >= 0]
            if ends:
                i, tag = min(ends)
                reasoning.append(text[:i])
                self._state, self._pending = ("gap", text[i + len(CLOSE):]) if tag == CLOSE else ("content", text[i:])
                return True
            keep = _held(text, (CLOSE, CALL))
            reasoning.append(text[:len(text) - keep])
            self._pending = text[len(text) - keep:]
            return False
        if self._state == "gap":  # the whitespace after </think>
            bare = text.lstrip()
            if bare:
                self._state, self._pending = "content", bare
                return True
            self._pending = ""
            return False
        content.append(text)
        self._pending = ""
        return False
