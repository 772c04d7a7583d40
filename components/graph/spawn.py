"""Starting a component's process: the one place that does it, for `dynamo serve` and for the
joining ranks the router starts. Each process leads its own process group (a signal reaches its
whole tree, a Ctrl-C in the terminal does not), dies with its parent (the kernel SIGTERMs it when
the process that started it is gone, even by SIGKILL) unless it is to outlive it (a joiner the
router started: it dies with the graph instead, `GRAPH_PID_ENV`), and has its output prefixed with
its label."""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import signal
import stat
import sys

from components.graph.component import LOG_FORMAT, ProcessSpec

TAIL_LINES = 20
# Dynamo pins its `request_span` target to trace (a request id then reaches every line), which
# lets an INFO line per routed call through whatever DYN_LOG says: for the router's status
# probes, a line per rank per second. Dropped unless DYN_LOG asks for info or more.
ROUTE_NOISE = "request_span: route request completed"


def _quiet() -> bool:
    return os.environ.get("DYN_LOG", "warn").split(",")[0].strip().lower() in ("warn", "error", "off")


class Child:
    """A started process, its output pump, and its last lines of output."""

    def __init__(self, spec: ProcessSpec, proc: asyncio.subprocess.Process | RestoredProcess) -> None:
        self.spec, self.proc = spec, proc
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        assert proc.stdout is not None
        self.pump = asyncio.create_task(self._pump(proc.stdout))

    @property
    def label(self) -> str:
        return self.spec.label

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.returncode is None

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    async def _pump(self, stream: asyncio.StreamReader) -> None:
        prefix, quiet = f"[{self.label}] ", _quiet()
        while True:
            try:
                raw = await stream.readline()
            except ValueError:  # a line beyond the reader's limit: take what is buffered
                raw = await stream.read(1 << 16)
            if not raw:
                return
            line = raw.decode(errors="replace").rstrip("\n")
            if quiet and ROUTE_NOISE in line:
                continue
            self.tail.append(line)
            sys.stdout.write(prefix + line + "\n")
            sys.stdout.flush()


class RestoredProcess:
    """A process restored from a CRIU image (snapshot.criu_image.Restored) as Child sees a
    process: its pid from here, its exit status, wait(), and the pipe its output comes through."""

    def __init__(self, restored, stdout: asyncio.StreamReader) -> None:
        self.restored, self.stdout = restored, stdout

    @property
    def pid(self) -> int:
        return self.restored.pid

    @property
    def returncode(self) -> int | None:
        return self.restored.returncode

    async def wait(self) -> int | None:
        while self.restored.running():
            await asyncio.sleep(0.05)
        self.restored.close()  # reaped; its restore workdir removed
        return self.returncode


async def adopt(spec: ProcessSpec, restored, output_fd: int) -> Child:
    """A Child for a process restored from a CRIU image whose output goes to the pipe read end
    `output_fd` (taken over: closed with the reader)."""
    reader = asyncio.StreamReader(limit=1 << 20)
    loop = asyncio.get_running_loop()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(output_fd, "rb", 0))
    return Child(spec, RestoredProcess(restored, reader))


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Have the kernel send `sig` to this process once its parent is gone."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def graph_output(graph: int) -> int:
    """A descriptor on `graph`'s stdout for a process that must write there once its own reader
    is gone: a pipe or a terminal takes lines from two writers, but a regular file opened by
    someone else would have them overwritten at its writer's offset (then /dev/null)."""
    out = f"/proc/{graph}/fd/1"
    try:
        if not stat.S_ISREG(os.stat(out).st_mode):
            return os.open(out, os.O_WRONLY | os.O_CLOEXEC)
    except OSError:
        pass
    return os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)


def write_output_to(fd: int, label: str) -> None:
    """From now on write this process's output to `fd` (taken), each log line labelled as
    `dynamo serve` labels a child's: for a process whose output's reader is gone."""
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    for h in logging.getLogger().handlers:
        h.setFormatter(logging.Formatter(f"[{label}] {LOG_FORMAT}"))


async def spawn(spec: ProcessSpec, env: dict[str, str], with_parent: bool = True) -> Child:
    """Start `spec` with `env` (its own `spec.env` on top); OSError when it cannot be started."""
    proc = await asyncio.create_subprocess_exec(
        *spec.argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env={**env, **spec.env},
        start_new_session=True,
        preexec_fn=die_with_parent if with_parent else None,
        limit=1 << 20,
    )
    return Child(spec, proc)
