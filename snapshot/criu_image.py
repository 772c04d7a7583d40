"""One CRIU image of a process, restored as many times as needed, each copy in its own PID namespace.

    p = spawn([python, "worker.py"], log="start.log")   # its own session, stdio CRIU can dump
    m = dump(p, "img")                                   # kills it (leave_running=True keeps it)
    with restore("img", output=open("copy1.log", "ab")) as copy:
        ... copy.pid (as seen from here), copy.kill(), copy.wait()

What CRIU accepts, and why this module does what it does (measured with trixie's CRIU 4.1.1):

- The process must lead its own session (spawn() starts it so, as Popen(start_new_session=True)
  does): CRIU refuses a process whose session leader is not dumped with it, and a copy restored
  into a new PID namespace could not rejoin a session outside it. `--shell-job` would restore the
  copy into criu's session instead; nothing here needs that.
- A dumped process is killed by CRIU; its parent must reap it (dump() does, given the Popen).
- Each copy is `unshare --pid --kill-child --mount-proc nsinit criu restore -d`: snapshot.nsinit
  is PID 1 of a new namespace and, once criu is done, the copy's parent, so the copy keeps its
  original PID inside while any number of copies of one image run at once, and its exit status
  is known (criu as PID 1 would reap it and exit with 0 whatever it was). Killing that init kills
  the whole namespace, and --kill-child kills it when unshare dies. unshare dies with the process
  that restored, or, given `dies_with`, outlives it: the init then ends the copy when that
  process (the graph) is gone.
- A dumped process must not have a parent-death signal set: CRIU restores it, and with -d criu
  (the copy's first parent) exits right after the restore, which would deliver it.
- Open files are reopened by path at restore, and CRIU refuses a regular file whose size changed
  since the dump ("has bad size"): a log the original (or a first copy) kept writing to cannot be
  reopened. A pipe to a parent that is not dumped is dumped too, but restored as a pipe nobody reads
  (the copy's first write kills it with SIGPIPE). Both are solved by CRIU's `--inherit-fd`: the
  descriptor given to restore(output=...) takes the place of whatever the process's stdout and
  stderr were open on at the dump (a log file or a pipe alike), so each copy writes to its own.
  Its file position is the given descriptor's, not the dumped one's. That needs stdout/stderr on
  something other than stdin's file (all three on /dev/null cannot be told apart). restore(stdin=...)
  does the same for stdin: a process dumped while reading a pipe gets each copy's own pipe, the
  channel through which a copy learns who it is.
- Listening unix sockets are restored bound again. Abstract names belong to a network namespace:
  each copy is restored into a network namespace of its own (snapshot.nsinit runs criu in one), so
  copies never collide on them, and a copy calls join_restorer_network() before it opens any
  socket of its own, to reach its peers where they are. Names in the filesystem are shared by
  every copy: a process meant to be copied opens such sockets after the restore (e.g. on a
  signal) and closes them before the dump. Held file locks need `--file-locks`, and
  established TCP connections `--tcp-established`; neither is passed (a worker holds none when
  it is dumped).
- A process with a NIXL agent open is refused: UCX keeps a deleted shared-memory file
  (/dev/shm/ucx_shm_posix_*, 4 MiB) over CRIU's limit for such files. The engine rank drops its
  agent first (comm.suspend()) and opens a new one after the restore (comm.resume()).
- A CUDA process is dumped after snapshot.cuda_checkpoint.checkpoint() moved its GPU memory to
  the host, and restored before cuda_checkpoint.restore() (no CRIU plugin). The driver holds an
  abstract unix socket named after the dumped process (`@cuda-uvmfd-<pid namespace>-<pid>@`):
  in one network namespace a second concurrent copy failed to bind it (H200); the copy's own
  network namespace is what avoids that.

Every image file's sha256 is written to criu-image.json at the dump; restore() refuses an image
whose files do not match it, naming the file.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated

import msgspec

from components.graph.spawn import die_with_parent, graph_output
from snapshot.criu import criu_version, find_criu
from snapshot.manifest import SnapshotCorrupt, SnapshotError, _open_member, check_files, open_dir
from snapshot.nsinit import join_network

IMAGE_MANIFEST = "criu-image.json"
DUMP_LOG = "dump.log"
RESTORE_LOG = "restore.log"
RESUMED = "resumed"  # written by the post-resume action script: the copy's PID inside its namespace
EXIT_STATUS = "exit"  # written by snapshot.nsinit: the copy's exit code
NSINIT = Path(__file__).with_name("nsinit.py")
MANIFEST_MAX_BYTES = 1 << 20
# Logged by criu in every run as root inside a PID namespace, and harmless.
_NOISE = ("RLIMIT_NOFILE",)
# Runs inside the copy's namespace once its tasks have resumed (CRIU's post-resume action).
_ACTION_SCRIPT = f"""#!/bin/sh
[ "$CRTOOLS_SCRIPT_ACTION" = post-resume ] || exit 0
d=$(dirname "$0")
echo "$CRTOOLS_INIT_PID" > "$d/{RESUMED}.tmp" && mv "$d/{RESUMED}.tmp" "$d/{RESUMED}"
"""


class CriuError(SnapshotError):
    """A criu dump or restore failed; the message carries criu's first error and its log's path."""


class ImageManifest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What dump() wrote: its cost, and what restore() needs to check and rewire."""

    files: dict[str, Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$")]]  # image file name -> sha256
    image_bytes: int
    seconds: float
    pid: int  # the dumped process; every copy has it inside its namespace
    criu_version: str
    # CRIU's names of what fds 0, 1 and 2 were open on ("dev/null", "tmp/x.log", "pipe:[123]"): the
    # resources restore(output=...) hands another descriptor for.
    stdio: list[str]


def _resource(pid: int, fd: int) -> str:
    """CRIU's --inherit-fd name for what `fd` of `pid` is open on: a path without its leading
    slash, or the kernel's "pipe:[inode]"/"socket:[inode]"."""
    target = os.readlink(f"/proc/{pid}/fd/{fd}")
    return target[1:] if target.startswith("/") else target


def _first_error(log: Path) -> str:
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    errors = [ln.strip() for ln in lines if ln.startswith("Error") and not any(n in ln for n in _NOISE)]
    return errors[0] if errors else (lines[-1].strip() if lines else "(empty log)")


def spawn(
    argv: list[str], log: str | os.PathLike, env: dict | None = None, cwd=None, stdin: int | None = None
) -> subprocess.Popen:
    """Start a process that dump() can checkpoint and restore(output=...) can give a new output:
    its own session, stdout and stderr appended to the file `log`, stdin on /dev/null or the
    descriptor `stdin` (the read end of a pipe: restore(stdin=...) hands each copy its own)."""
    with open(log, "ab") as out:
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL if stdin is None else stdin,
            stdout=out,
            stderr=out,
            start_new_session=True,
            env=env,
            cwd=cwd,
        )


