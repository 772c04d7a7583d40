"""Scale operations: grow or shrink the serving group in place (docs/design.md, "The scale protocol").

One operation runs at a time; a request that arrives meanwhile only moves the target, and the
latest target wins. Each operation has an id that every log line about it carries, a phase
machine with one transition function, per-phase timings and a measured downtime (first pause
request to last resume reply). Everything before the commit can fail and abort without the
serving topology ever changing; a commit that fails or times out rolls back to the old epoch.

Modes, for comparison (the vLLM elastic EP post's table):
  A blocking: pause serving first, then start, load, connect, warm up, commit.
  B async prepare: start, load and connect in the background; warm up inside the pause.
  C async prepare + reuse: everything but the in-place switch in the background.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import time
from typing import TYPE_CHECKING

import msgspec

from components.protocol.messages import (
    Configure,
    Connect,
    Disconnect,
    Drain,
    EndExport,
    Exit,
    ExportWeights,
    Park,
    Pause,
    PullWeights,
    Restore,
    Resume,
    SetRoutable,
    Warmup,
)
from components.protocol.placement import Placement, changed_slots, grow, interim, rebalance, shrink
from components.protocol.transfer import PullItem, expert_slot_name, spread

if TYPE_CHECKING:
    from components.control.capacity import CapacityProvider
    from components.control.router import RouterService

log = logging.getLogger("components.control.scaling")

MODES = ("A", "B", "C")


class Phase(enum.Enum):
    QUEUED = "queued"
    PAUSING = "pausing"  # mode A: serving stops before anything else
    STARTING = "starting"  # joiner processes come up and register (not routable)
    LOADING = "loading"  # joiners pull weights from serving ranks, checksummed
    CONNECTING = "connecting"  # serving ranks connect joiners masked
    WARMING = "warming"  # joiners warm up alone, remote peers masked
    DRAINING = "draining"  # leaving ranks out of routing, their requests finish or move
    MIGRATING = "migrating"  # experts copied to the ranks that will hold them
    COMMITTING = "committing"  # pause, install active set + expert map in place, resume
    REBALANCING = "rebalancing"  # async EPLB from measured per-expert load
    CLEANUP = "cleanup"  # leaving ranks disconnect and exit
    DONE = "done"
    ABORTED = "aborted"  # failed before the commit: the topology never changed
    ROLLED_BACK = "rolled_back"  # the commit failed: back to the previous set, new epoch


_NEXT = {
    Phase.QUEUED: {Phase.PAUSING, Phase.STARTING, Phase.DRAINING},
    Phase.PAUSING: {Phase.STARTING, Phase.DRAINING},
    Phase.STARTING: {Phase.LOADING},
    Phase.LOADING: {Phase.WARMING, Phase.CONNECTING},
    Phase.WARMING: {Phase.CONNECTING},
    Phase.CONNECTING: {Phase.COMMITTING},
    Phase.DRAINING: {Phase.MIGRATING},
    Phase.MIGRATING: {Phase.COMMITTING},  # also the follow-up EPLB's
    Phase.COMMITTING: {Phase.REBALANCING, Phase.CLEANUP, Phase.DONE},
    Phase.CLEANUP: {Phase.REBALANCING, Phase.DONE},
    Phase.REBALANCING: {Phase.MIGRATING, Phase.DONE},
}
_FINAL = {Phase.DONE, Phase.ABORTED, Phase.ROLLED_BACK}


class OpRecord(msgspec.Struct):
    """What /topology shows about an operation."""

    id: str
    kind: str  # "up" | "down"
    mode: str
    from_size: int
    to_size: int
    phase: str
    joiners: list[int]
    leaving: list[int]
    phases: dict[str, float]  # seconds spent per phase
    downtime_s: float | None = None  # the scale's pauses: first pause request to last resume reply, summed
    committed_at: float | None = None  # wall-clock time (unix) of the last resume reply
    rebalance_downtime_s: float | None = None  # the short commits of the follow-up EPLB
    total_s: float | None = None
    handed_over: int = 0
    pull_bytes: int = 0
    joined_from: dict[int, str] = {}  # joiner -> "parked" | "snapshot" | "cold"
    parked: list[int] = []  # leaving ranks kept for the next scale-up
    error: str = ""


class ScaleError(RuntimeError):
    pass


class ScaleRequest(msgspec.Struct, frozen=True):
    dp_size: int
    mode: str = "C"
    drain_timeout_s: float = 30.0
    fault: str = ""  # injected into joiners; only honoured with Router.allow_fault_injection


class Operation:
    _ids = itertools.count(1)

    def __init__(self, scaler: Scaler, req: ScaleRequest, kind: str):
        svc = scaler.svc
        self.scaler, self.svc, self.req = scaler, svc, req
        self.id = f"op-{next(self._ids)}-{kind}-{len(svc.active)}to{req.dp_size}"
        self.t0 = time.monotonic()
        self._phase_t0 = self.t0
        self.phase = Phase.QUEUED
        self.old_active = list(svc.active)
        self.old_placement = svc.placement
        free = [r for r in range(svc.wcfg.max_ranks) if r not in svc.active]
        joiners = free[: max(0, req.dp_size - len(svc.active))] if kind == "up" else []
        leaving = sorted(svc.active)[req.dp_size :] if kind == "down" else []
        self.record = OpRecord(
            id=self.id,
            kind=kind,
            mode=req.mode,
            from_size=len(svc.active),
            to_size=req.dp_size,
            phase=self.phase.value,
            joiners=joiners,
            leaving=leaving,
            phases={},
        )
        self.joiners, self.leaving = joiners, leaving
        self.committed = False
        self.rolled_back = False
        self.pause_t0: float | None = None  # mode A: when serving stopped

    # ---- state machine -----------------------------------------------------------------------
    def transition(self, new: Phase, reason: str = "") -> None:
        if new not in _FINAL and new not in _NEXT.get(self.phase, set()):
            raise RuntimeError(f"[op {self.id}] illegal phase change {self.phase.value} -> {new.value}")
        now = time.monotonic()
        spent = now - self._phase_t0
        if self.phase is not Phase.QUEUED:
            self.record.phases[self.phase.value] = round(self.record.phases.get(self.phase.value, 0.0) + spent, 6)
        log.info(
            "[op %s] %s -> %s (%.3f s in %s)%s",
            self.id,
            self.phase.value,
            new.value,
            spent,
            self.phase.value,
            f": {reason}" if reason else "",
        )
        self.phase, self._phase_t0 = new, now
        self.record.phase = new.value
        if new in _FINAL:
            self.record.total_s = round(now - self.t0, 6)

    # ---- helpers -----------------------------------------------------------------------------
    async def call(self, ranks, make, timeout: float | None = None):
        """Send a command to several ranks at once; fail fast when a joiner's process dies."""
        timeout = timeout or self.svc.cfg.prepare_timeout_s

        async def one(r):
            task = asyncio.ensure_future(self.svc.send(r, make(r)))
            deadline = time.monotonic() + timeout
            while not task.done():
                if self.scaler.provider.alive(r) is False:
                    task.cancel()
                    raise ScaleError(f"rank {r} died during {self.phase.value}")
                if time.monotonic() > deadline:
                    task.cancel()
                    raise ScaleError(f"rank {r} did not answer {type(make(r)).__name__} within {timeout:.0f} s")
                await asyncio.wait({task}, timeout=0.05)
            return task.result()

        return await asyncio.gather(*(one(r) for r in ranks))

    async def pull_experts(self, current: Placement, target: Placement, sources: list[int], dense_to=()) -> None:
        """Fill every slot `target` changes (and all dense weights of `dense_to`) from `sources`,
        where `current` says the experts are."""
        items: dict[int, list[PullItem]] = {}
        manifests = {}
        holders: dict[tuple[int, int], list[int]] = {}
        for layer, row in enumerate(current.slots):
            for slot, e in enumerate(row):
                if e >= 0 and slot // current.slots_per_rank in sources:
                    holders.setdefault((layer, e), []).append(slot)
        turn = itertools.count()
        for layer, slot in changed_slots(current, target):
            dst = slot // target.slots_per_rank
            choices = holders.get((layer, target.slots[layer][slot]))
            if not choices:
                raise ScaleError(f"no serving rank holds expert {target.slots[layer][slot]} of layer {layer}")
            src_slot = choices[next(turn) % len(choices)]
            src = src_slot // current.slots_per_rank
            for part in ("gate", "up", "down"):
                items.setdefault(dst, []).append(
                    PullItem(
                        src_rank=src,
                        src_name=expert_slot_name(layer, src_slot % current.slots_per_rank, part),
                        dst_name=expert_slot_name(layer, slot % target.slots_per_rank, part),
                    )
                )
        if dense_to:
            # One full manifest names the dense weights and serves as that source's manifest.
            probe = (await self.call([sources[0]], lambda r: ExportWeights(names=None)))[0].manifest
            manifests[sources[0]] = probe
            sizes = {t.name: t.nbytes for t in probe.tensors if not t.name.startswith("experts.")}
            for dst in dense_to:
                items.setdefault(dst, []).extend(spread(list(sizes), list(sources), sizes))
        if not items:
            return
        need: dict[int, set[str]] = {}
        for its in items.values():
            for it in its:
                need.setdefault(it.src_rank, set()).add(it.src_name)
        ask = sorted(r for r in need if r not in manifests)
        replies = await self.call(ask, lambda r: ExportWeights(names=sorted(need[r])))
        manifests.update({r: rep.manifest for r, rep in zip(ask, replies)})
        try:
            done = await self.call(
                sorted(items),
                lambda r: PullWeights(
                    sources={s: manifests[s] for s in {it.src_rank for it in items[r]}}, items=items[r], op=self.id
                ),
            )
        finally:
            exporters = set(need) | set(manifests)
            await asyncio.gather(
                *(self.call([r], lambda r: EndExport()) for r in sorted(exporters)), return_exceptions=True
            )
        self.record.pull_bytes += sum(rep.pull.bytes for rep in done)

    async def commit(
        self, active: list[int], placement: Placement, warm: list[int] = (), recapture: bool = False
    ) -> float:
        """Pause every rank involved at one step boundary, install the new active set and expert
        map in place, resume; returns the downtime. On failure roll everyone back to the previous
        set under a new epoch."""
        svc = self.svc
        # Leaving ranks that already exited (a follow-up rebalance) are no longer known.
        involved = sorted(
            r for r in set(svc.active) | set(active) | set(self.joiners) | set(self.leaving) if r in svc.instances
        )
        epoch = svc.epoch + 1
        timeout = svc.cfg.commit_timeout_s
        t0 = self.pause_t0 or time.monotonic()
        self.pause_t0 = None
        try:
            # Ranks already paused (mode A) answer at once.
            await self.call(involved, lambda r: Pause(), timeout)
            if warm:  # mode B: the preparation the design keeps out of the pause
                await self.call(warm, lambda r: Warmup(placement=placement, recapture=recapture, op=self.id))
            await self.call(
                involved,
                lambda r: Configure(epoch=epoch, active=active if r in active else [], placement=placement),
                timeout,
            )
            await self.call(involved, lambda r: Resume(), timeout)
        except Exception as e:
            await self.rollback(involved, epoch + 1, f"commit of epoch {epoch} failed: {e}")
            raise
        downtime = time.monotonic() - t0
        svc.epoch, svc.active, svc.placement = epoch, sorted(active), placement
        log.info("[op %s] epoch %d committed: active %s, downtime %.1f ms", self.id, epoch, svc.active, downtime * 1e3)
        return downtime

    async def rollback(self, involved, epoch: int, reason: str) -> None:
        svc = self.svc
        log.error("[op %s] rolling back to ranks %s at epoch %d: %s", self.id, svc.active, epoch, reason)
        old = svc.active
        reachable = [r for r in involved if self.scaler.provider.alive(r) is not False]
        for msg in (
            lambda r: Pause(),
            lambda r: Configure(epoch=epoch, active=old if r in old else [], placement=svc.placement),
            lambda r: Resume(),
        ):
            results = await asyncio.gather(
                *(self.call([r], msg, svc.cfg.commit_timeout_s) for r in reachable), return_exceptions=True
            )
            for r, res in zip(reachable, results):
                if isinstance(res, Exception):
                    log.error("[op %s] rank %d missed the rollback: %s", self.id, r, res)
        svc.epoch = epoch
        self.rolled_back = True

    # ---- the operations ----------------------------------------------------------------------
    async def scale_up(self) -> None:
        svc, req = self.svc, self.req
        current = svc.placement
        load = svc.expert_load()
        target = grow(current, self.joiners, svc.num_experts, load)
        if req.mode == "A":
            self.transition(Phase.PAUSING, "mode A stops serving for the whole operation")
            await self.pause_all()
        self.transition(Phase.STARTING, f"joiners {self.joiners}")
        self.record.joined_from = await self.scaler.provider.acquire(self.joiners, self.id, req.fault)
        for r, how in self.record.joined_from.items():
            if how != "parked":  # a new process: whatever instance this rank had is gone
                svc.forget(r)
        await svc.discover(self.joiners, self.scaler.provider, self.svc.cfg.prepare_timeout_s)
        restored = [r for r, how in self.record.joined_from.items() if how == "parked"]
        await self.call(restored, lambda r: Restore(op=self.id))
        self.transition(Phase.LOADING, "dense weights spread over serving ranks, experts per the target map")
        await self.pull_experts(current, target, list(svc.active), dense_to=self.joiners)
        if req.mode == "C":
            self.transition(Phase.WARMING, "joiners alone, remote peers masked")
            await self.call(self.joiners, lambda r: Warmup(placement=target, op=self.id))
        self.transition(Phase.CONNECTING, "serving ranks connect joiners masked")
        meta = {r: svc.status[r].metadata for r in svc.active + self.joiners}
        await self.call(svc.active, lambda r: Connect(peers={j: meta[j] for j in self.joiners}, activate=False))
        await self.call(self.joiners, lambda r: Connect(peers={p: m for p, m in meta.items() if p != r}))
        self.transition(Phase.COMMITTING)
        self.scale_committed(
            await self.commit(
                sorted(svc.active + self.joiners),
                target,
                warm=self.joiners if req.mode in ("A", "B") else (),
                recapture=req.mode in ("A", "B"),
            )
        )
        await self.call(self.joiners, lambda r: SetRoutable(routable=True))

    async def scale_down(self) -> None:
        svc, req = self.svc, self.req
        remaining = [r for r in svc.active if r not in self.leaving]
        current = svc.placement
        target = shrink(current, self.leaving, svc.num_experts)
        if req.mode == "A":
            # Blocking: serving stops first; the leaving ranks' requests move at once and wait.
            await self.pause_all()
        self.transition(Phase.DRAINING, f"ranks {self.leaving} out of routing")
        await self.call(self.leaving, lambda r: SetRoutable(routable=False))
        drain_s = 0.0 if req.mode == "A" else req.drain_timeout_s
        # Handed-over requests go to remaining ranks by name: a routing table that still lists a
        # leaving rank would send one to a rank about to park.
        targets = [svc.status[r].instance_id for r in remaining]
        drained = asyncio.ensure_future(
            self.call(
                self.leaving,
                lambda r: Drain(timeout_s=drain_s, targets=targets, op=self.id),
                drain_s + svc.cfg.prepare_timeout_s,
            )
        )
        self.transition(Phase.MIGRATING, "experts of leaving ranks to remaining ranks")
        interim_downtime = await self.migrate(current, target, sources=svc.active)
        self.record.handed_over = sum(rep.handed_over for rep in await drained)
        self.transition(Phase.COMMITTING)
        rebuild = req.mode in ("A", "B")  # re-warm and re-capture inside the pause
        self.scale_committed(
            interim_downtime
            + await self.commit(remaining, target, warm=remaining if rebuild else (), recapture=rebuild)
        )
        park = svc.cfg.park_leaving
        self.transition(Phase.CLEANUP, f"ranks {self.leaving} disconnect and {'park' if park else 'exit'}")
        await self.call(remaining, lambda r: Disconnect(ranks=self.leaving))
        if park:
            checkpoint = self.scaler.provider.checkpoints_parked
            await self.call(self.leaving, lambda r: Park(checkpoint=checkpoint, op=self.id))
            for r in self.leaving:
                await self.scaler.provider.park(r, svc.status[r].pid, self.id)
            self.record.parked = list(self.leaving)
            return
        await self.call(self.leaving, lambda r: Exit(op=self.id))
        for r in self.leaving:
            await self.scaler.provider.release(r, self.id)
            svc.forget(r)

    def scale_committed(self, downtime: float) -> None:
        self.committed = True
        self.record.downtime_s, self.record.committed_at = round(downtime, 6), time.time()

    async def pause_all(self) -> None:
        self.pause_t0 = time.monotonic()
        await self.call(self.svc.active, lambda r: Pause(), self.svc.cfg.commit_timeout_s)

    async def migrate(self, current: Placement, target: Placement, sources) -> float:
        """Refill the slots `target` changes; returns the downtime this cost. While serving, first
        stop routing to those slots (a short commit of the interim map, unless nothing routed
        changes); with serving paused (mode A) they are simply overwritten."""
        mid = interim(current, target)
        downtime = 0.0
        if mid.slots != current.slots and self.pause_t0 is None:
            downtime = await self.commit(self.svc.active, mid)
        await self.pull_experts(mid, target, list(sources))
        return downtime

    async def rebalance(self) -> None:
        """Async EPLB after the scale: replicas follow the measured per-expert load."""
        svc = self.svc
        load = svc.expert_load()
        target = rebalance(svc.placement, svc.active, svc.num_experts, load)
        if target.slots == svc.placement.slots or not any(any(row) for row in load):
            return
        self.transition(Phase.MIGRATING, f"{len(changed_slots(svc.placement, target))} slots change")
        downtime = await self.migrate(svc.placement, target, svc.active)
        self.transition(Phase.COMMITTING)
        downtime += await self.commit(svc.active, target)
        self.record.rebalance_downtime_s = round(downtime, 6)
        svc.reset_load()

    async def abort(self, reason: str) -> None:
        """Undo a prepare: the serving group forgets the joiners, their processes go."""
        svc = self.svc
        log.error("[op %s] aborting in %s: %s", self.id, self.phase.value, reason)
        if self.joiners:
            await asyncio.gather(
                *(
                    self.call([r], lambda r: Disconnect(ranks=self.joiners), svc.cfg.commit_timeout_s)
                    for r in svc.active
                ),
                return_exceptions=True,
            )
            for j in self.joiners:
                await self.scaler.provider.release(j, self.id, graceful=False)
                svc.forget(j)
        if self.leaving:  # back into routing: they never left the active set
            await asyncio.gather(
                *(self.call([r], lambda r: SetRoutable(routable=True), svc.cfg.commit_timeout_s) for r in self.leaving),
                return_exceptions=True,
            )
        if self.pause_t0 is not None:  # mode A paused serving for the operation
            await asyncio.gather(
                *(self.call([r], lambda r: Resume(), svc.cfg.commit_timeout_s) for r in svc.active),
                return_exceptions=True,
            )

    async def execute(self) -> None:
        try:
            await (self.scale_up() if self.record.kind == "up" else self.scale_down())
            if self.svc.cfg.rebalance:
                self.transition(Phase.REBALANCING, "async EPLB from measured load")
                await self.rebalance()
            self.transition(Phase.DONE)
        except Exception as e:
            self.record.error = f"{type(e).__name__}: {e}"
            if self.committed:
                # The new topology serves; only the follow-up (cleanup or rebalance) failed.
                log.error("[op %s] after the commit: %s", self.id, self.record.error)
                self.transition(Phase.DONE, f"committed; follow-up failed: {self.record.error}")
            elif self.rolled_back:
                await self.abort(str(e))
                self.transition(Phase.ROLLED_BACK, self.record.error)
            else:
                await self.abort(self.record.error)
                self.transition(Phase.ABORTED, self.record.error)


class Scaler:
    """Runs operations one at a time toward the latest requested size."""

    def __init__(self, svc: RouterService, provider: CapacityProvider):
        self.svc, self.provider = svc, provider
        self.pending: ScaleRequest | None = None
        self.current: Operation | None = None
        self.history: list[OpRecord] = []
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def busy(self) -> bool:
        return self.current is not None or self.pending is not None

    def request(self, req: ScaleRequest) -> None:
        self.pending = req  # the latest target wins over one still queued
        self._idle.clear()
        self._wake.set()

    async def wait_idle(self) -> OpRecord | None:
        await self._idle.wait()
        return self.history[-1] if self.history else None

    async def run(self) -> None:
        await self.svc.ready.wait()
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self.pending is not None:
                req, self.pending = self.pending, None
                size = len(self.svc.active)
                if req.dp_size == size:
                    continue
                op = Operation(self, req, "up" if req.dp_size > size else "down")
                self.current = op
                self.history.append(op.record)
                del self.history[:-20]
                await op.execute()
                self.svc.observe_op(op)
                self.current = None
            self._idle.set()
