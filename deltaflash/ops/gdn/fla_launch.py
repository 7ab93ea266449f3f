"""Launch configs for fla-core's chunked gated-delta-rule kernels (the GDN prefill), per device and by rows.

fla-core autotunes each of its kernels once per process over a short list of configs, keyed by head counts
and dims but not by the rows: whichever prefill shape comes first picks the config every later shape
runs. The best config does depend on the rows: the state kernel walks a lane's chunks one after another,
and a deeper load pipeline (more stages) that pays over 32 chunks of a 2048-row prompt costs a quarter
more on a 64-row chunk (bench/tune_fla.py). A table tuned on a device ships as tiles/<device slug>.json
and gives each kernel it names a config per row bucket; `select(rows)` makes the named kernels run the
configs of the bucket of a call whose longest lane has `rows` rows - fla-core's own kernels and
arithmetic, launched with that config, with no autotuning. Kernels the table leaves out keep fla-core's
autotuner.

Table format: {"device": name, "configs": {kernel: [{"min_rows": r, "kwargs": {...}, "num_warps": w,
"num_stages": s}, ...]}}, kernel one of KERNELS' names, the first entry's min_rows 0, then increasing; a
call uses the last entry whose min_rows <= its rows. An engine picks the table (EngineConfig.fla_tiles:
the device's bundled one, another, or none) and makes it the process's with `use`.
"""

from __future__ import annotations

import bisect
import importlib
import json
from pathlib import Path

from deltaflash.ops.tables import bundled

TABLES = Path(__file__).parent / "tiles"

KERNELS = {  # short name -> (module, kernel) of the forward path's autotuned kernels
    "h": ("fla.ops.common.chunk_delta_h", "chunk_gated_delta_rule_fwd_kernel_h_blockdim64"),
    "o": ("fla.ops.common.chunk_o", "chunk_fwd_kernel_o"),
    "kkt": ("fla.ops.gated_delta_rule.chunk_fwd", "chunk_gated_delta_rule_fwd_kkt_solve_kernel"),
    "wu": ("fla.ops.gated_delta_rule.wy_fast", "recompute_w_u_fwd_kernel"),
}


def autotuner(name: str):
    """The triton Autotuner of kernel `name` (heuristics wrap it; it wraps the JIT function)."""
    from triton.runtime.autotuner import Autotuner

    module, attr = KERNELS[name]
    kernel = getattr(importlib.import_module(module), attr)
    while not isinstance(kernel, Autotuner):
        kernel = kernel.fn
    return kernel


class LaunchTable:
    """{kernel name: [(min_rows, triton.Config), ...]} (min_rows increasing from 0)."""

    def __init__(self, device: str, buckets: dict):
        for name, entries in buckets.items():
            if name not in KERNELS:
                raise KeyError(f"unknown kernel {name!r} (known: {', '.join(KERNELS)})")
            rows = [r for r, _ in entries]
            if not rows or rows[0] != 0 or rows != sorted(set(rows)):
                raise ValueError(f"{name}: min_rows {rows} must start at 0 and increase")
        self.device, self.buckets = device, buckets
        self.bounds = sorted({0} | {r for entries in buckets.values() for r, _ in entries})  # where configs change

    def configs(self, rows: int) -> dict:
        """Each kernel's config for a call whose longest lane has `rows` rows."""
        return {name: next(c for r, c in reversed(entries) if r <= rows) for name, entries in self.buckets.items()}

    def bound(self, rows: int) -> int:
        """The largest bucket start <= rows: calls of equal bound run equal configs."""
        return self.bounds[bisect.bisect_right(self.bounds, rows) - 1]

    @classmethod
    def load(cls, path: str | Path) -> LaunchTable:
        """A table file; ValueError naming the file if it is not one."""
        import triton

        try:
            data = json.loads(Path(path).read_text())
            return cls(str(data["device"]), {
                name: [(int(e["min_rows"]), triton.Config(dict(e["kwargs"]), num_warps=int(e["num_warps"]),
                                                          num_stages=int(e["num_stages"]))) for e in entries]
                for name, entries in data["configs"].items()})
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}: not an fla-core launch table ({type(e).__name__}: {e})") from e

    def save(self, path: str | Path) -> None:
        table = {name: [{"min_rows": r, "kwargs": dict(c.kwargs), "num_warps": c.num_warps, "num_stages": c.num_stages}
                        for r, c in entries] for name, entries in sorted(self.buckets.items())}
        Path(path).write_text(json.dumps({"device": self.device, "configs": table}, indent=1) + "\n")


def pin(configs: dict) -> dict:
    """Run each named kernel with its config (a triton.Config) from now on, in this process. Returns the
    config lists it replaced, for `unpin`."""
    before = {}
    for name, config in configs.items():
        tuner = autotuner(name)
        before[name] = tuner.configs
        tuner.configs = [config]  # one config: the autotuner launches it, no benchmarking
    return before


def unpin(before: dict) -> None:
    for name, configs in before.items():
        tuner = autotuner(name)
        tuner.configs = configs
        tuner.cache.clear()


def bundled_table(device_name: str) -> Path | None:
    """The table tuned on a device of this name that ships with deltaflash, if any."""
    return bundled(TABLES, device_name)


_active: LaunchTable | None = None  # the table `select` reads (fla-core's kernels are the process's)
_pinned: int | None = None  # the bound of the bucket whose configs `select` pinned last
_own: dict = {}  # fla-core's config lists of the kernels a table pinned, for `use(None)`


def use(table: LaunchTable | None) -> None:
    """Make `table` the process's (None: fla-core's autotuner for every kernel again)."""
    global _active, _pinned
    unpin(_own)
    _own.clear()
    if table is not None:
        _own.update({name: autotuner(name).configs for name in table.buckets})
    _active, _pinned = table, None


def select(rows: int) -> None:
    """Before a chunked-rule call whose longest lane has `rows` rows: the active table's configs for that
    many rows (nothing without a table), pinned only when the call's bucket differs from the last call's
    (nothing else sets these kernels' configs in a serving process)."""
    global _pinned
    if _active is not None and _active.bound(rows) != _pinned:  # (a prefill's layers: pinned once)
        pin(_active.configs(rows))
        _pinned = _active.bound(rows)