def dump(
    proc: int | subprocess.Popen, dir: str | os.PathLike, leave_running: bool = False, criu: str | None = None
) -> ImageManifest:
    """Checkpoint the process (and its children) into the new or empty directory `dir`, then write
    the checksum manifest. Without `leave_running` the process is killed (and reaped, when given as
    the Popen that started it). CriuError when criu fails (the process then keeps running)."""
    criu = criu or find_criu()
    if not criu:
        raise CriuError("criu not found (`make install` unpacks it into .venv)")
    pid = proc.pid if isinstance(proc, subprocess.Popen) else proc
    d = Path(dir)
    d.mkdir(parents=True, exist_ok=True)
    if any(d.iterdir()):
        raise CriuError(f"CRIU image {d}: not empty; dump into a new directory")
    try:
        stdio = [_resource(pid, fd) for fd in (0, 1, 2)]
    except OSError as e:
        raise CriuError(f"pid {pid}: cannot read its stdio ({e.strerror or e}); is it running?") from None
    cmd = [criu, "dump", "-t", str(pid), "-D", str(d), "-o", DUMP_LOG]
    if leave_running:
        cmd.append("--leave-running")
    t0 = time.perf_counter()
    r = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    seconds = time.perf_counter() - t0
    if r.returncode != 0:
        why = _first_error(d / DUMP_LOG) if (d / DUMP_LOG).exists() else r.stderr.decode(errors="replace").strip()
        raise CriuError(f"criu dump of pid {pid} failed: {why} (log: {d / DUMP_LOG})")
    if isinstance(proc, subprocess.Popen) and not leave_running:
        proc.wait()
    files, total = {}, 0
    for p in sorted(d.iterdir()):
        if p.name != DUMP_LOG:
            with open(p, "rb") as f:
                files[p.name] = hashlib.file_digest(f, "sha256").hexdigest()
            total += p.stat().st_size
    got = criu_version(criu)
    m = ImageManifest(
        files=files, image_bytes=total, seconds=seconds, pid=pid, criu_version=got[1] if got else "", stdio=stdio
    )
    tmp = d / f".{IMAGE_MANIFEST}.tmp"
    tmp.write_bytes(msgspec.json.format(msgspec.json.encode(m), indent=2) + b"\n")
    tmp.rename(d / IMAGE_MANIFEST)
    return m


