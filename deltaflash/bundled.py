"""Where the bundled demo pair lives (deltaflash/assets/demo: target/ and draft/, see its README)."""

from pathlib import Path

BUNDLED = Path(__file__).parent / "assets" / "demo"
