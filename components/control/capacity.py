"""Capacity providers: where the processes of joining ranks come from.

The router asks for ranks by number and later gives them back; how a rank's process comes to
exist (a local process, a restored snapshot, a Kubernetes pod) is the provider's business.

A joiner's process outlives the router that started it: a router restarted by `dynamo serve`
finds it serving (or parked) and adopts it (`adopt`), so a router restart never costs a serving
rank. It never outlives the graph: it watches `dynamo serve` itself (components/worker/process.py,
`die_with_graph`), and the router that adopted it stops it when the router stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import logging
import os
import signal
import threading
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, Protocol

import msgspec

from components.graph.component import (
    COMPONENT_ENV,
    GRAPH_ENV,
    GRAPH_PID_ENV,
    GraphContext,
    ProcessSpec,
    encode_context,
)
from components.graph.spawn import Child, adopt, spawn
from components.protocol.config import WorkerConfig
from components.protocol.topology import SnapshotChoice, SnapshotState
from components.worker.component import FAULT_ENV, OP_ENV, Worker

if TYPE_CHECKING:
    from snapshot.criu_image import Restored

log = logging.getLogger("components.control.capacity")


class CapacityProvider(Protocol):
    # Why each new rank of the last acquire() was not restored from a snapshot (none fitted, one
    # failed its checksums, its restore failed), for the operation's record.
    refused: dict[int, str]
    # What new ranks are restored from, as last chosen; None where this provider restores none.
    snapshot: SnapshotChoice | None

    async def acquire(self, ranks: list[int], op: str, fault: str = "") -> dict[int, str]:
        """Bring up a joining worker for each rank: restore a parked one, restore a process from
        a baked snapshot that fits, or start a process. Returns rank -> "parked" | "snapshot" |
        "new"."""

    @property
    def checkpoints_parked(self) -> bool:
        """park() checkpoints the CUDA state of the rank (which must hold no transport state)."""

    async def park(self, rank: int, pid: int, op: str) -> None:
        """Keep a rank that left the group for the next scale-up (its process stays, holding no
        weights; on a GPU its CUDA state is checkpointed, so it holds no GPU memory either)."""

    def alive(self, rank: int) -> bool | None:
        """False once a rank this provider started, adopted or watches has died (locally also a
        rank of the first group whose process `dynamo serve` started is gone, reported or not);
        None for ranks it knows nothing about."""

    def watch(self, rank: int, pid: int) -> None:
        """A rank this provider did not start reported its process: `alive` judges it too, where
        this provider can see that process."""

    def adopt(self, rank: int, pid: int, joiner: bool, parked: bool) -> None:
        """A restarted router found this rank's process alive: from now on it is this provider's
        as if it had started it (`joiner`: an earlier router did), parked capacity if `parked`."""

    async def release(self, rank: int, op: str, graceful: bool = True) -> None:
        """Make sure the rank's process is gone: after it was asked to exit (`graceful`: give it
        time), or at once to abort."""

    async def fence(self, rank: int, pid: int, op: str) -> None:
        """A rank was found dead or stalled (serving, or parked): make sure it can never act again
        (a stalled process that resumed would serve a topology that no longer exists), whoever
        started it, and forget it."""

    def prune(self) -> None:
        """Drop spare capacity whose process died (standby copies), so that no scale-up takes it;
        called with every status round. Dead parked ranks the router drops itself (`fence`)."""

    def settled(self, op: str) -> None:
        """Operation `op` ended (done, rolled back or aborted): work held back so that it would
        not compete with the operation's joiners may start now."""

    async def close(self) -> None: ...