def verify_image(dir: str | os.PathLike, checksums: bool = True) -> ImageManifest:
    """The image's manifest, once every file matches its checksum and no file was added;
    SnapshotCorrupt names the first file that does not. Without `checksums`, the manifest only
    (for a caller that verified the files already)."""
    d = Path(dir)
    label = f"CRIU image {d}"
    dfd = open_dir(d, "CRIU image")
    try:
        try:
            fd = _open_member(dfd, IMAGE_MANIFEST, f"{label}: {IMAGE_MANIFEST}")
        except FileNotFoundError:
            raise SnapshotCorrupt(f"{label}: {IMAGE_MANIFEST} is missing (not an image written by dump())") from None
        with open(fd, "rb") as f:
            raw = f.read(MANIFEST_MAX_BYTES + 1)
        try:
            if len(raw) > MANIFEST_MAX_BYTES:
                raise msgspec.DecodeError(f"over {MANIFEST_MAX_BYTES} bytes")
            m = msgspec.json.decode(raw, type=ImageManifest)
        except (msgspec.ValidationError, msgspec.DecodeError) as e:
            raise SnapshotCorrupt(f"{label}: {IMAGE_MANIFEST}: invalid ({e})") from None
        bad = [n for n in m.files if "/" in n or n in ("", ".", "..")]
        if bad:
            raise SnapshotCorrupt(f"{label}: {IMAGE_MANIFEST}: invalid (lists {bad[0]!r}, not a file of the image)")
        if checksums:
            check_files(dfd, label, m.files, IMAGE_MANIFEST, unlisted={DUMP_LOG})
    finally:
        os.close(dfd)
    return m


class Restored:
    """A copy restored by restore(): `pid` as seen from here, `ns_pid` inside its namespace (the
    dumped process's), `workdir` with criu's restore.log. Use it as a context manager, or call
    close(): the copy is killed if still running and its workdir removed."""

    def __init__(self, unshare: subprocess.Popen, init_pidfd: int, pid: int, ns_pid: int, workdir: Path):
        self._unshare = unshare
        self._init_pidfd = init_pidfd  # PID 1 of the copy's namespace; a pidfd never hits a reused pid
        self._code: int | None = None
        self.pid, self.ns_pid, self.workdir = pid, ns_pid, workdir

    def running(self) -> bool:
        return self._unshare.poll() is None

    @property
    def returncode(self) -> int | None:
        """None while the copy runs; once it ended, its exit code as Popen gives one (-N: killed
        by signal N). A copy that the namespace's end killed (its init was killed, or gave up
        waiting for it) has -9."""
        return self._settle()

    def _settle(self) -> int | None:
        if self._code is None and self._unshare.poll() is not None:
            try:
                self._code = int((self.workdir / EXIT_STATUS).read_text())
            except (OSError, ValueError):
                self._code = -signal.SIGKILL
        return self._code

    def wait(self, timeout: float | None = None) -> int:
        """Until the copy has ended (subprocess.TimeoutExpired after `timeout` seconds); its code."""
        self._unshare.wait(timeout)
        return self.returncode

    def kill(self) -> None:
        """Kill the copy and everything else in its namespace, and wait until all of it has ended."""
        if self._init_pidfd >= 0:
            try:
                signal.pidfd_send_signal(self._init_pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass
            # Readable once that init has exited, which the kernel lets it do only after every
            # other process of its namespace has.
            select.select([self._init_pidfd], [], [])
        self._unshare.wait()

    def close(self) -> None:
        self.kill()
        self._settle()  # before its status file goes
        if self._init_pidfd >= 0:
            os.close(self._init_pidfd)
            self._init_pidfd = -1
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> Restored:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _children(pid: int) -> list[int]:
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except (OSError, ValueError):
        return []


def _ns_pid(pid: int) -> int | None:
    """`pid`'s PID in its innermost namespace."""
    try:
        for ln in Path(f"/proc/{pid}/status").read_text().splitlines():
            if ln.startswith("NSpid:"):
                return int(ln.split()[-1])
    except (OSError, ValueError):
        pass
    return None


def _descendants(pid: int, depth: int) -> list[int]:
    kids = _children(pid)
    return kids + [g for k in kids for g in (_descendants(k, depth - 1) if depth > 1 else [])]


def _dup_high(fd: int) -> int:
    """A duplicate of `fd` clear of the descriptors snapshot.nsinit moves what it holds to."""
    return fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 16)


