"""Which execupy the benches run: a hash of its sources, so a cached export is reused only by
the code that wrote it."""
from __future__ import annotations

import hashlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def source_version() -> str:
    h = hashlib.sha256()
    for path in sorted((ROOT / "execupy").rglob("*.py")):
        h.update(path.read_bytes())
    return h.hexdigest()[:12]
