"""File-based coordination for peer processes (tests and benchmarks): atomic writes and waits."""

from __future__ import annotations

import os
import time
from pathlib import Path


def write(path: Path, data: bytes) -> None:
    """Write so a reader never sees a partial file (peers poll for existence)."""
    tmp = path.parent / f".{path.name}.{os.getpid()}"
    tmp.write_bytes(data)
    os.rename(tmp, path)


def wait_for(paths, timeout: float = 120, poll_s: float = 0.005) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        if time.monotonic() > deadline:
            raise TimeoutError(f"waiting for {[str(p) for p in paths if not p.exists()]}")
        time.sleep(poll_s)
