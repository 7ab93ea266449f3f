"""Self-distillation data for the drafter: the target's own greedy continuations of train-split prompts.

At serving time the drafter reads target features of text the target wrote itself, and it must
predict what the target writes next. Training it on such text (rather than on the corpus, where
the target's features describe text it did not choose) is the DFlash recipe's data step. The
prompts come from the train split only, so held-out files stay unseen.

The result is one token stream in the corpus format (each document followed by end-of-text), saved
with its document offsets as safetensors.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from deltaflash.train.corpus import Corpus


def generation_prompts(corpus: Corpus, tokenizer, count: int, seed: int, max_prompt_tokens: int = 384,
                       min_lines: int = 4, max_lines: int = 24) -> list[list[int]]:
    """`count` prompts of `min_lines..max_lines` whole lines: first the start of every file (in a
    seeded order; the shape of a serving prompt), then windows starting at random lines."""
    rng = random.Random(seed)
    files = [text.splitlines(keepends=True) for text in corpus.texts]
    files = [lines for lines in files if len(lines) > max_lines]
    rng.shuffle(files)
    texts = []
    while len(texts) < count and files:
        for lines in files:
            start = 0 if len(texts) < len(files) else rng.randrange(len(lines) - max_lines)
            texts.append("".join(lines[start:start + rng.randint(min_lines, max_lines)]))
            if len(texts) == count:
                break
    encoded = tokenizer.encode_batch(texts, add_special_tokens=False)
    return [enc.ids[:max_prompt_tokens] for enc in encoded]


@torch.inference_mode()
def generate_stream(engine, prompts: list[list[int]], max_new_tokens: int, eos_id: int,
                    progress: bool = True) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(stream [N] int64, doc_offsets [D+1], generated tokens): prompt + greedy continuation +
    end-of-text (unless the continuation ended with it) per prompt, in prompt order. The engine runs
    target-only greedy decoding, batched over its slots."""
    from deltaflash.core.request import SamplingParams

    done, _ = engine.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens), progress=progress)
    docs = [c.prompt_ids + c.token_ids + ([] if c.token_ids[-1] == eos_id else [eos_id]) for c in done]
    offsets = torch.tensor([0, *map(len, docs)], dtype=torch.int64).cumsum(0)
    stream = torch.tensor([t for doc in docs for t in doc], dtype=torch.int64)
    return stream, offsets, sum(len(c.token_ids) for c in done)


def save_stream(path: Path, stream: torch.Tensor, offsets: torch.Tensor, metadata: dict[str, str]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"tokens": stream.to(torch.int32), "doc_offsets": offsets}, str(path), metadata=metadata)


def load_stream(path: Path) -> torch.Tensor:
    """The token stream [N] int64 of a file written by `save_stream`."""
    tensors = load_file(str(path))
    if "tokens" not in tensors:
        raise ValueError(f"{path}: not a generated stream (no 'tokens' tensor); write one with `train generate`")
    return tensors["tokens"].to(torch.int64)
