"""Where BlockTables.update's host time goes on a CUDA machine (the 9B TTFT split showed runner.map_pages at
~414 us a 2048-token prefill step on an H100 VM): one slot released and 128 pages granted, as a 2048-token
request after another, at max_model_len 262,144 (16,384 entries a table row); each part timed alone."""
import time

import numpy as np
import torch

from deltaflash.cache.pages import BlockTables
from deltaflash.core.batch import to_device

dev = torch.device("cuda")
tables = BlockTables(8, 262144, 16, dev, num_pages=200000)
grants = [(0, i, 1000 + i) for i in range(128)]


def timed(label, fn, reps=200):
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
        torch.cuda.synchronize()
    ts.sort()
    print(f"{label:48s} p50 {1e6 * ts[len(ts) // 2]:8.1f} us  min {1e6 * ts[0]:8.1f}")


timed("update(released=[0], 128 grants)", lambda: tables.update([0], grants))
timed("update((), 128 grants)", lambda: tables.update((), grants))
timed("update([0], ())", lambda: tables.update([0], ()))
payload = np.zeros(128 * 12 + 8, dtype=np.uint8)
timed("to_device(1.5 KB payload)", lambda: to_device(payload, dev, dtype=torch.uint8))
index = torch.zeros(1, dtype=torch.int64, device=dev)
timed("index_fill_ one row", lambda: tables.tables.index_fill_(0, index, 5))
flat_index = torch.arange(128, dtype=torch.int64, device=dev)
values = torch.arange(128, dtype=torch.int32, device=dev)
timed("index_copy_ 128 entries", lambda: tables.tables.view(-1).index_copy_(0, flat_index, values))
timed("numpy payload build", lambda: np.concatenate([np.asarray(grants, dtype=np.int64).reshape(-1, 3)[:, 0]]))
timed("empty kernel launch (zero_ of 1 int)", lambda: index.zero_())
