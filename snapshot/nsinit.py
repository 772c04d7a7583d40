"""PID 1 of a restored copy's namespace: runs `criu restore -d`, becomes the copy's parent, and
reports how the copy ended.

    unshare --pid --fork --kill-child --mount-proc python -I -S nsinit.py --pid N --status FILE
        [--graph-fd FD --parent-fd FD --output-fd FD] -- criu restore -d ...

Why an init of our own rather than criu as PID 1 (`criu restore` without -d): criu reaps the
copy and exits with 0 however it ended, so a killed or failed copy looked like a clean exit.
With -d criu leaves the restored tree to the namespace's init, this process, which waits for the
copy and writes its exit code (waitstatus_to_exitcode: -N for signal N) to FILE, then exits with
it (128+N for a signal): the copy's status reaches whoever waits for `unshare`.

The copy dies with the namespace: the kernel kills every process in it once its init exits.
Given --graph-fd (a pidfd of the process the copy must not outlive: `dynamo serve`), this init
SIGTERMs the copy when that process is gone and exits after GRACE_S at most. It holds that pidfd,
a pidfd of the process that restored the copy (--parent-fd) and the graph's output (--output-fd)
at the fixed descriptors below, where the copy takes them (components.worker: pidfd_getfd on
PID 1, /proc/1/fd/OUTPUT_FD) to watch them as a cold joiner watches its graph and its router.

criu, and so the copy, run in a network namespace of their own, its loopback up (criu's kernel
probes connect over it): abstract unix socket names are per network namespace, and every copy
restores the ones the dumped process held (the CUDA driver holds one), which would collide in a
shared namespace. This init stays in the restorer's, where the copy finds it again
(snapshot.criu_image.join_restorer_network: /proc/1/ns/net).

Stdlib only, run with -I -S: it starts in tens of milliseconds.
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time

GRAPH_FD, PARENT_FD, OUTPUT_FD = 3, 4, 5
GRACE_S = 10.0
CLONE_NEWNET, SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x40000000, 0x8913, 0x8914, 0x1


def _libc(call: str, *args: int) -> None:
    """os.unshare / os.setns where Python has them (3.12), libc's otherwise."""
    if hasattr(os, call):
        getattr(os, call)(*args)
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if getattr(libc, call)(*args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{call}: {os.strerror(err)}")


def join_network(fd: int) -> None:
    """Move the calling thread into the network namespace that `fd` (an nsfs file) names."""
    _libc("setns", fd, CLONE_NEWNET)


def _own_network() -> None:
    """In criu's process, before it execs: a new network namespace with its loopback up."""
    _libc("unshare", CLONE_NEWNET)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = struct.unpack_from("16sH", fcntl.ioctl(s, SIOCGIFFLAGS, struct.pack("16sH14x", b"lo", 0)))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))


def _hold(fds: dict[int, int]) -> None:
    """Move each given descriptor (value; all above 15, snapshot.criu_image) to its fixed number
    (key)."""
    for k, v in fds.items():
        if v >= 0:
            os.dup2(v, k, inheritable=False)
            os.close(v)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--pid", type=int, required=True, help="the restored copy's PID (in this namespace)")
    p.add_argument("--status", required=True, help="file the copy's exit code is written to")
    p.add_argument("--graph-fd", type=int, default=-1)
    p.add_argument("--parent-fd", type=int, default=-1)
    p.add_argument("--output-fd", type=int, default=-1)
    p.add_argument("criu", nargs=argparse.REMAINDER)
    a = p.parse_args()
    argv = a.criu[1:] if a.criu[:1] == ["--"] else a.criu
    _hold({GRAPH_FD: a.graph_fd, PARENT_FD: a.parent_fd, OUTPUT_FD: a.output_fd})
    # criu gets the descriptors it is to hand the copy (--inherit-fd, all above 15), not these.
    r = subprocess.run(argv, stdin=subprocess.DEVNULL, close_fds=False, preexec_fn=_own_network)
    if r.returncode != 0:
        return r.returncode
    try:
        copy = os.pidfd_open(a.pid)
    except ProcessLookupError:  # resumed and already gone: its zombie is ours to reap
        copy = -1
    deadline = None
    watch = [copy] if copy >= 0 else []
    if a.graph_fd >= 0:
        watch.append(GRAPH_FD)
    while watch:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, _, _ = select.select(watch, [], [], timeout)
        if copy in ready:
            break
        if GRAPH_FD in ready:
            watch.remove(GRAPH_FD)
            os.kill(a.pid, signal.SIGTERM)
            deadline = time.monotonic() + GRACE_S
        elif not ready:  # the grace ran out: exiting kills the copy
            return 128 + signal.SIGKILL
    _, st = os.waitpid(a.pid, 0)
    code = os.waitstatus_to_exitcode(st)
    tmp = a.status + ".tmp"
    with open(tmp, "w") as f:
        f.write(str(code))
    os.rename(tmp, a.status)
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main())
