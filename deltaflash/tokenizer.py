"""Tokenizer and chat template from the checkpoint folder, offline."""

from __future__ import annotations

from pathlib import Path

from deltaflash.errors import RequestError

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def load_tokenizer(folder: str | Path):
    """transformers' tokenizer of the folder, or None when the folder has no tokenizer files."""
    folder = Path(folder)
    if not any((folder / f).is_file() for f in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def encode_prompt(tokenizer, text: str) -> list[int]:
    """Raw text, exactly as /v1/completions tokenizes it (no special tokens added)."""
    if tokenizer is None:
        raise RequestError("this model folder has no tokenizer: pass token ids (--prompt-ids) instead of text")
    return list(tokenizer.encode(text, add_special_tokens=False))


def encode_chat(tokenizer, messages: list[dict]) -> list[int]:
    """The model's chat template with the generation prompt, as /v1/chat/completions applies it."""
    if tokenizer is None:
        raise RequestError("this model folder has no tokenizer, so chat is unavailable")
    if not getattr(tokenizer, "chat_template", None):
        raise RequestError("this model's tokenizer has no chat template")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)
