"""The image tests import the offline build (images/offline) and the containerd harness
(tests/cluster, which the top-level conftest puts on sys.path) as top-level modules."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "images" / "offline"))
