"""Triton kernel loads while a block of work runs: each is a compile, or a binary read from the disk
cache, the first time a specialisation is met in the process (tens to hundreds of milliseconds on the
host, inside whatever request met it). After an engine's start-up warm-up serving should load none;
`bench e2e` reports the count of every measured point."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def kernel_loads() -> Iterator[list[tuple[str, bool]]]:
    """Yields a list that fills with (kernel name, whether it came from the disk cache) per load until
    the block ends. Empty where Triton compiles nothing (the interpreter)."""
    import triton

    knobs = triton.knobs.compilation
    loads: list[tuple[str, bool]] = []
    previous = knobs.listener

    def listener(*, src, metadata, metadata_group, times, cache_hit):
        loads.append((str(getattr(src, "name", src)), bool(cache_hit)))
        if previous is not None:
            previous(src=src, metadata=metadata, metadata_group=metadata_group, times=times, cache_hit=cache_hit)

    knobs.listener = listener
    try:
        yield loads
    finally:
        knobs.listener = previous
