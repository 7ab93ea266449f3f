"""Triton kernel loads while a block of work runs: each is a compile, or a binary read from the disk
cache, the first time a specialisation is met in the process (tens to hundreds of milliseconds on the
host, inside whatever request met it). After an engine's start-up warm-up serving should load none:
`bench e2e` reports the count of every measured point, and `deltaflash serve` counts them in /metrics
(`deltaflash_kernel_loads_total`) and logs a warning for each."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def on_kernel_load(callback: Callable[[str, bool], None]) -> Iterator[None]:
    """Calls callback(kernel name, whether it came from the disk cache) for every Triton kernel load in
    the process until the block ends (Triton's compilation listener; an earlier listener still runs).
    Never called where Triton compiles nothing (the interpreter)."""
    import triton

    knobs = triton.knobs.compilation
    previous = knobs.listener

    def listener(*, src, metadata, metadata_group, times, cache_hit):
        callback(str(getattr(src, "name", src)), bool(cache_hit))
        if previous is not None:
            previous(src=src, metadata=metadata, metadata_group=metadata_group, times=times, cache_hit=cache_hit)

    knobs.listener = listener
    try:
        yield
    finally:
        knobs.listener = previous


@contextlib.contextmanager
def kernel_loads() -> Iterator[list[tuple[str, bool]]]:
    """Yields a list that fills with (kernel name, from the disk cache) per load until the block ends."""
    loads: list[tuple[str, bool]] = []
    with on_kernel_load(lambda name, cached: loads.append((name, cached))):
        yield loads
