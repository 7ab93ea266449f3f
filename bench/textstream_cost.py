"""Host time of the server's incremental detokenization (deltaflash/server/textstream.py) per generated
token, the Rust window (tokenizers' DecodeStream) against the Python one, side by side in one run: 64
streams of the bundled demo tokenizer taking 3 tokens each per step, as a 64-lane round emits them. This
work runs on the engine worker's thread between steps, so it adds to every step's host time.

    python bench/textstream_cost.py [--lanes 64] [--tokens-per-step 3] [--steps 200]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import deltaflash
from deltaflash.server.textstream import TextStream
from deltaflash.tokenizer import load_tokenizer


class PythonDecode:
    """The tokenizer without its Rust backend in view: TextStream's window runs in Python."""

    def __init__(self, tokenizer):
        self.decode = tokenizer.decode


def per_token_us(tokenizer, ids: list[int], lanes: int, per_step: int, steps: int) -> float:
    streams = [TextStream(tokenizer, ("\n\n\n",)) for _ in range(lanes)]
    n = 0
    t0 = time.perf_counter()
    for _ in range(steps):
        for stream in streams:
            for _ in range(per_step):
                stream.push(ids[n % len(ids)])
                n += 1
            stream.take()
    return 1e6 * (time.perf_counter() - t0) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lanes", type=int, default=64)
    ap.add_argument("--tokens-per-step", type=int, default=3)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    tok = load_tokenizer(Path(deltaflash.__file__).parent / "assets" / "demo" / "target")
    text = Path(__file__).read_text() + Path(deltaflash.__file__).with_name("cli.py").read_text()  # code, prose
    ids = [t for line in text.splitlines() for t in tok.encode(line + "\n", add_special_tokens=False)]
    rust = per_token_us(tok, ids, args.lanes, args.tokens_per_step, args.steps)
    python = per_token_us(PythonDecode(tok), ids, args.lanes, args.tokens_per_step, args.steps)
    step = args.lanes * args.tokens_per_step
    print(f"{args.lanes} streams x {args.tokens_per_step} tokens per step, {args.steps} steps:")
    print(f"  Rust window (DecodeStream): {rust:.2f} us per token, {rust * step / 1e3:.3f} ms per step")
    print(f"  Python window:              {python:.2f} us per token, {python * step / 1e3:.3f} ms per step")
    print(f"  python / rust: {python / rust:.2f}x")


if __name__ == "__main__":
    main()
