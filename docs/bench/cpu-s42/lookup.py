"""The prefix cache's lookup on the host: 64 kept prompts after one 2048-token system prompt (+128 tokens each),
a new prompt with that system prompt (all 64 share its blocks) and one that shares nothing: us per match().

    python3 docs/bench/cpu-s42/lookup.py

(The forty-second session's first lookup compared the prompt with every kept prompt that began with its first 64
tokens - 245 us here; the block keys walk the shared blocks once.)"""

import time

import numpy as np

from deltaflash.engine.prefix_cache import PrefixCache

cache = PrefixCache(64)
rng = np.random.default_rng(0)
system = rng.integers(0, 200_000, 2048)
for _ in range(64):
    cache.add(np.concatenate([system, rng.integers(0, 200_000, 128)]), [])
for label, prompt in (("shares the system prompt", np.concatenate([system, rng.integers(0, 200_000, 128)])),
                      ("shares nothing", rng.integers(0, 200_000, 2176))):
    cache.match(prompt)
    t = time.perf_counter()
    for _ in range(1000):
        cache.match(prompt)
    print(f"{label:26s}: {(time.perf_counter() - t) * 1e3:.1f} us a lookup")
