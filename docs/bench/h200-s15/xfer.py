"""Host cost of small host -> device transfers (5 x 64 ints), while the device is busy."""
import time, torch
dev = "cuda"
vals = [list(range(64)) for _ in range(5)]
pinned = torch.empty(1 << 16, dtype=torch.long).pin_memory()
npv = pinned.numpy()
def a(): return torch.tensor(vals).pin_memory().to(dev, non_blocking=True)
def b(): return torch.tensor(vals).to(dev, non_blocking=True)
def c():
    flat = [x for r in vals for x in r]; n = len(flat); npv[:n] = flat
    return pinned[:n].to(dev, non_blocking=True).view(5, 64)
def d():
    t = torch.tensor(vals); n = t.numel(); pinned[:n].copy_(t.view(-1)); return pinned[:n].to(dev, non_blocking=True)
def e(): return torch.tensor(vals)
dst = torch.empty(5, 64, dtype=torch.long, device=dev)
def f():
    flat = [x for r in vals for x in r]; n = len(flat); npv[:n] = flat
    dst.view(-1).copy_(pinned[:n], non_blocking=True); return dst
for name, fn in [("tensor+pin+copy (now)", a), ("tensor+pageable copy", b), ("numpy fill pinned+copy", c),
                 ("tensor+copy into pinned+copy", d), ("torch.tensor only", e), ("numpy fill + copy_ into static", f)]:
    for busy in (False, True):
        ts = []
        for _ in range(200):
            torch.cuda.synchronize()
            if busy:
                torch.cuda._sleep(2_000_000)  # ~1 ms of device work queued ahead
            t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
        torch.cuda.synchronize()
        ts.sort()
        print(f"{name:34s} busy={busy!s:5s} p50 {ts[100]*1e6:7.1f} us  p90 {ts[180]*1e6:7.1f} us")
ev = torch.cuda.Event(enable_timing=True)
ts = []
for _ in range(200):
    t = time.perf_counter(); ev.record(); ts.append(time.perf_counter() - t)
ts.sort(); print(f"event record p50 {ts[100]*1e6:.1f} us")
