"""Load a bench/ script as a module (the scripts are not a package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def load(name: str):
    """bench/<name>.py as module `bench_<name>` (registered in sys.modules: a dataclass looks its module up there)."""
    module_name = f"bench_{name}"
    if module_name not in sys.modules:
        path = Path(__file__).parents[1] / "bench" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(module_name, path)
        sys.modules[module_name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[module_name])
    return sys.modules[module_name]