class LocalProvider:
    """Joining ranks as processes on this host, output prefixed like `dynamo serve` does; ranks
    that left are parked and restored first. A new rank is restored from a criu-tier snapshot
    under Worker.snapshot_root that fits the deployment and passes its checksums (each copy in its
    own PID namespace, so one image serves any number of joiners at once, all of a scale-up's
    concurrently; on CUDA its CUDA state restored after the CRIU restore), else cold-started. With
    Router.standby_copies, copies are restored ahead of any scale-up and wait for a rank."""

    def __init__(self, ctx: GraphContext):
        self.ctx = ctx
        self.wcfg = msgspec.convert(ctx.configs.get("Worker", {}), WorkerConfig)
        router = ctx.configs.get("Router", {})
        self.checkpoint_parked = bool(router.get("checkpoint_parked", False))
        self.standby_copies = int(router.get("standby_copies", 0))
        self.procs: dict[int, Child] = {}
        self.parked: dict[int, tuple[int, bool]] = {}  # rank -> (pid, CUDA state checkpointed)
        # Ranks restored from parked that `dynamo serve` started (not in procs): an abort must
        # still be able to stop them, or the next scale-up starts a second process for the rank.
        self.restored: dict[int, int] = {}  # rank -> pid
        self.refused: dict[int, str] = {}
        # One choice at a time: a scale-up arriving while the startup choice hashes the images
        # waits for it and then finds the checksums cached, instead of hashing them a second time.
        self._choosing = threading.Lock()
        self._choice: SnapshotChoice | None = None
        self._chosen = None  # the SnapshotInfo chosen last, if any
        self._standby: list[_Copy] = []
        self._standby_lock, self._filling = threading.Lock(), threading.Lock()
        self._closed = False
        if self.wcfg.snapshot_root:
            self._choice = SnapshotChoice(SnapshotState.CHOOSING, "startup")
            # Choosing a snapshot imports torch, reads the model's config and hashes every image
            # file (seconds for a CUDA image of GBs): done once now, so the first scale-up's
            # starting phase finds the imports done and the checksums cached (manifest.verify).
            choose = threading.Thread(target=self._choose_at_startup, name="snapshot-choice")
            choose.daemon = True
            choose.start()
        self.adopted: dict[int, int] = {}  # rank -> pid: joiners an earlier router started
        # rank -> pid: ranks `dynamo serve` started, as they report it. Their death is seen here at
        # the next look, not a heartbeat timeout later.
        self.watched: dict[int, int] = {}

    @property
    def snapshot(self) -> SnapshotChoice | None:
        if self._choice is None:
            return None
        return msgspec.structs.replace(self._choice, standby=len(self._standby))

    @functools.cached_property
    def checkpoints_parked(self) -> bool:
        from snapshot import cuda_checkpoint

        return self.checkpoint_parked and self.wcfg.device == "cuda" and cuda_checkpoint.available()[0]

    async def park(self, rank: int, pid: int, op: str) -> None:
        from snapshot import cuda_checkpoint

        self.restored.pop(rank, None)
        checkpointed = False
        if self.checkpoints_parked:
            t = await asyncio.to_thread(cuda_checkpoint.checkpoint, pid)
            checkpointed = True
            log.info("[op %s] Worker.%d parked, CUDA state checkpointed in %.3f s", op, rank, sum(t.values()))
        else:
            log.info("[op %s] Worker.%d parked (a warm process)", op, rank)
        self.parked[rank] = (pid, checkpointed)

    async def _unpark(self, rank: int, op: str) -> bool:
        """Restore a parked rank's process; False (and the process gone) when that fails, so the
        caller cold-starts the rank instead of failing the scale-up."""
        pid, checkpointed = self.parked[rank]
        if checkpointed:
            from snapshot import cuda_checkpoint

            try:
                t = await asyncio.to_thread(cuda_checkpoint.restore, pid)
            except Exception as e:
                log.warning("[op %s] Worker.%d: restoring its CUDA state failed (%s); cold start instead", op, rank, e)
                await self.release(rank, op, graceful=False)
                return False
            log.info("[op %s] Worker.%d CUDA state restored in %.3f s", op, rank, sum(t.values()))
        del self.parked[rank]
        if rank not in self.procs:
            self.restored[rank] = pid
        return True

    async def acquire(self, ranks: list[int], op: str, fault: str = "") -> dict[int, str]:
        how: dict[int, str] = {}
        self.refused = {}
        new: list[int] = []
        for rank in ranks:
            pid = self.parked.get(rank, (0, False))[0]
            if rank in self.parked and _gone(pid):  # died before the router saw it
                log.warning("[op %s] Worker.%d: its parked process (pid %d) is gone; a new one instead", op, rank, pid)
                await self.fence(rank, pid, op)
            if rank in self.parked and not fault:
                if await self._unpark(rank, op):
                    how[rank] = "parked"
                    continue
            if rank in self.parked:  # a fault test wants a fresh process: retire the parked one
                await self.release(rank, op, graceful=False)
            new.append(rank)
        if not new:
            return how
        env = {**os.environ, GRAPH_ENV: encode_context(self.ctx), COMPONENT_ENV: "Worker", "PYTHONUNBUFFERED": "1"}
        env.pop(FAULT_ENV, None)
        env[OP_ENV] = op
        if fault:
            env[FAULT_ENV] = fault
        snap, why = await self._snapshot(op)
        started = await asyncio.gather(*(self._start(r, env, snap, why, op) for r in new), return_exceptions=True)
        failed = [e for e in started if isinstance(e, BaseException)]
        for rank, res in zip(new, started):
            if isinstance(res, BaseException):
                continue
            child, started_how = res
            self.procs[rank] = child  # known before any failure is raised: release() can stop it
            how[rank] = started_how
            log.info(
                "[op %s] started %s (pid %d, %s)%s",
                op,
                child.label,
                child.pid,
                started_how,
                f" with fault {fault}" if fault else "",
            )
        if failed:
            raise failed[0]
        return how

    def _choose_at_startup(self) -> None:
        self._choose_snapshot("startup")
        self._fill()

    def _choose_snapshot(self, op: str):
        """The newest criu-tier snapshot under Worker.snapshot_root that fits and passes its
        checksums, or None and why not (blocking: run off the event loop), with a log line saying
        which and how long the checks took."""
        t0 = time.perf_counter()
        with self._choosing:
            self._choice = SnapshotChoice(SnapshotState.CHOOSING, op)
            try:
                snap, why = self._choose_snapshot_now(op)
            except Exception as e:
                self._choice = SnapshotChoice(SnapshotState.NONE, op, why=f"choosing a snapshot failed: {e}")
                self._chosen = None
                raise
            self._chosen = snap
            self._choice = (
                SnapshotChoice(SnapshotState.NONE, op, why=why)
                if snap is None
                else SnapshotChoice(SnapshotState.CHOSEN, op, path=snap.path, snapshot_id=snap.manifest.snapshot_id)
            )
        took = time.perf_counter() - t0
        if op == "startup":  # said before any operation, so a user knows what joiners will get
            if snap is None:
                log.info("no snapshot to restore joiners from yet (%s)", why)
            else:
                log.info(
                    "joiners will be restored from snapshot %s (fits, checksums verified in %.2f s)", snap.path, took
                )
        elif snap is None:
            log.info("[op %s] no snapshot to restore joiners from (%s): cold start", op, why)
        else:
            log.info(
                "[op %s] restoring joiners from snapshot %s (fits, checksums verified in %.2f s)", op, snap.path, took
            )
        return snap, why

    def _choose_snapshot_now(self, op: str):
        from components.worker.component import model_source, rank_config
        from snapshot.bake import target_for
        from snapshot.criu import criu_status
        from snapshot.store import find_compatible

        root = self.wcfg.snapshot_root
        ok, why = criu_status()
        if not ok:
            return None, why
        if self.wcfg.device == "cuda":
            from snapshot import cuda_checkpoint

            ok, why = cuda_checkpoint.available()
            if not ok:
                return None, f"a CUDA image cannot be restored here: {why}"
        target = target_for(model_source(self.wcfg)[0], rank_config(self.wcfg, 0))
        found, refused = find_compatible(target, root, tiers=("criu",))
        for reason in refused.values():
            log.warning("[op %s] %s", op, reason)
        if found:
            return found[0], ""
        return None, "; ".join(refused.values()) or f"no criu-tier snapshot under {root}"

    async def _snapshot(self, op: str):
        """The criu-tier snapshot new ranks are restored from (a SnapshotInfo, its checksums
        verified), or None and why not ("" when no snapshot_root is configured)."""
        if not self.wcfg.snapshot_root:
            return None, ""
        return await asyncio.to_thread(self._choose_snapshot, op)

    async def _start(self, rank: int, env: dict[str, str], snap, why: str, op: str) -> tuple[Child, str]:
        """Restore rank `rank` from `snap` if given (a standby copy of it if one is ready; falling
        back to a cold start when that fails), else cold-start it. Returns (its process,
        "snapshot" | "new")."""
        spec = Worker.rank_process(rank, join=True)
        if snap is not None:
            try:
                copy = self._take_standby(snap, rank, op)
                if copy is not None:
                    try:
                        return await self._become(rank, spec, env, copy, op), "snapshot"
                    except Exception as e:  # it died just now: restore another
                        log.warning("[op %s] Worker.%d: the standby copy failed (%s); restoring another", op, rank, e)
                copy = await asyncio.to_thread(self._restore_copy, snap, op, rank)
                return await self._become(rank, spec, env, copy, op), "snapshot"
            except Exception as e:  # criu's reason; the rank still joins, cold
                why = f"snapshot {snap.path}: restore failed: {e}"
                log.warning("[op %s] Worker.%d: %s; cold start instead", op, rank, why)
        if why:
            self.refused[rank] = why
        # It outlives this router (a restarted one adopts it), never the graph (die_with_graph).
        return await spawn(spec, env, with_parent=False), "new"

    def _restore_copy(self, snap, op: str, rank: int | None = None) -> _Copy:
        """Restore a copy of the snapshot's worker in its own PID namespace (blocking). It waits,
        holding no rank (on CUDA its state still checkpointed: no GPU memory), until `_become`
        tells it which rank it is, and exits if this router dies first (its stdin closes). Like a
        cold joiner, it dies with the graph."""
        from snapshot.bake import IMAGE_DIR
        from snapshot.criu_image import restore, verify_image

        image = Path(snap.path) / IMAGE_DIR
        stdin_r, stdin_w = os.pipe()
        out_r, out_w = os.pipe()
        t0 = time.perf_counter()
        try:
            restored = restore(
                image,
                output=out_w,
                stdin=stdin_r,
                manifest=verify_image(image, checksums=False),
                dies_with=int(os.environ.get(GRAPH_PID_ENV) or 0),
            )
        except BaseException:
            os.close(stdin_w)
            os.close(out_r)
            raise
        finally:
            os.close(stdin_r)
            os.close(out_w)
        who = f"Worker.{rank}" if rank is not None else f"standby copy pid {restored.pid}"
        log.info("[op %s] %s: criu restore took %.3f s", op, who, time.perf_counter() - t0)
        return _Copy(restored, stdin_w, out_r, snap.manifest.snapshot_id, time.monotonic())

    async def _become(self, rank: int, spec: ProcessSpec, env: dict[str, str], copy: _Copy, op: str) -> Child:
        """Make a restored copy rank `rank`: restore its CUDA state, then tell it through its
        stdin pipe which rank of which deployment it is (RankServer.restored)."""
        from components.worker.restore import RestoreIdentity

        try:
            if self.wcfg.device == "cuda":
                from snapshot import cuda_checkpoint

                t = await asyncio.to_thread(cuda_checkpoint.restore, copy.restored.pid)
                log.info(
                    "[op %s] Worker.%d: CUDA state restored in %.3f s, unlocked in %.3f s",
                    op,
                    rank,
                    t["restore"],
                    t["unlock"],
                )
            who = RestoreIdentity(
                rank=rank,
                pid=copy.restored.pid,
                context=self.ctx,
                env={k: v for k, v in env.items() if k not in (GRAPH_ENV, COMPONENT_ENV)},
                nonce=uuid.uuid4().hex[:12],
                snapshot=copy.snapshot_id,
            )
            data = msgspec.msgpack.encode(who)
            fcntl.fcntl(copy.stdin_w, fcntl.F_SETPIPE_SZ, max(len(data), 1 << 16))
            os.write(copy.stdin_w, data)  # all of it fits the pipe; the copy reads to its end
        except BaseException:
            _discard(copy)
            raise
        os.close(copy.stdin_w)
        return await adopt(spec, copy.restored, copy.out_r)

    # ---- standby copies: restored ahead of any scale-up -----------------------------------------
    def _take_standby(self, snap, rank: int, op: str) -> _Copy | None:
        """A standby copy of `snap` for rank `rank`, if one is ready and alive; None otherwise."""
        with self._standby_lock:
            while self._standby:
                copy = self._standby.pop(0)
                if copy.snapshot_id == snap.manifest.snapshot_id and not _gone(copy.restored.pid):
                    log.info(
                        "[op %s] Worker.%d: standby copy pid %d, restored %.1f s ago",
                        op,
                        rank,
                        copy.restored.pid,
                        time.monotonic() - copy.since,
                    )
                    return copy
                log.info(
                    "[op %s] standby copy pid %d dropped: gone, or not of the chosen snapshot", op, copy.restored.pid
                )
                _discard(copy)
        return None

    def _refill(self) -> None:
        """Restore standby copies of the chosen snapshot up to Router.standby_copies, on a thread
        of its own, one at a time (dropping those of a snapshot no longer chosen)."""
        if self.standby_copies and not self._filling.locked():
            threading.Thread(target=self._fill, name="standby-copies", daemon=True).start()

    def _fill(self) -> None:
        if not self._filling.acquire(blocking=False):
            return
        filling = True
        try:
            while filling:
                snap = self._chosen
                mine = snap.manifest.snapshot_id if snap is not None else None
                with self._standby_lock:
                    stale = [c for c in self._standby if c.snapshot_id != mine]
                    self._standby = [c for c in self._standby if c.snapshot_id == mine]
                    if self._closed or snap is None or len(self._standby) >= self.standby_copies:
                        # Released under the lock: a copy taken from now on finds no fill
                        # running, and its acquire's _refill starts one.
                        self._filling.release()
                        filling = False
                for copy in stale:
                    _discard(copy)
                if not filling:
                    return
                copy = self._restore_copy(snap, "standby")
                with self._standby_lock:
                    if not self._closed:
                        self._standby.append(copy)
                        log.info(
                            "standby copy pid %d of snapshot %s ready (%d of %d)",
                            copy.restored.pid,
                            snap.path,
                            len(self._standby),
                            self.standby_copies,
                        )
                        continue
                _discard(copy)
        except Exception as e:
            log.warning("a standby copy could not be restored: %s", e)
        finally:
            if filling:
                self._filling.release()

    def alive(self, rank: int) -> bool | None:
        child = self.procs.get(rank)
        if child is not None:
            return child.alive()
        pid = self.adopted.get(rank, self.watched.get(rank))
        if pid is None and rank < self.wcfg.dp_size:
            # A rank of the first group: `dynamo serve` started it on this host before this
            # router, so no process of it means it died, maybe before it could report its pid.
            pid = _first_group_worker(rank)
            if pid is None:
                return False
            self.watched[rank] = pid
        return None if pid is None else not _gone(pid)

    def watch(self, rank: int, pid: int) -> None:
        # Only a PID that is this rank's worker here: one from another PID namespace (a rank in a
        # container of its own) would look dead.
        if self.watched.get(rank) != pid and _is_worker(pid, rank):
            self.watched[rank] = pid

    def adopt(self, rank: int, pid: int, joiner: bool, parked: bool) -> None:
        if joiner:
            self.adopted[rank] = pid
        if parked:
            # A parked rank was checkpointed if parked ranks are (the same configuration).
            self.parked[rank] = (pid, self.checkpoints_parked)

    async def release(self, rank: int, op: str, graceful: bool = True) -> None:
        pid, _ = self.parked.pop(rank, (self.restored.pop(rank, None), False))
        self.watched.pop(rank, None)
        child = self.procs.pop(rank, None)
        adopted = self.adopted.pop(rank, None)
        if adopted is not None:
            code = await _stop(adopted, graceful)
            log.info("[op %s] Worker.%d (pid %d, adopted) is gone (%s)", op, rank, adopted, code)
            return
        if child is None:
            if pid is not None and not graceful:  # a parked rank that `dynamo serve` started
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
            return
        steps = [(signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)]
        for sig, wait in ([(None, 10.0)] if graceful else []) + steps:
            if sig is not None and child.alive():
                child.signal_group(sig)
            try:
                await asyncio.wait_for(child.proc.wait(), wait)
                break
            except TimeoutError:
                continue
        log.info("[op %s] Worker.%d (pid %d) is gone (exit code %s)", op, rank, child.pid, child.proc.returncode)
        child.pump.cancel()

    async def fence(self, rank: int, pid: int, op: str) -> None:
        pid = pid or self.watched.get(rank, 0)  # 0: not reported (a first-group rank found by alive)
        if rank in self.procs:  # SIGKILL at once: a stopped process ignores SIGTERM until resumed
            self.procs[rank].signal_group(signal.SIGKILL)
            await self.release(rank, op, graceful=False)
            return
        self.parked.pop(rank, None)
        self.restored.pop(rank, None)
        self.adopted.pop(rank, None)
        self.watched.pop(rank, None)
        # A rank `dynamo serve` or an earlier router started: kill the pid if it is still that
        # rank's worker (a pid is reused only after its process was reaped).
        if _gone(pid):
            log.info("[op %s] Worker.%d (pid %d) is already gone", op, rank, pid)
            return
        if _is_worker(pid, rank):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:  # exited since its cmdline was read
                log.info("[op %s] Worker.%d (pid %d) is already gone", op, rank, pid)
                return
            log.warning("[op %s] Worker.%d (pid %d) fenced: SIGKILL", op, rank, pid)

    def prune(self) -> None:
        with self._standby_lock:
            dead = [c for c in self._standby if _gone(c.restored.pid)]
            self._standby = [c for c in self._standby if c not in dead]
        for copy in dead:
            log.warning("standby copy pid %d died: dropped, another is restored", copy.restored.pid)
            _discard(copy)
        if dead:
            self._refill()

    def settled(self, op: str) -> None:
        # Replacing the copies taken (or those of a snapshot no longer chosen) waits for the
        # operation's end: a CRIU restore writes the whole image into memory, and on a 2-core
        # machine it ran beside the joiner's weight pull and slowed it.
        self._refill()

    async def close(self) -> None:
        with self._standby_lock:
            self._closed, standby, self._standby = True, self._standby, []
        for copy in standby:
            _discard(copy)
        ranks = set(self.procs) | set(self.adopted)
        await asyncio.gather(*(self.release(r, "shutdown", graceful=False) for r in sorted(ranks)))


