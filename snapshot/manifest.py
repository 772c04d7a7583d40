"""Snapshot manifest: what a snapshot was baked for, and the checksums of its files.

A snapshot is a directory: ``manifest.json`` plus the files it lists (relative path -> sha256).
It is written atomically (temporary directory + rename), so a directory that holds a
``manifest.json`` was completely written; ``verify`` recomputes the checksums to catch later
damage. Reading one trusts nothing in it: only regular files inside the directory are read, every
path component opened without following symbolic links, so a manifest that names ``../x`` or a
file replaced by a link, FIFO or device is refused by name instead of read, followed or blocked
on. A joiner accepts a snapshot only when ``check_compatible`` finds every field that shapes
the restored state (model, parallel config, GPU type, driver, graph shapes) equal to what its
deployment expects; the error names every field that differs, with both values.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Annotated, Literal

import msgspec

FORMAT_VERSION = 2
MANIFEST_NAME = "manifest.json"
MANIFEST_MAX_BYTES = 1 << 20  # a real one is ~1 KiB; more is not a manifest, and is not read whole
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
    batch_invariant: bool = True  # the scheduling policy is built into a baked engine
    # The MoE exchange, resolved (rank.ep_transport): every rank of a group must run the same one.
    # Snapshots from before the field were all "nixl" (the criu tier refused the windows on CUDA).
    ep_transport: str = "nixl"


class SnapshotManifest(SnapshotTarget, kw_only=True, forbid_unknown_fields=True):
    """A snapshot: what it was baked for (the SnapshotTarget fields) and what it holds."""

    format_version: int = FORMAT_VERSION
    snapshot_id: str
    created: str  # ISO 8601, UTC
    tier: Tier = "artifacts"
    model_name: str
    architecture: str
    warmup_seconds: float = 0.0
    # relative path -> sha256 of every other file in the snapshot dir
    files: dict[str, Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$")]] = {}
    weights_included: bool = False
    # The criu tier: the CRIU that dumped <snapshot>/criu, the image's size, and the bake's
    # seconds up to the dump.
    criu_version: str = ""
    cuda_version: str = ""  # torch.version.cuda of the worker baked on CUDA (device and driver: compared fields)
    image_bytes: int = 0
    bake_seconds: float = 0.0


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

_KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFLNK: "a symbolic link",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: a FIFO swapped in between the lstat and the open must not wait for a writer.
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _check_name(name: str) -> str:
    p = Path(name)
    if (
        not p.parts
        or "\0" in name
        or p.is_absolute()
        or ".." in p.parts
        or name != p.as_posix()
        or name == MANIFEST_NAME
    ):
        raise ValueError(
            f"invalid snapshot file name {name!r} (a relative path inside the snapshot, not {MANIFEST_NAME})"
        )
    return name


def open_dir(d: Path, what: str = "snapshot") -> int:
    """A descriptor of the directory `d`; SnapshotCorrupt "`what` `d`: why" when it is none."""
    try:
        return os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise SnapshotCorrupt(f"{what} {d}: no such directory") from None
    except NotADirectoryError:
        raise SnapshotCorrupt(f"{what} {d}: not a directory") from None
    except OSError as e:
        raise SnapshotCorrupt(f"{what} {d}: unreadable ({e.strerror or e})") from None


def _open_member(dfd: int, name: str, where: str) -> int:
    """A read-only descriptor of the regular file `name` (a _check_name'd relative path) below the
    directory `dfd`. Each component is lstat'ed, then opened relative to its parent with
    O_NOFOLLOW, so nothing outside the directory is reached and only a regular file is ever opened
    (a device never is). FileNotFoundError when it is missing; SnapshotCorrupt `where: why` else."""
    parts = name.split("/")
    opened: list[int] = []
    try:
        at = dfd
        for i, part in enumerate(parts):
            mode = os.stat(part, dir_fd=at, follow_symlinks=False).st_mode
            last = i == len(parts) - 1
            if not (stat.S_ISREG(mode) if last else stat.S_ISDIR(mode)):
                what = "" if last else "/".join(parts[: i + 1]) + " is "
                want = "a regular file" if last else "a directory"
                raise SnapshotCorrupt(f"{where}: {what}{_KINDS.get(stat.S_IFMT(mode), 'special')}, not {want}")
            at = os.open(part, _FILE_FLAGS if last else _DIR_FLAGS, dir_fd=at)
            opened.append(at)
        if not stat.S_ISREG(os.fstat(at).st_mode):  # replaced between the lstat and the open
            raise SnapshotCorrupt(f"{where}: changed while it was opened, not a regular file")
        return opened.pop()
    except FileNotFoundError:
        raise
    except OSError as e:  # ELOOP: a link swapped in between the lstat and the open
        raise SnapshotCorrupt(f"{where}: unreadable ({e.strerror or e})") from None
    finally:
        for fd in opened:
            os.close(fd)


def _load(dfd: int, d: Path) -> SnapshotManifest:
    where = f"snapshot {d}: {MANIFEST_NAME}"
    try:
        fd = _open_member(dfd, MANIFEST_NAME, where)
    except FileNotFoundError:
        raise SnapshotCorrupt(
            f"snapshot {d}: {MANIFEST_NAME} is missing (not a snapshot, or one whose manifest was deleted)"
        ) from None
    try:
        with open(fd, "rb") as f:
            raw = f.read(MANIFEST_MAX_BYTES + 1)
    except OSError as e:
        raise SnapshotCorrupt(f"{where}: unreadable ({e.strerror or e})") from None
    if len(raw) > MANIFEST_MAX_BYTES:
        raise SnapshotCorrupt(f"{where}: over {MANIFEST_MAX_BYTES} bytes, not a snapshot manifest")
    try:
        m = msgspec.json.decode(raw, type=SnapshotManifest)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise SnapshotCorrupt(f"{where}: invalid manifest ({e})") from None
    for name in m.files:
        try:
            _check_name(name)
        except ValueError:
            raise SnapshotCorrupt(
                f"{where}: invalid manifest (lists {name!r}, not a relative path inside the snapshot)"
            ) from None
    return m


def load_manifest(dir: str | os.PathLike) -> SnapshotManifest:
    """The manifest of the snapshot in `dir`; SnapshotCorrupt when there is none or it is invalid."""
    d = Path(dir)
    dfd = open_dir(d)
    try:
        return _load(dfd, d)
    finally:
        os.close(dfd)


def _entries(dfd: int, prefix: str = "") -> set[str]:
    """Relative paths of everything below `dfd` but directories (so links, FIFOs and devices are
    listed too), walked without following links."""
    out = set()
    with os.scandir(dfd) as it:
        for e in it:
            if e.is_dir(follow_symlinks=False):
                sub = os.open(e.name, _DIR_FLAGS, dir_fd=dfd)
                try:
                    out |= _entries(sub, f"{prefix}{e.name}/")
                finally:
                    os.close(sub)
            else:
                out.add(prefix + e.name)
    return out


# Files whose sha256 this process computed, by what identifies that content on disk: device,
# inode, size, modification and change times. Any write changes the change time, which no call
# can set back, so an unchanged key is the same content and its hash is not recomputed (a CUDA
# image of GBs takes seconds to hash; each joiner restored from it checks it again).
_hashed: dict[tuple[int, ...], str] = {}


def _content_key(fd: int) -> tuple[int, ...]:
    st = os.fstat(fd)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def check_files(dfd: int, label: str, files: dict[str, str], manifest_name: str, unlisted=frozenset()) -> None:
    """Check the sha256 of every file `files` lists below the open directory `dfd` (recomputed
    unless this process hashed that very content before), and refuse any file it does not list
    (but the manifest `manifest_name` and the top-level names in `unlisted`); SnapshotCorrupt
    names the first bad file ("`label`: name: why")."""
    for name, digest in sorted(files.items()):
        where = f"{label}: {name}"
        try:
            fd = _open_member(dfd, name, where)
        except FileNotFoundError:
            raise SnapshotCorrupt(f"{where}: missing (listed in {manifest_name})") from None
        try:
            with open(fd, "rb") as f:
                key = _content_key(f.fileno())
                actual = _hashed.get(key) or hashlib.file_digest(f, "sha256").hexdigest()
        except OSError as e:
            raise SnapshotCorrupt(f"{where}: unreadable ({e.strerror or e})") from None
        _hashed[key] = actual
        if actual != digest:
            raise SnapshotCorrupt(f"{where}: checksum mismatch (tampered or corrupt)")
    try:
        extra = sorted(_entries(dfd) - set(files) - {manifest_name, *unlisted})
    except OSError as e:
        raise SnapshotCorrupt(f"{label}: unreadable ({e.strerror or e})") from None
    if extra:
        raise SnapshotCorrupt(f"{label}: {extra[0]}: unexpected file (not in {manifest_name})")


def verify(dir: str | os.PathLike) -> SnapshotManifest:
    """Recompute every checksum; SnapshotCorrupt names the first bad file. Returns the manifest."""
    d = Path(dir)
    dfd = open_dir(d)
    try:
        m = _load(dfd, d)
        check_files(dfd, f"snapshot {d}", m.files, MANIFEST_NAME)
    finally:
        os.close(dfd)
    return m


def encode_manifest(m: SnapshotManifest) -> bytes:
    return msgspec.json.format(msgspec.json.encode(m), indent=2) + b"\n"


def check_creatable(dir: str | os.PathLike) -> None:
    """Raise SnapshotError unless a directory can be made at `dir` (in it, when it is a directory
    already): its nearest existing ancestor must be a directory this process can write to. Tried
    (a directory made there and removed) rather than guessed from permission bits, which root
    ignores while /proc, read-only mounts and the like still refuse."""
    p = Path(dir).absolute()
    while not os.path.lexists(p):
        p = p.parent
    if not p.is_dir():
        raise SnapshotError(f"{dir}: cannot be created: {p} is not a directory")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".probe-", dir=p))
    except OSError as e:
        raise SnapshotError(f"{dir}: cannot be created: {p} is not writable ({e.strerror or e})") from None


def check_destination(dir: str | os.PathLike, force: bool = False) -> bool:
    """Raise SnapshotError (SnapshotExists when something is in the way) unless a snapshot may be
    written to `dir`; True when it would replace an existing directory (only with `force`, and only
    an empty one or a snapshot)."""
    d = Path(dir)
    if not (d.exists() or d.is_symlink()):
        check_creatable(d)
        return False
    if d.is_symlink() or not d.is_dir():
        raise SnapshotExists(f"{d}: exists and is not a directory")
    if not force:
        raise SnapshotExists(f"{d}: already exists (use --force to replace it)")
    manifest = d / MANIFEST_NAME
    if any(d.iterdir()) and not (manifest.is_file() and not manifest.is_symlink()):
        raise SnapshotExists(f"{d}: exists and is not a snapshot (no {MANIFEST_NAME}); refusing to replace it")
    check_creatable(d.parent)
    return True


def write_snapshot(
    dir: str | os.PathLike,
    manifest: SnapshotManifest,
    files: dict[str, bytes],
    force: bool = False,
    trees: dict[str, Path] | None = None,
) -> SnapshotManifest:
    """Write `files` and the manifest (its `files` checksums filled in) to `dir`, atomically:
    everything goes to a temporary directory beside it that is renamed into place. `trees`:
    directories moved in under the given names (a CRIU image, too large to hold in memory), every
    file in them listed with its checksum. An existing `dir` is refused unless `force`, and even
    then only when it is empty or a snapshot (so a mistyped path never wipes an unrelated
    directory). Returns the manifest as written."""
    d = Path(dir).absolute()
    trees = trees or {}
    for name in [*files, *trees]:
        _check_name(name)
    replace = check_destination(d, force)
    d.parent.mkdir(parents=True, exist_ok=True)
    sums = {n: hashlib.sha256(b).hexdigest() for n, b in files.items()}
    tmp = Path(tempfile.mkdtemp(prefix=f".{d.name}.tmp-", dir=d.parent))
    try:
        for name, src in trees.items():
            shutil.move(src, tmp / name)
            for p in sorted((tmp / name).rglob("*")):
                if p.is_file():
                    with open(p, "rb") as f:
                        sums[p.relative_to(tmp).as_posix()] = hashlib.file_digest(f, "sha256").hexdigest()
        manifest = msgspec.structs.replace(manifest, files=dict(sorted(sums.items())))
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
                total += os.lstat(Path(root) / f).st_size  # a link's own size: never followed
            except OSError:
                pass
    return total
