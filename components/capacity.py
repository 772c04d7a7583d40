"""Capacity providers: where the processes of joining ranks come from.

The router asks for ranks by number and later gives them back; how a rank's process comes to
exist (a local process, a restored snapshot, a Kubernetes pod) is the provider's business.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
from typing import Protocol

from components.component import COMPONENT_ENV, GRAPH_ENV, GraphContext, encode_context
from components.worker import FAULT_ENV, Worker

log = logging.getLogger("components.capacity")


class CapacityProvider(Protocol):
    async def acquire(self, ranks: list[int], op: str, fault: str = "") -> None:
        """Start a joining worker process for each rank (it registers itself with Dynamo)."""

    def alive(self, rank: int) -> bool | None:
        """False once a rank this provider started has died; None for ranks it did not start."""

    async def release(self, rank: int, op: str, graceful: bool = True) -> None:
        """Make sure the rank's process is gone: after it was asked to exit (`graceful`: give it
        time), or at once to abort."""

    async def close(self) -> None: ...


class LocalProvider:
    """Joining ranks as processes on this host, output prefixed like `dynamo serve` does."""

    def __init__(self, ctx: GraphContext):
        self.ctx = ctx
        self.procs: dict[int, subprocess.Popen] = {}
        self._pumps: dict[int, asyncio.Task] = {}

    async def acquire(self, ranks: list[int], op: str, fault: str = "") -> None:
        for rank in ranks:
            spec = Worker.rank_process(rank, join=True)
            env = {**os.environ, **spec.env, GRAPH_ENV: encode_context(self.ctx), COMPONENT_ENV: "Worker",
                   "PYTHONUNBUFFERED": "1"}
            env.pop(FAULT_ENV, None)
            if fault:
                env[FAULT_ENV] = fault
            proc = subprocess.Popen(spec.argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            self.procs[rank] = proc
            self._pumps[rank] = asyncio.create_task(self._pump(spec.label, proc))
            log.info("[op %s] started %s (pid %d)%s", op, spec.label, proc.pid, f" with fault {fault}" if fault else "")

    async def _pump(self, label: str, proc: subprocess.Popen) -> None:
        loop = asyncio.get_running_loop()
        while True:
            line = await loop.run_in_executor(None, proc.stdout.readline)
            if not line:
                return
            sys.stdout.write(f"[{label}] {line.decode(errors='replace')}")
            sys.stdout.flush()

    def alive(self, rank: int) -> bool | None:
        proc = self.procs.get(rank)
        return None if proc is None else proc.poll() is None

    async def release(self, rank: int, op: str, graceful: bool = True) -> None:
        proc = self.procs.pop(rank, None)
        if proc is None:
            return
        steps = [(signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)]
        for sig, wait in ([(None, 10.0)] if graceful else []) + steps:
            if sig is not None and proc.poll() is None:
                os.killpg(proc.pid, sig)
            try:
                await asyncio.wait_for(asyncio.to_thread(proc.wait), wait)
                break
            except asyncio.TimeoutError:
                continue
        log.info("[op %s] Worker.%d (pid %d) is gone (exit code %s)", op, rank, proc.pid, proc.returncode)
        pump = self._pumps.pop(rank, None)
        if pump:
            pump.cancel()

    async def close(self) -> None:
        await asyncio.gather(*(self.release(r, "shutdown", graceful=False) for r in list(self.procs)))
