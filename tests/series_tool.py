"""scripts/series.py (the patch series tool), importable from the tests."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT / "scripts") not in sys.path:
    sys.path.insert(0, str(ROOT / "scripts"))

import series  # noqa: E402

__all__ = ["ROOT", "series"]
