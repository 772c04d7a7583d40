"""Snapshot manifest: what a snapshot was baked for, and the checksums of its files.

A snapshot is a directory: ``manifest.json`` plus the files it lists (relative path -> sha256).
It is written atomically (temporary directory + rename), so a directory that holds a
``manifest.json`` was completely written; ``verify`` recomputes the checksums to catch later
damage. A joiner accepts a snapshot only when ``check_compatible`` finds every field that shapes
the restored state (model, parallel config, GPU type, driver, graph shapes) equal to what its
deployment expects; the error names every field that differs, with both values.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Literal

import msgspec

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
Tier = Literal["artifacts", "parked", "criu"]
TIERS: tuple[str, ...] = ("artifacts", "parked", "criu")


class SnapshotError(Exception):
    """Base of every snapshot error; the message is meant for the user as is."""


class SnapshotMismatch(SnapshotError):
    """The snapshot was baked for another deployment; the message names every differing field."""


class SnapshotCorrupt(SnapshotError):
    """The snapshot directory is damaged, incomplete or not a snapshot; the message names the file."""


class SnapshotExists(SnapshotError):
    """Refused to overwrite an existing directory."""


class SnapshotTarget(msgspec.Struct, kw_only=True):
    """What a deployment expects of a snapshot it would restore from."""

    model_identity: str  # ModelConfig.identity()
    dtype: str  # resolved ("" never appears here)
    max_ranks: int
    num_experts: int
    slots_per_rank: int
    max_seqs: int
    max_len: int
    max_batched_tokens: int
    device_type: str  # "cpu" or the GPU name (torch.cuda.get_device_name)
    driver_version: str = ""  # cuDriverGetVersion() on CUDA, "" on CPU
    cuda_graph_sizes: list[int] = []


class SnapshotManifest(SnapshotTarget, kw_only=True):
    """A snapshot: what it was baked for (the SnapshotTarget fields) and what it holds."""

    format_version: int = FORMAT_VERSION
    snapshot_id: str
    created: str  # ISO 8601, UTC
    tier: Tier = "artifacts"
    model_name: str
    architecture: str
    warmup_seconds: float = 0.0
    files: dict[str, str] = {}  # relative path -> sha256 of every other file in the snapshot dir
    weights_included: bool = False


COMPARED_FIELDS: tuple[str, ...] = SnapshotTarget.__struct_fields__


def now_iso() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


def _show(field: str, value) -> str:
    if field == "model_identity" and isinstance(value, str) and len(value) > 12:
        return value[:12] + ".."
    if isinstance(value, str):
        return repr(value) if value == "" or " " in value else value
    return str(value)


def differences(manifest: SnapshotManifest, target: SnapshotTarget) -> list[tuple[str, object, object]]:
    """(field, in the snapshot, here) for every compared field that differs."""
    out: list[tuple[str, object, object]] = []
    if manifest.format_version != FORMAT_VERSION:
        out.append(("format_version", manifest.format_version, FORMAT_VERSION))
    for f in COMPARED_FIELDS:
        a, b = getattr(manifest, f), getattr(target, f)
        if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
            a, b = list(a), list(b)
        if a != b:
            out.append((f, a, b))
    return out


def check_compatible(
    manifest: SnapshotManifest | str | os.PathLike, target: SnapshotTarget, path: str | os.PathLike | None = None
) -> SnapshotManifest:
    """Raise SnapshotMismatch unless the snapshot fits `target`; returns the manifest.
    `manifest` may also be a snapshot directory (its manifest is loaded). `path` names the
    snapshot in the message (default: its directory when one was given, else its id)."""
    if not isinstance(manifest, SnapshotManifest):
        path = manifest if path is None else path
        manifest = load_manifest(manifest)
    where = str(path) if path is not None else manifest.snapshot_id
    diffs = differences(manifest, target)
    if diffs:
        parts = [f"{f} is {_show(f, a)} in the snapshot, {_show(f, b)} here" for f, a, b in diffs]
        raise SnapshotMismatch(f"snapshot {where}: does not match this deployment: " + "; ".join(parts))
    return manifest


# ---- files --------------------------------------------------------------------------------------


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _check_name(name: str) -> str:
    p = Path(name)
    if not name or p.is_absolute() or ".." in p.parts or name != p.as_posix() or name == MANIFEST_NAME:
        raise ValueError(
            f"invalid snapshot file name {name!r} (a relative path inside the snapshot, not {MANIFEST_NAME})"
        )
    return name


def load_manifest(dir: str | os.PathLike) -> SnapshotManifest:
    """The manifest of the snapshot in `dir`; SnapshotCorrupt when there is none or it is invalid."""
    d = Path(dir)
    if not d.exists():
        raise SnapshotCorrupt(f"snapshot {d}: no such directory")
    if not d.is_dir():
        raise SnapshotCorrupt(f"snapshot {d}: not a directory")
    mpath = d / MANIFEST_NAME
    try:
        raw = mpath.read_bytes()
    except FileNotFoundError:
        raise SnapshotCorrupt(
            f"snapshot {d}: {MANIFEST_NAME} is missing (not a snapshot, or one whose manifest was deleted)"
        ) from None
    except OSError as e:
        raise SnapshotCorrupt(f"snapshot {d}: {mpath}: unreadable ({e.strerror or e})") from None
    try:
        return msgspec.json.decode(raw, type=SnapshotManifest)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise SnapshotCorrupt(f"snapshot {d}: {mpath}: invalid manifest ({e})") from None


def _files_on_disk(d: Path) -> set[str]:
    out = set()
    for root, _dirs, files in os.walk(d):
        for f in files:
            rel = (Path(root) / f).relative_to(d).as_posix()
            if rel != MANIFEST_NAME:
                out.add(rel)
    return out


def verify(dir: str | os.PathLike) -> SnapshotManifest:
    """Recompute every checksum; SnapshotCorrupt names the first bad file. Returns the manifest."""
    d = Path(dir)
    m = load_manifest(d)
    for name, digest in sorted(m.files.items()):
        f = d / name
        if not f.is_file():
            raise SnapshotCorrupt(f"snapshot {d}: {name}: missing (listed in {MANIFEST_NAME})")
        try:
            actual = sha256_file(f)
        except OSError as e:
            raise SnapshotCorrupt(f"snapshot {d}: {name}: unreadable ({e.strerror or e})") from None
        if actual != digest:
            raise SnapshotCorrupt(f"snapshot {d}: {name}: checksum mismatch (tampered or corrupt)")
    extra = sorted(_files_on_disk(d) - set(m.files))
    if extra:
        raise SnapshotCorrupt(f"snapshot {d}: {extra[0]}: unexpected file (not in {MANIFEST_NAME})")
    return m


def encode_manifest(m: SnapshotManifest) -> bytes:
    return msgspec.json.format(msgspec.json.encode(m), indent=2) + b"\n"


def check_destination(dir: str | os.PathLike, force: bool = False) -> bool:
    """Raise SnapshotExists unless a snapshot may be written to `dir`; True when it would replace
    an existing directory (only with `force`, and only an empty one or a snapshot)."""
    d = Path(dir)
    if not (d.exists() or d.is_symlink()):
        return False
    if d.is_symlink() or not d.is_dir():
        raise SnapshotExists(f"{d}: exists and is not a directory")
    if not force:
        raise SnapshotExists(f"{d}: already exists (use --force to replace it)")
    if any(d.iterdir()) and not (d / MANIFEST_NAME).is_file():
        raise SnapshotExists(f"{d}: exists and is not a snapshot (no {MANIFEST_NAME}); refusing to replace it")
    return True


def write_snapshot(
    dir: str | os.PathLike, manifest: SnapshotManifest, files: dict[str, bytes], force: bool = False
) -> SnapshotManifest:
    """Write `files` and the manifest (its `files` checksums filled in) to `dir`, atomically:
    everything goes to a temporary directory beside it that is renamed into place. An existing
    `dir` is refused unless `force`, and even then only when it is empty or a snapshot (so a
    mistyped path never wipes an unrelated directory). Returns the manifest as written."""
    d = Path(dir).absolute()
    for name in files:
        _check_name(name)
    replace = check_destination(d, force)
    d.parent.mkdir(parents=True, exist_ok=True)
    manifest = msgspec.structs.replace(
        manifest, files={n: hashlib.sha256(b).hexdigest() for n, b in sorted(files.items())}
    )
    tmp = Path(tempfile.mkdtemp(prefix=f".{d.name}.tmp-", dir=d.parent))
    try:
        for name, data in files.items():
            p = tmp / name
            p.parent.mkdir(parents=True, exist_ok=True)
            with open(p, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        with open(tmp / MANIFEST_NAME, "wb") as f:  # last: its presence means "complete"
            f.write(encode_manifest(manifest))
            f.flush()
            os.fsync(f.fileno())
        tmp.chmod(0o755)  # mkdtemp makes it private
        if replace:
            old = Path(tempfile.mkdtemp(prefix=f".{d.name}.old-", dir=d.parent))
            os.rename(d, old / "x")
            try:
                os.rename(tmp, d)
            except OSError:
                os.rename(old / "x", d)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            try:
                os.rename(tmp, d)
            except OSError as e:  # a concurrent writer created it (or it appeared empty)
                raise SnapshotExists(f"{d}: could not be created ({e.strerror or e})") from None
        try:
            dfd = os.open(d.parent, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except OSError:
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return manifest


def snapshot_size(dir: str | os.PathLike) -> int:
    total = 0
    for root, _, files in os.walk(dir):
        for f in files:
            try:
                total += (Path(root) / f).stat().st_size
            except OSError:
                pass
    return total
