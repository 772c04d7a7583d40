"""Snapshot files damaged on purpose, as the tests and the fault benchmark do."""

from __future__ import annotations

from pathlib import Path


def flip_byte(path: Path, offset: int) -> None:
    """Invert one bit of the byte at `offset`, in place: same size, other content."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 1]))


def largest(snap: Path, names, prefix: str = "") -> str:
    """The largest of the files `names` (relative to `snap`) that start with `prefix`: for an
    image, the pages file that holds the process's memory."""
    return max((n for n in names if n.startswith(prefix)), key=lambda n: (snap / n).stat().st_size)