class _Copy(NamedTuple):
    """A copy of a snapshot's worker restored by `_restore_copy`, not yet told its rank."""

    restored: Restored
    stdin_w: int  # where its RestoreIdentity goes; closed, the copy exits
    out_r: int  # its output, pumped once it is a rank
    snapshot_id: str
    since: float  # when it was restored (time.monotonic)


def _discard(copy: _Copy) -> None:
    """End a copy that will not be a rank: killed, its pipes closed, its restore workdir removed."""
    os.close(copy.stdin_w)
    os.close(copy.out_r)
    copy.restored.close()


def _is_worker(pid: int, rank: int) -> bool:
    """The process `pid` is rank `rank`'s worker (a copy restored from a snapshot image has the
    baked process's argv, `--bake`)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"components.worker" in argv and (str(rank).encode() in argv or b"--bake" in argv)


def _first_group_worker(rank: int) -> int | None:
    """The pid of rank `rank`'s worker that this graph's `dynamo serve` started, while it runs."""
    graph = f"{GRAPH_PID_ENV}={os.environ.get(GRAPH_PID_ENV, '')}".encode()
    started = [a.encode() for a in Worker.rank_process(rank).argv[1:]]  # as `dynamo serve` ran it
    for proc in Path("/proc").iterdir():
        try:
            if (proc / "cmdline").read_bytes().split(b"\0")[1:-1] != started:
                continue
            if graph in (proc / "environ").read_bytes().split(b"\0") and not _gone(int(proc.name)):
                return int(proc.name)
        except (OSError, ValueError):  # not a process, or gone meanwhile
            continue
    return None


def _gone(pid: int) -> bool:
    """The process exited (a zombie counts: whoever reaps it, it runs no more)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0] in "ZX"
    except (OSError, IndexError):
        return True


async def _stop(pid: int, graceful: bool) -> str:
    """Make sure a process this provider did not start is gone: wait (`graceful`), then SIGTERM,
    then SIGKILL; which of these ended it."""
    steps = [("exited", None, 10.0)] if graceful else []
    for what, sig, wait in steps + [("SIGTERM", signal.SIGTERM, 10.0), ("SIGKILL", signal.SIGKILL, 5.0)]:
        if sig is not None:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                return what
        deadline = asyncio.get_running_loop().time() + wait
        while not _gone(pid):
            if asyncio.get_running_loop().time() > deadline:
                break
            await asyncio.sleep(0.05)
        else:
            return what
    return "still running"
