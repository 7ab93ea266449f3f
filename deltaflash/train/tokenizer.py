"""Byte-level BPE for the demo pair, saved as a Hugging Face tokenizer folder.

The folder holds `tokenizer.json` and `tokenizer_config.json` (with a ChatML-style chat template),
which `transformers.AutoTokenizer.from_pretrained(folder)` loads offline.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
MASK = "<|mask|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END, MASK)  # ids 0..3, in this order

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@dataclass(frozen=True)
class SpecialIds:
    endoftext: int
    im_start: int
    im_end: int
    mask: int


def train_tokenizer(texts: Sequence[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE with `vocab_size` entries, the special tokens included (ids 0..3)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer, length=len(texts))
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, folder: Path, model_max_length: int) -> None:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": ENDOFTEXT,
        "pad_token": ENDOFTEXT,
        "extra_special_tokens": [IM_START, IM_END, MASK],
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def load_tokenizer(folder: Path) -> Tokenizer:
    return Tokenizer.from_file(str(Path(folder) / "tokenizer.json"))


def special_ids(tokenizer: Tokenizer) -> SpecialIds:
    ids = [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS]
    if None in ids:
        raise ValueError(f"tokenizer lacks special tokens {[t for t, i in zip(SPECIAL_TOKENS, ids) if i is None]}")
    return SpecialIds(*ids)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
