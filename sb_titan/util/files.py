"""Writing files so that a reader sees the whole new content or the old one, never a
truncated file from an interrupted writer (profiles, manifests, logs, error records)."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomic(path: str | os.PathLike, text: str, *, durable: bool = False) -> Path:
    """Write `text` to a temporary file beside `path` (named by process, so concurrent
    writers never share one), then rename it over `path`. `durable`: fsync first, for
    files whose presence marks something complete on disk (checkpoint manifests)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    return path
