"""Starting a component's process: the one place that does it, for `dynamo serve` and for the
joining ranks the router starts. Each process leads its own process group (a signal reaches its
whole tree, a Ctrl-C in the terminal does not), dies with its parent (the kernel SIGTERMs it when
the process that started it is gone, even by SIGKILL) unless it is to outlive it (a joiner the
router started: it dies with the graph instead, `GRAPH_PID_ENV`), and has its output prefixed with
its label."""

from __future__ import annotations

import asyncio
import collections
import os
import signal
import sys

from components.graph.component import ProcessSpec

TAIL_LINES = 20


class Child:
    """A started process, its output pump, and its last lines of output."""

    def __init__(self, spec: ProcessSpec, proc: asyncio.subprocess.Process) -> None:
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
        prefix = f"[{self.label}] "
        while True:
            try:
                raw = await stream.readline()
            except ValueError:  # a line beyond the reader's limit: take what is buffered
                raw = await stream.read(1 << 16)
            if not raw:
                return
            line = raw.decode(errors="replace").rstrip("\n")
            self.tail.append(line)
            sys.stdout.write(prefix + line + "\n")
            sys.stdout.flush()


def _die_with_parent() -> None:
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


async def spawn(spec: ProcessSpec, env: dict[str, str], die_with_parent: bool = True) -> Child:
    """Start `spec` with `env` (its own `spec.env` on top); OSError when it cannot be started."""
    proc = await asyncio.create_subprocess_exec(
        *spec.argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env={**env, **spec.env},
        start_new_session=True,
        preexec_fn=_die_with_parent if die_with_parent else None,
        limit=1 << 20,
    )
    return Child(spec, proc)
