"""Tables tuned on one device (kernel tiles, launch configs) ship beside their kernels as
<dir>/<device slug>.json, the slug made from torch.cuda.get_device_name."""

from __future__ import annotations

import re
from pathlib import Path


def device_table(tables: Path, device_name: str) -> Path:
    """Where the table of a device of this name ships in directory `tables`."""
    return tables / (re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-") + ".json")