def restore(
    dir: str | os.PathLike,
    output=None,
    stdin=None,
    criu: str | None = None,
    timeout: float = 60.0,
    manifest: ImageManifest | None = None,
    dies_with: int = 0,
) -> Restored:
    """Verify the image's checksums, then restore a copy into a new PID namespace and return once
    it runs. `output`, a file object or descriptor, replaces what the process's stdout and stderr
    were open on at the dump; `stdin` what its stdin was. `manifest`: the image's, its checksums
    verified already by the caller (verify_image). The copy dies with the process calling this,
    or, given `dies_with` (a pid: the graph), with that process instead, outliving this one (its
    namespace's init then holds what the copy watches: snapshot.nsinit). CriuError (with criu's
    first error) when the restore fails; SnapshotCorrupt when the image does not match its
    manifest."""
    criu = criu or find_criu()
    if not criu:
        raise CriuError("criu not found (`make install` unpacks it into .venv)")
    d = Path(dir).absolute()
    m = manifest or verify_image(d)
    inherit: list[str] = []
    fds: list[int] = []
    if stdin is not None:
        fds.append(_dup_high(stdin if isinstance(stdin, int) else stdin.fileno()))
        inherit += ["--inherit-fd", f"fd[{fds[-1]}]:{m.stdio[0]}"]
    if output is not None:
        fd = output if isinstance(output, int) else output.fileno()
        for res in dict.fromkeys(m.stdio[1:]):
            if res == m.stdio[0]:
                for f in fds:
                    os.close(f)
                raise CriuError(
                    f"CRIU image {d}: stdout/stderr were on stdin's file ({res}) at the dump, so they cannot "
                    "be given another output (start the process with spawn())"
                )
            fds.append(_dup_high(fd))
            inherit += ["--inherit-fd", f"fd[{fds[-1]}]:{res}"]
    workdir = Path(tempfile.mkdtemp(prefix="criu-restore-"))
    script = workdir / "post-resume.sh"
    script.write_text(_ACTION_SCRIPT)
    script.chmod(0o755)
    init = [sys.executable, "-I", "-S", str(NSINIT), "--pid", str(m.pid), "--status", str(workdir / EXIT_STATUS)]
    held: list[int] = []
    if dies_with:
        try:
            opened = [os.pidfd_open(dies_with), os.pidfd_open(os.getpid()), graph_output(dies_with)]
        except ProcessLookupError:
            for f in fds:
                os.close(f)
            raise CriuError(f"criu restore of {d}: pid {dies_with}, which the copy is to die with, is gone") from None
        held = [_dup_high(f) for f in opened]
        for f in opened:
            os.close(f)
        init += ["--graph-fd", str(held[0]), "--parent-fd", str(held[1]), "--output-fd", str(held[2])]
    cmd = ["unshare", "--pid", "--kill-child", "--mount-proc", *init, "--", criu, "restore", "-d", "-D", str(d)]
    cmd += ["-W", str(workdir), "-o", RESTORE_LOG, "--action-script", str(script), *inherit]
    try:
        with open(workdir / "unshare.err", "wb") as err:
            # unshare and the namespace's init die with us (PDEATHSIG, --kill-child), or with the
            # graph (`dies_with`, watched by that init; its own session: no signal to our
            # process group reaches it).
            unshare = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
                pass_fds=fds + held,
                start_new_session=bool(dies_with),
                preexec_fn=None if dies_with else functools.partial(die_with_parent, signal.SIGKILL),
            )
    finally:
        for fd in fds + held:
            os.close(fd)
    deadline = time.monotonic() + timeout
    while not (workdir / RESUMED).exists():
        if unshare.poll() is not None or time.monotonic() > deadline:
            if unshare.poll() is None:
                unshare.kill()
                unshare.wait()
                why = f"not resumed after {timeout:.0f} s"
            else:
                log = workdir / RESTORE_LOG
                why = _first_error(log) if log.exists() else (workdir / "unshare.err").read_text().strip()
            raise CriuError(f"criu restore of {d} failed: {why} (logs: {workdir})")
        time.sleep(0.005)
    ns_pid = int((workdir / RESUMED).read_text())
    # The copy is criu's child until criu exits, then the init's: a look at the tree in between
    # can miss it.
    for _ in range(200):
        inits = _children(unshare.pid)
        pids = [c for c in (_descendants(inits[0], 2) if inits else []) if _ns_pid(c) == ns_pid]
        if len(inits) == 1 and len(pids) == 1 or unshare.poll() is not None:
            break
        time.sleep(0.005)
    if len(inits) != 1 or len(pids) != 1:
        unshare.kill()
        unshare.wait()
        raise CriuError(f"criu restore of {d}: the restored process (pid {ns_pid} inside) was not found")
    return Restored(unshare, os.pidfd_open(inits[0]), pids[0], ns_pid, workdir)


def join_restorer_network() -> bool:
    """In a copy restore() made: move the calling thread, and every thread it starts from now on,
    out of the copy's own network namespace into the one it was restored from, where discovery
    and peers are (its PID namespace's init, snapshot.nsinit, stayed there). Call it before
    starting threads or opening sockets: threads restored from the image, and the sockets it
    held, stay where they were restored. Returns whether it moved (False: not such a copy)."""
    ours, init = os.stat("/proc/thread-self/ns/net"), os.stat("/proc/1/ns/net")
    if (ours.st_dev, ours.st_ino) == (init.st_dev, init.st_ino):
        return False
    fd = os.open("/proc/1/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        join_network(fd)
    finally:
        os.close(fd)
    return True
