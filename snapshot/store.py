"""The snapshot store: a directory of snapshots (default $ELASTIC_EP_SNAPSHOTS or
~/.cache/elastic-ep/snapshots), each a subdirectory holding a manifest.json."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import msgspec

from snapshot.bake import default_root
from snapshot.manifest import (
    MANIFEST_NAME,
    SnapshotCorrupt,
    SnapshotError,
    SnapshotManifest,
    SnapshotTarget,
    check_compatible,
    load_manifest,
    snapshot_size,
    verify,
)

__all__ = ["SnapshotInfo", "default_root", "list_snapshots", "find_compatible", "resolve", "remove_snapshot"]


class SnapshotInfo(msgspec.Struct):
    path: str
    manifest: SnapshotManifest | None  # None when the manifest is unreadable (see error)
    size_bytes: int
    error: str = ""


def list_snapshots(root: str | os.PathLike | None = None) -> list[SnapshotInfo]:
    """Every snapshot directly under `root` (hidden directories, such as a write in progress,
    skipped), newest first; those with a broken manifest, and links (never followed: a snapshot
    restored from the store lies inside it), are listed with `error` set. SnapshotError when
    `root` cannot be read."""
    r = Path(root) if root is not None else default_root()
    if not r.is_dir():
        return []
    try:
        entries = sorted(r.iterdir())
    except OSError as e:
        raise SnapshotError(f"snapshot store {r}: unreadable ({e.strerror or e})") from None
    out: list[SnapshotInfo] = []
    for d in entries:
        if d.name.startswith("."):
            continue
        if d.is_symlink():
            if d.is_dir():
                out.append(SnapshotInfo(str(d), None, 0, f"snapshot {d}: a symbolic link, not followed"))
            continue
        if not d.is_dir() or not os.path.lexists(d / MANIFEST_NAME):
            continue
        try:
            m, err = load_manifest(d), ""
        except SnapshotCorrupt as e:
            m, err = None, str(e)
        out.append(SnapshotInfo(str(d), m, snapshot_size(d), err))
    out.sort(key=lambda i: i.manifest.created if i.manifest else "", reverse=True)
    return out


def find_compatible(
    target: SnapshotTarget,
    root: str | os.PathLike | None = None,
    *,
    tiers: tuple[str, ...] | None = None,
    check_files: bool = True,
) -> tuple[list[SnapshotInfo], dict[str, str]]:
    """(snapshots that fit `target`, newest first; {path: why} for each one refused). With
    `check_files`, checksums are verified too, so a damaged snapshot is refused, not restored."""
    ok: list[SnapshotInfo] = []
    refused: dict[str, str] = {}
    try:
        infos = list_snapshots(root)
    except SnapshotError as e:  # an unreadable store: no snapshot, the joiner cold-starts
        return ok, {str(root if root is not None else default_root()): str(e)}
    for info in infos:
        if info.manifest is None:
            refused[info.path] = info.error
            continue
        if tiers is not None and info.manifest.tier not in tiers:
            refused[info.path] = f"snapshot {info.path}: tier {info.manifest.tier} not wanted here ({', '.join(tiers)})"
            continue
        try:
            check_compatible(info.manifest, target, path=info.path)
            if check_files:
                verify(info.path)
        except SnapshotError as e:
            refused[info.path] = str(e)
            continue
        ok.append(info)
    return ok, refused


def resolve(name: str | os.PathLike, root: str | os.PathLike | None = None) -> Path:
    """A snapshot directory from a path, or from a directory name / snapshot id under `root`."""
    p = Path(name)
    if p.exists() or p.is_absolute() or len(p.parts) > 1:
        return p
    r = Path(root) if root is not None else default_root()
    if (r / p).is_dir():
        return r / p
    for info in list_snapshots(r):
        if info.manifest is not None and info.manifest.snapshot_id == str(name):
            return Path(info.path)
    return p


def remove_snapshot(path: str | os.PathLike) -> SnapshotManifest:
    """Delete a snapshot directory. Refuses (SnapshotError) anything whose manifest.json does
    not parse as a snapshot manifest, so it never deletes an unrelated directory. A snapshot
    with damaged files can still be removed."""
    d = Path(path)
    if d.is_symlink():
        raise SnapshotError(f"{d}: is a symbolic link; refusing to remove it (remove the snapshot it points to)")
    try:
        m = load_manifest(d)
    except SnapshotCorrupt as e:
        raise SnapshotError(f"{e}; refusing to remove it") from None
    # Rename first, so a reader never sees a half-deleted snapshot with its manifest.
    trash = Path(tempfile.mkdtemp(prefix=f".{d.name}.rm-", dir=d.absolute().parent))
    os.rename(d, trash / "x")
    shutil.rmtree(trash)
    return m
