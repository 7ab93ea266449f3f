"""Launch configs for fla-core's chunked gated-delta-rule kernels (the GDN prefill), per device.

fla-core autotunes each of its kernels once per process over a short list of configs, keyed by head counts
and dims but not by the rows: whichever prefill shape comes first picks the config every later shape
runs, and its lists leave out tiles that do better at the 9B layer (bench/tune_fla.py measures them). A
table tuned on a device ships as tiles/<device slug>.json; `pin` makes each named kernel run its
table config - fla-core's own kernels and arithmetic, launched with that config, with no autotuning.

Table format: {"device": name, "configs": {kernel: {"kwargs": {...}, "num_warps": w, "num_stages": s}}},
kernel one of KERNELS' names. DELTAFLASH_FLA_TILES=PATH uses another table, =off none (fla-core's autotuner).
"""

from __future__ import annotations

import functools
import importlib
import json
import os
from pathlib import Path

from deltaflash.ops.tables import device_table

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


def load(path: str | Path) -> dict:
    """{kernel name: triton.Config} of a table file; ValueError naming the file if it is not one."""
    import triton

    try:
        data = json.loads(Path(path).read_text())
        configs = {}
        for name, c in data["configs"].items():
            if name not in KERNELS:
                raise KeyError(f"unknown kernel {name!r} (known: {', '.join(KERNELS)})")
            configs[name] = triton.Config(dict(c["kwargs"]), num_warps=int(c["num_warps"]),
                                          num_stages=int(c["num_stages"]))
        return configs
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not an fla-core launch table ({type(e).__name__}: {e})") from e


def save(path: str | Path, device: str, configs: dict) -> None:
    table = {name: {"kwargs": dict(c.kwargs), "num_warps": c.num_warps, "num_stages": c.num_stages}
             for name, c in sorted(configs.items())}
    Path(path).write_text(json.dumps({"device": device, "configs": table}, indent=1) + "\n")


def pin(configs: dict) -> dict:
    """Run each named kernel with its config from now on (this process). Returns the config lists it
    replaced, for `unpin`."""
    before = {}
    for name, config in configs.items():
        tuner = autotuner(name)
        before[name] = tuner.configs
        tuner.configs = [config]
        tuner.cache.clear()
    return before


def unpin(before: dict) -> None:
    for name, configs in before.items():
        tuner = autotuner(name)
        tuner.configs = configs
        tuner.cache.clear()


@functools.cache
def pin_for(device_name: str) -> str:
    """Pin the table for this device once per process (DELTAFLASH_FLA_TILES, else the bundled one, if
    any). Returns where the configs came from."""
    choice = os.environ.get("DELTAFLASH_FLA_TILES", "")
    if choice == "off":
        return "fla-core's autotuner (DELTAFLASH_FLA_TILES=off)"
    path = Path(choice) if choice else device_table(TABLES, device_name)
    if not choice and not path.is_file():
        return "fla-core's autotuner (no table for this device)"
    pin(load(path))
    return str(path)
