"""A finished request's block keys, hashed whole against chained on from its prompt's (PrefixCache.keys(tokens,
known)): prompts of 2k / 32k / 128k tokens and a 256-token answer, best of 5 x 20 calls on this CPU box.

    python docs/bench/cpu-s43/finish_keys.py
"""

import time

import numpy as np

from deltaflash.engine.prefix_cache import PrefixCache

cache = PrefixCache(8)
for n in (2048, 32768, 131072):
    tokens = np.arange(n + 256, dtype=np.int64)
    known = cache.keys(tokens[:n])
    assert cache.keys(tokens, known) == cache.keys(tokens)
    out = []
    for label, call in (("whole", lambda: cache.keys(tokens)), ("chained on", lambda: cache.keys(tokens, known))):
        best = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(20):
                call()
            best.append((time.perf_counter() - t0) / 20 * 1e6)
        out.append(f"{label} {min(best):.1f} us")
    print(f"{n} + 256 tokens: " + ", ".join(out))
