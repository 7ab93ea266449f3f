"""Tables tuned on one device (kernel tiles, launch configs) ship beside their kernels as
<dir>/<device slug>.json, the slug made from torch.cuda.get_device_name."""

from __future__ import annotations

import re
from pathlib import Path


def device_table(tables: Path, device_name: str) -> Path:
    """Where the table of a device of this name ships in directory `tables`."""
    return tables / (re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-") + ".json")


def bundled(tables: Path, device_name: str) -> Path | None:
    """The table of a device of this name in directory `tables`, if one ships."""
    path = device_table(tables, device_name)
    return path if path.is_file() else None
