"""A slot's release and a kept prompt's eviction on the host, the pages of a 32k-token prompt (2,048 pages of 16)
kept by the prefix cache: us each. Run in a tree (PYTHONPATH) - the forty-second session's numpy counts against the
dict of `a5a0c16` (whose cache held pages with hold / give_back).

    PYTHONPATH=$PWD python3 docs/bench/cpu-s42/release.py"""

import statistics
import time

from deltaflash.cache.pages import PageAllocator

release, evict = [], []
for _ in range(50):
    pages = PageAllocator(200_000, 16, 4)
    pages.grow(0, 32_768)
    kept = list(pages.held[0])
    (pages.keep if hasattr(pages, "keep") else pages.hold)(kept)
    t0 = time.perf_counter()
    pages.release(0)
    t1 = time.perf_counter()
    (pages.unkeep if hasattr(pages, "unkeep") else pages.give_back)(kept)
    t2 = time.perf_counter()
    assert pages.num_free == pages.num_pages
    release.append(t1 - t0)
    evict.append(t2 - t1)
print(f"2,048 kept pages: release {1e6 * statistics.median(release):.0f} us, "
      f"eviction {1e6 * statistics.median(evict):.0f} us")
