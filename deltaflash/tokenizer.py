"""Tokenizer and chat template from the checkpoint folder, offline; and the text rules the CLI and the
server share: which text a tokenizer accepts (`utf8_length`) and how token ids become text (`decode`)."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from deltaflash.errors import RequestError

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


class InvalidTextError(RequestError):
    """Text that is not valid Unicode (it holds a lone surrogate: JSON "\\ud800", or bytes in argv that are
    not UTF-8), which no tokenizer can encode."""


@dataclass(frozen=True)
class DecodeOptions:
    """How generated token ids become text. `skip_special_tokens`: drop special tokens (end of text, chat
    markers) as OpenAI and vLLM do. `spaces_between_special_tokens`: only slow (Python) tokenizers use it."""

    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True


@dataclass(frozen=True)
class ChatOptions:
    """How the chat template renders a conversation (vLLM's fields of the same names).
    `add_generation_prompt`: the assistant's turn is opened for the answer. `continue_final_message`: the last
    message is left open (no end of turn) for the model to continue; it excludes add_generation_prompt.
    `template_kwargs` (`chat_template_kwargs`): more variables for the template - Qwen3's `enable_thinking`,
    for one - none of them a name `apply_chat_template` takes itself (`reserved_template_names`)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: Mapping[str, object] = field(default_factory=lambda: MappingProxyType({}))


def reserved_template_names() -> frozenset[str]:
    """What chat_template_kwargs may not set: the template's `messages` and every parameter of transformers'
    apply_chat_template (tokenize, chat_template, documents, ...), which are the server's to choose."""
    from transformers import PreTrainedTokenizerBase

    parameters = inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters
    return frozenset(name for name, p in parameters.items() if p.kind is not p.VAR_KEYWORD) - {"self"} | {"messages"}


def load_tokenizer(folder: str | Path):
    """transformers' tokenizer of the folder, or None when the folder has no tokenizer files."""
    folder = Path(folder)
    if not any((folder / f).is_file() for f in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def utf8_length(text: str, field: str) -> int:
    """Bytes of `text` in UTF-8; InvalidTextError naming `field` when it is not valid Unicode."""
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise InvalidTextError(f"{field} is not valid Unicode: lone surrogate U+{ord(text[exc.start]):04X} at "
                               f"character {exc.start}") from None


def encode_prompt(tokenizer, text: str) -> list[int]:
    """Raw text, exactly as /v1/completions tokenizes it (no special tokens added). `text` must be valid
    Unicode (`utf8_length`)."""
    if tokenizer is None:
        raise RequestError("this model folder has no tokenizer: pass token ids (--prompt-ids) instead of text")
    return list(tokenizer.encode(text, add_special_tokens=False))


def encode_chat(tokenizer, messages: list[dict], tools: list[dict] | None = None,
                options: ChatOptions = ChatOptions()) -> list[int]:
    """The model's chat template (with the generation prompt unless `options` say otherwise), as
    /v1/chat/completions applies it. `tools`: OpenAI tool definitions the template renders into its system
    prompt (server/tools.py `ToolRequest.template_tools`); None renders none. Every string in `messages` must
    be valid Unicode (`utf8_length`)."""
    if tokenizer is None:
        raise RequestError("this model folder has no tokenizer, so chat is unavailable")
    if not getattr(tokenizer, "chat_template", None):
        raise RequestError("this model's tokenizer has no chat template")
    ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=options.add_generation_prompt,
                                        continue_final_message=options.continue_final_message, tokenize=True,
                                        **options.template_kwargs)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


def decode(tokenizer, ids, options: DecodeOptions = DecodeOptions()) -> str:
    """Token ids -> text: the one rule of `deltaflash generate`, the server's streams and /detokenize."""
    if not ids:
        return ""
    return tokenizer.decode(list(ids), skip_special_tokens=options.skip_special_tokens,
                            spaces_between_special_tokens=options.spaces_between_special_tokens)
