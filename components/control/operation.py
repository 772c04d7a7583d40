"""A scale operation: grows or shrinks the serving group in place (docs/design.md, "The scale protocol").

Each operation has an id that every log line about it carries, a phase
machine with one transition function, per-phase timings and a measured downtime (first pause
request to last resume reply). Everything before the commit can fail and abort without the
serving topology ever changing; a commit that fails or times out rolls back to the old epoch.

Modes, for comparison (the vLLM elastic EP post's table; `ScaleMode`):
  A blocking: pause serving first, then start, load, connect, warm up, commit.
  B async prepare: start, load and connect in the background; warm up inside the pause.
  C async prepare + reuse: everything but the in-place switch in the background.

An operation talks to ranks only through a `RankPort` (the router) and never writes the router's
state: it starts from the committed topology it is given, and each of its commits replaces its own
`topology`, which the router reads while it runs and takes over when it ends.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import time
from collections.abc import Callable
from typing import Protocol

import msgspec

from components.control.capacity import CapacityProvider
from components.protocol.config import RouterConfig
from components.protocol.lifecycle import RankState
from components.protocol.messages import (
    Configure,
    Connect,
    ControlReply,
    Disconnect,
    Drain,
    DropSources,
    EndExport,
    Exit,
    ExportWeights,
    LoadExperts,
    LoadWeights,
    Park,
    Pause,
    PullWeights,
    RankStatus,
    Restore,
    Resume,
    SetRoutable,
    Warmup,
)
from components.protocol.placement import (
    Placement,
    balanced_placement,
    changed_slots,
    grow,
    interim,
    rebalance,
    shrink,
)
from components.protocol.topology import Committed, JoinerRetry, OpRecord, PullLoss, ScaleMode, ScaleRequest
from components.protocol.transfer import (
    EXPERT_PARTS,
    PullItem,
    SourceLoss,
    expert_pulls,
    expert_slot_name,
    replan,
    spread,
)

log = logging.getLogger(__name__)

# How long a call that failed in transport waits to see whether its rank's process is exiting.
DEATH_GRACE_S = 1.0


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
    MASKING = "masking"  # failover: survivors stop waiting for failed ranks, pause, reload their experts
    CLEANUP = "cleanup"  # leaving ranks disconnect and exit
    DONE = "done"
    ABORTED = "aborted"  # failed before the commit: the topology never changed
    ROLLED_BACK = "rolled_back"  # the commit failed: back to the previous set, new epoch


# A scale-up's preparation: its joiners work alone, so one that stalls is replaced (`stalled`).
_PREPARING = {Phase.STARTING, Phase.LOADING, Phase.WARMING, Phase.CONNECTING}

# Back to STARTING from any phase of a scale-up's preparation: a joiner died, a new one starts.
_NEXT = {
    Phase.QUEUED: {Phase.PAUSING, Phase.STARTING, Phase.DRAINING, Phase.MASKING},
    Phase.MASKING: {Phase.COMMITTING, Phase.LOADING, Phase.STARTING},  # STARTING: a rebuild's new ranks
    Phase.PAUSING: {Phase.STARTING, Phase.DRAINING},
    Phase.STARTING: {Phase.LOADING, Phase.STARTING},
    Phase.LOADING: {Phase.WARMING, Phase.CONNECTING, Phase.MASKING, Phase.STARTING},  # MASKING: a source failed
    Phase.WARMING: {Phase.CONNECTING, Phase.STARTING},
    Phase.CONNECTING: {Phase.COMMITTING, Phase.STARTING},
    Phase.DRAINING: {Phase.MIGRATING},
    Phase.MIGRATING: {Phase.COMMITTING},  # also the follow-up EPLB's
    Phase.COMMITTING: {Phase.REBALANCING, Phase.CLEANUP, Phase.DONE},
    Phase.CLEANUP: {Phase.REBALANCING, Phase.DONE},
    Phase.REBALANCING: {Phase.MIGRATING, Phase.DONE},
}
FINAL = {Phase.DONE, Phase.ABORTED, Phase.ROLLED_BACK}


class ScaleError(RuntimeError):
    pass


class RankPort(Protocol):
    """What a scale operation may do with ranks (the router implements it)."""

    async def send(self, rank: int, msg) -> ControlReply:
        """Send one control message; ControlError when the rank refuses or does not answer."""

    async def discover(self, ranks: list[int], provider: CapacityProvider, timeout: float) -> None:
        """Wait until these ranks registered and described themselves."""

    def forget(self, rank: int) -> None:
        """The rank's process is gone: drop its instance and status."""

    def unlist(self, rank: int, op: str) -> None:
        """The rank's process was killed: take the instances it left listed out of discovery, so
        that no request is sent to them any more."""

    def status(self, rank: int) -> RankStatus:
        """The rank's latest status (every reply carries one)."""

    def failed(self, rank: int) -> bool:
        """The rank was found dead or stalled: waiting for its answer is pointless."""

    def silent_s(self, rank: int) -> float:
        """Seconds since the rank last answered anything, its status included (0 before its first
        answer)."""


class Operation:
    """One scale operation from the committed topology it starts at; `execute` returns the topology
    it leaves committed (the old one when it aborts)."""

    _ids = itertools.count(1)

    def __init__(
        self,
        req: ScaleRequest,
        topology: Committed,
        load: list[list[int]],
        port: RankPort,
        provider: CapacityProvider,
        cfg: RouterConfig,
        max_ranks: int,
        num_experts: int,
        failed: list[int] = (),
        on_change: Callable[[OpRecord], None] = lambda record: None,
    ):
        self.req, self.topology, self.load, self.on_change = req, topology, load, on_change
        self.port, self.provider, self.cfg, self.num_experts = port, provider, cfg, num_experts
        self.max_ranks = max_ranks
        self.failed = sorted(failed)
        size = len(topology.active)
        if not [r for r in topology.active if r not in self.failed]:
            # Nothing left to fail over to: the group is formed again from scratch. The ranks it
            # takes, parked ones first, may have the numbers of the dead (fenced by then).
            kind = "rebuild"
            self.topology = Committed(epoch=topology.epoch, active=[], placement=topology.placement)
            pool = sorted(range(max_ranks), key=lambda r: (not self._parked(r), r))
            self.joiners = sorted(pool[: req.dp_size])
        else:
            kind = "failover" if failed else "up" if req.dp_size > size else "down"
            free = [r for r in range(max_ranks) if r not in topology.active]
            self.joiners = free[: max(0, req.dp_size - size)] if kind == "up" else []
        self.id = f"op-{next(self._ids)}-{kind}-{size}to{req.dp_size}"
        self.t0 = time.monotonic()
        self._phase_t0 = self.t0
        self.phase = Phase.QUEUED
        # The ranks asked to leave, else the highest. Survivors keep their numbers: a rank's
        # number owns its expert slots and EP window, so the active set may have gaps (as after a
        # failover), and the next scale-up fills the lowest free numbers first.
        down = (sorted(req.remove) or sorted(topology.active)[req.dp_size :]) if kind == "down" else []
        self.leaving = self.failed or down
        self.record = OpRecord(
            id=self.id,
            kind=kind,
            mode=req.mode,
            from_size=size,
            to_size=req.dp_size,
            phase=self.phase.value,
            joiners=self.joiners,
            leaving=self.leaving,
            phases={},
            started_at=time.time(),
            resumes=req.resumes,
        )
        self.committed = False
        self.rolled_back = False
        # Undoing itself (abort, rollback): a serving rank failing no longer cuts its calls short.
        self.undoing = False
        self.preempted = False  # cut short because a serving rank failed: the failover goes first
        self.gave_way_to: list[int] = []  # those serving ranks
        self._background: set[asyncio.Future] = set()
        self.pause_t0: float | None = None  # mode A: when serving stopped

    def _parked(self, rank: int) -> bool:
        try:
            return self.port.status(rank).state is RankState.PARKED
        except KeyError:
            return False

    @classmethod
    def number_after(cls, last: int) -> None:
        """Number the next operations from `last` + 1 (a restarted router continues the ids of
        the history it reloaded)."""
        cls._ids = itertools.count(last + 1)

    @property
    def active(self) -> list[int]:
        return self.topology.active

    # ---- state machine -----------------------------------------------------------------------
    def transition(self, new: Phase, reason: str = "") -> None:
        if new not in FINAL and new not in _NEXT.get(self.phase, set()):
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
        if new in FINAL:
            self.record.total_s = round(now - self.t0, 6)
        self.on_change(self.record)

    # ---- helpers -----------------------------------------------------------------------------
    async def call(
        self, ranks, make: Callable[[int], object], timeout: float | None = None, preempt: bool = True
    ) -> list[ControlReply]:
        """Send a command to several ranks at once; fail fast when a rank's process dies, or (with
        `preempt`) a serving rank fails, unless this operation absorbs that."""
        timeout = timeout or self.cfg.prepare_timeout_s

        def check(r) -> None:
            failing = self.failing_serving() if preempt and not (self.undoing or self.absorbs) else []
            if failing:
                raise self.give_way(failing)
            if self.provider.alive(r) is False or self.port.failed(r):
                raise ScaleError(f"rank {r} died during {self.phase.value}")
            if self.stalled(r):
                quiet = self.port.silent_s(r)
                raise ScaleError(f"rank {r} stalled during {self.phase.value}: no answer for {quiet:.1f} s")

        async def one(r):
            # Every command carries the operation's id, for the rank's log lines about it.
            task = asyncio.ensure_future(self.port.send(r, msgspec.structs.replace(make(r), op=self.id)))
            deadline = time.monotonic() + timeout
            while not task.done():
                try:
                    check(r)
                except ScaleError:
                    task.cancel()
                    raise
                if time.monotonic() > deadline:
                    task.cancel()
                    raise ScaleError(f"rank {r} did not answer {type(make(r)).__name__} within {timeout:.0f} s")
                await asyncio.wait({task}, timeout=0.05)
            if task.exception() is not None:
                # A rank killed mid-call ends its stream before its process is seen gone (it takes
                # a moment to exit): wait for that, so the failure is that rank's failing (the
                # failover's, or a rollback that masks it out), not this operation's own.
                grace = time.monotonic() + DEATH_GRACE_S
                while time.monotonic() < grace:
                    check(r)
                    await asyncio.sleep(0.05)
            return task.result()

        return await asyncio.gather(*(one(r) for r in ranks))

    def stalled(self, rank: int) -> bool:
        """A joiner in preparation that stopped answering even its status (a stopped or wedged
        process, which the provider still sees alive): replaced like a dead one, at once rather
        than at Router.prepare_timeout_s."""
        limit = max(self.cfg.joiner_timeout_s, self.cfg.rank_timeout_s)
        return rank in self.joiners and self.phase in _PREPARING and self.port.silent_s(rank) > limit

    async def giving_way(self, awaitable):
        """Await `awaitable` (that sends no command), giving way at once to a serving rank that
        fails meanwhile, as `call` does: a joiner's process takes seconds to come up."""
        task = asyncio.ensure_future(awaitable)
        try:
            while not task.done():
                failing = [] if self.undoing or self.absorbs else self.failing_serving()
                if failing:
                    raise self.give_way(failing)
                await asyncio.wait({task}, timeout=0.05)
            return task.result()
        finally:
            task.cancel()

    @property
    def absorbs(self) -> bool:
        """A serving rank that fails while this scale-up's joiners pull their weights (one of
        their sources, likely) is masked out by the operation itself, which then reads what that
        rank was to send from the survivors and goes on, rather than giving way to a failover."""
        return self.record.kind == "up" and self.phase in (Phase.LOADING, Phase.MASKING)

    def give_way(self, failing: list[int]) -> ScaleError:
        """The group stopped serving (its collectives wait for the failed rank): the failover must
        not wait for this operation."""
        self.preempted = True
        self.gave_way_to = failing
        return ScaleError(f"serving rank {failing[0]} failed during {self.phase.value}: the failover goes first")

    async def pull_experts(self, current: Placement, target: Placement, sources: list[int], dense_to=()) -> None:
        """Fill every slot `target` changes (and all dense weights of `dense_to`) from `sources`,
        where `current` says the experts are. What a source lost mid-pull was to send is read
        from other live holders (`replan`) in another round, until every item is in; a serving
        rank the router fails meanwhile is masked out first where this operation absorbs that
        (else it gives way to the failover)."""
        try:
            items = expert_pulls(current, target, sources)
        except ValueError as e:
            raise ScaleError(str(e)) from None
        manifests, sizes = {}, None
        if dense_to:
            # One full manifest names the dense weights and serves as that source's manifest.
            first = next((r for r in sources if not self.port.failed(r)), sources[0])
            probe = (await self.call([first], lambda r: ExportWeights(names=None)))[0].manifest
            manifests[first] = probe
            sizes = {t.name: t.nbytes for t in probe.tensors if not t.name.startswith("experts.")}
            for dst in dense_to:
                items.setdefault(dst, []).extend(spread(list(sizes), list(sources), sizes))
        where, live = current, list(sources)
        while items:
            epoch = self.topology.epoch
            lost = await self.pull_round(items, manifests)
            gone = sorted({loss.src_rank for losses in lost.values() for loss in losses})
            await self.verdict(gone)
            failing = self.failing_serving()
            if failing and not self.absorbs:
                raise self.give_way(failing)
            if failing:
                await self.absorb(failing)
            if not lost:
                return
            planned = where
            if self.topology.epoch != epoch:  # masked out meanwhile: the survivors hold every expert
                where = self.topology.placement
            live = [r for r in live if r not in gone and r not in self.failed]
            items, manifests = {}, {}
            for dst, losses in sorted(lost.items()):
                for loss in losses:
                    try:
                        again = replan(loss.items, planned, where, live, dst, sizes)
                    except ValueError as e:
                        raise ScaleError(
                            f"rank {dst} lost source rank {loss.src_rank} mid-pull ({loss.reason}) and {e}"
                        ) from None
                    items.setdefault(dst, []).extend(again)
                    came = by_source(again)
                    self.record.pull_losses.append(
                        PullLoss(dst, loss.src_rank, loss.reason, [it.dst_name for it in loss.items], came)
                    )
                    log.warning(
                        "[op %s] rank %d lost source rank %d mid-pull (%s): its %d tensors are re-pulled from ranks %s",
                        self.id,
                        dst,
                        loss.src_rank,
                        loss.reason,
                        len(again),
                        sorted(came),
                    )

    async def pull_round(self, items: dict[int, list[PullItem]], manifests) -> dict[int, list[SourceLoss]]:
        """Pull `items` (puller -> its items), with the `manifests` of some sources in hand and the
        others' asked for; returns what each puller lost. Every exporter serves reads until every
        puller has answered. The pullers reading from a source the router finds failed meanwhile
        drop it at once (on a stalled one they would wait until their timeout); where this
        operation absorbs the failure, it masks the failed ranks out meanwhile."""
        need: dict[int, set[str]] = {}
        for dst, its in items.items():
            for it in its:
                if it.src_rank != dst:  # a rank copying from its own slots needs no manifest from itself
                    need.setdefault(it.src_rank, set()).add(it.src_name)
        exporters = sorted(set(need) | set(manifests))
        lost: dict[int, list[SourceLoss]] = {}
        tasks: dict[int, asyncio.Future] = {}
        masking: asyncio.Future | None = None
        try:
            ask = sorted(r for r in need if r not in manifests)
            replies = await asyncio.gather(
                *(self.call([r], lambda r: ExportWeights(names=sorted(need[r]))) for r in ask),
                return_exceptions=True,
            )
            for r, rep in zip(ask, replies):
                if not isinstance(rep, Exception):
                    manifests[r] = rep[0].manifest
                    continue
                if not self.absorbs:
                    raise rep
                # An exporter that failed: what it was to send is lost before the pull.
                for dst, its in items.items():
                    cut = [it for it in its if it.src_rank == r]
                    if cut:
                        lost.setdefault(dst, []).append(SourceLoss(r, f"rank {r}: its export failed: {rep}", cut))
            todo = {
                dst: kept
                for dst, its in items.items()
                if (kept := [it for it in its if it.src_rank == dst or it.src_rank in manifests])
            }

            def pull(r: int) -> PullWeights:
                remote = {it.src_rank for it in todo[r]} - {r}
                return PullWeights(sources={s: manifests[s] for s in remote}, items=todo[r])

            # Failed serving ranks are watched here, not in call(): the pullers hear of them first.
            tasks = {r: asyncio.ensure_future(self.call([r], pull, preempt=False)) for r in sorted(todo)}
            told: set[int] = set()  # failed sources the pullers were told to drop
            cut: dict[int, list[int]] = {}  # puller -> the failed sources it was told to drop
            while not all(t.done() for t in tasks.values()):
                dead = [s for s in manifests if s not in told and (s in self.failed or self.port.failed(s))]
                if dead:
                    told.update(dead)
                    for dst, srcs in (await self.drop(dead, todo, manifests, tasks)).items():
                        cut.setdefault(dst, []).extend(srcs)
                failing = [] if self.undoing else self.failing_serving()
                if failing and not self.absorbs:
                    for dst, srcs in sorted(cut.items()):
                        for s in srcs:
                            why = f"rank {s} failed: its readers dropped it, and the operation gave way"
                            cut_items = [it.dst_name for it in todo[dst] if it.src_rank == s]
                            self.record.pull_losses.append(PullLoss(dst, s, why, cut_items))
                    raise self.give_way(failing)
                if failing and masking is None and self.can_mask(failing, todo, tasks, told):
                    masking = asyncio.ensure_future(self.absorb(failing))
                await asyncio.wait([t for t in tasks.values() if not t.done()], timeout=0.05)
                for t in tasks.values():
                    if t.done() and t.exception() is not None:
                        raise t.exception()
            for r, t in tasks.items():
                stats = t.result()[0].pull
                self.record.pull_bytes += stats.bytes
                for src, names in by_source(todo[r]).items():
                    got = self.record.pulled_from.setdefault(r, {})
                    got[src] = got.get(src, 0) + len(names)
                if stats.lost:
                    lost.setdefault(r, []).extend(stats.lost)
        finally:
            for t in tasks.values():
                t.cancel()
            if masking is not None:
                await masking
            # Every exporter stops serving reads, also when a pull failed: no transfer stays running.
            await asyncio.gather(
                *(self.call([r], lambda r: EndExport()) for r in exporters if self._known(r) and r not in self.failed),
                return_exceptions=True,
            )
        return lost

    async def drop(self, dead: list[int], todo: dict[int, list[PullItem]], manifests, tasks) -> dict[int, list[int]]:
        """Tell the ranks still pulling from these failed sources to read no more from them;
        returns whom it told to drop which."""
        readers = {
            dst: [s for s in dead if any(it.src_rank == s for it in its)]
            for dst, its in todo.items()
            if not tasks[dst].done()
        }
        readers = {dst: srcs for dst, srcs in readers.items() if srcs}
        if not readers:
            return {}
        log.warning("[op %s] %s: ranks %s read no more from them", self.id, self.failures(dead), sorted(readers))
        why = {s: f"rank {s} failed ({self.failure(s)})" for s in dead}
        results = await asyncio.gather(
            *(
                self.call(
                    [dst],
                    lambda r: DropSources(agents={manifests[s].agent: why[s] for s in readers[r]}),
                    self.cfg.commit_timeout_s,
                    preempt=False,
                )
                for dst in readers
            ),
            return_exceptions=True,
        )
        for dst, res in zip(readers, results):
            if isinstance(res, Exception):  # its pull then ends by NIXL's error or its own timeout
                log.warning("[op %s] rank %d was not told to drop ranks %s: %s", self.id, dst, readers[dst], res)
        return readers

    def can_mask(self, failed: list[int], todo, tasks, told: set[int]) -> bool:
        """Whether masking `failed` out now overwrites no slot a pull in flight still reads (the
        survivors reload experts that only the failed ranks held into spare slots)."""
        current = self.topology.placement
        try:
            target = shrink(current, failed, self.num_experts)
        except ValueError:  # the mask fails with this, once the pulls are over
            return False
        S = current.slots_per_rank
        written = {
            (slot // S, expert_slot_name(layer, slot % S, part))
            for layer, slot in changed_slots(current, target)
            for part in EXPERT_PARTS
        }
        read = {
            (it.src_rank, it.src_name)
            for dst, its in todo.items()
            if not tasks[dst].done()
            for it in its
            if it.src_rank not in told
        }
        return not written & read

    async def verdict(self, ranks: list[int]) -> None:
        """Wait until the router has judged these sources a pull lost: failed (a dead or stalled
        rank is found within its heartbeat deadline, a killed one sooner by its EP peers), or
        alive (it answered meanwhile)."""
        deadline = time.monotonic() + self.cfg.rank_timeout_s + 2 * self.cfg.status_interval_s
        while not all(r in self.failed or self.port.failed(r) for r in ranks) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    async def commit(
        self,
        active: list[int],
        placement: Placement,
        warm: list[int] = (),
        recapture: bool = False,
        involved: list[int] | None = None,
    ) -> float:
        """Pause every rank involved (by default every rank of this operation) at one step
        boundary, install the new active set and expert map in place, resume; returns the
        downtime. On failure roll everyone back to the previous set under a new epoch."""
        if involved is None:
            # Leaving ranks that already exited (a follow-up rebalance) are no longer known.
            involved = sorted(
                r for r in set(self.active) | set(active) | set(self.joiners) | set(self.leaving) if self._known(r)
            )
        epoch = self.topology.epoch + 1
        timeout = self.cfg.commit_timeout_s
        t0 = self.pause_t0 or time.monotonic()
        self.pause_t0 = None
        try:
            # Ranks already paused (mode A, failover) answer at once.
            await self.call(involved, lambda r: Pause(gone=self.failed), timeout)
            if warm:  # modes A and B: the preparation the design keeps out of the pause
                await self.call(warm, lambda r: Warmup(placement=placement, recapture=recapture))
            await self.call(
                involved,
                lambda r: Configure(epoch=epoch, active=active if r in active else [], placement=placement),
                timeout,
            )
            await self.call(involved, lambda r: Resume(), timeout)
        except Exception as e:
            await self.rollback(involved, epoch + 1, f"commit of epoch {epoch} failed: {e}")
            if self.preempted and self.record.masked:  # the rollback did the failover's work
                ranks, phase = ", ".join(map(str, self.record.masked)), self.phase.value
                raise ScaleError(
                    f"serving rank {ranks} failed during {phase}: rolled back without it at epoch {epoch + 1}"
                ) from e
            raise
        downtime = time.monotonic() - t0
        self.topology = Committed(epoch=epoch, active=sorted(active), placement=placement)
        log.info("[op %s] epoch %d committed: active %s, downtime %.1f ms", self.id, epoch, self.active, downtime * 1e3)
        return downtime

    def failing_serving(self) -> list[int]:
        """Serving ranks found dead or stalled since this operation began (not the ones it masks):
        by the router, or by their provider before the router's next look."""
        return [
            r for r in self.active if r not in self.failed and (self.port.failed(r) or self.provider.alive(r) is False)
        ]

    def failure(self, rank: int) -> str:
        """Who found `rank` failed: its provider saw its process exit, or the router (whose own
        line says why: no answer, or a peer's collective failed on it)."""
        return "its process exited" if self.provider.alive(rank) is False else "found dead or stalled by the router"

    def failures(self, ranks) -> str:
        return f"ranks {sorted(ranks)} failed ({'; '.join(f'{r}: {self.failure(r)}' for r in sorted(ranks))})"

    def _known(self, rank: int) -> bool:
        try:
            self.port.status(rank)
            return True
        except KeyError:
            return False

    async def rollback(self, involved, epoch: int, reason: str) -> None:
        """Back to the previous set under `epoch`, less the serving ranks found dead: those are
        masked out as a failover would (`mask`), so that no epoch ever lists a dead rank as active
        and routable. A rank that misses a step of it is logged, and the rest goes on."""
        self.undoing = True
        old = self.topology
        dead = [r for r in old.active if r in self.failed or self.port.failed(r) or self.provider.alive(r) is False]
        active, placement = old.active, old.placement
        if dead and len(dead) < len(old.active):
            try:
                placement = shrink(old.placement, dead, self.num_experts)
                active = [r for r in old.active if r not in dead]
            except ValueError as e:  # the failover that follows fails the same way, and says so
                log.error("[op %s] cannot mask ranks %s out in the rollback: %s", self.id, dead, e)
        masked = [r for r in old.active if r not in active]
        log.error(
            "[op %s] rolling back to ranks %s at epoch %d: %s%s",
            self.id,
            active,
            epoch,
            reason,
            f"; masking out ranks {masked}, found dead" if masked else "",
        )
        reachable = [r for r in involved if r not in masked and self.provider.alive(r) is not False]
        # Survivors may be inside a collective with a rank that died during the commit: told it
        # is gone, they give up on it now rather than at the EP timeout.
        gone = sorted({*self.failed, *dead, *(r for r in involved if r not in reachable)})
        await self.mask(masked, placement, reachable, gone)
        await self.each(
            reachable,
            lambda r: Configure(epoch=epoch, active=active if r in active else [], placement=placement),
            self.cfg.commit_timeout_s,
        )
        await self.each(reachable, lambda r: Resume(), self.cfg.commit_timeout_s)
        self.topology = Committed(epoch=epoch, active=active, placement=placement)
        await self.masked_out(masked)
        self.rolled_back = True

    async def fence(self, ranks: list[int]) -> None:
        """Failed serving ranks can never act again (never two epochs: a stalled rank that comes
        back must find itself gone), and are no longer known."""
        for r in ranks:
            if not self._known(r):  # fenced by an earlier attempt
                continue
            try:
                await self.provider.fence(r, self.port.status(r).pid, self.id)
            except Exception as e:
                if not self.undoing:
                    raise
                # A rollback stopped here would leave the survivors paused: it masks the rank out
                # all the same (no epoch lists it) and says that it may still be running.
                log.error("[op %s] fencing rank %d failed, it may still run: %s", self.id, r, e)
            self.port.unlist(r, self.id)  # masked out all the same: nothing may be routed to it
            self.port.forget(r)

    async def mask(self, failed: list[int], target: Placement, pause: list[int], gone: list[int]) -> None:
        """The steps that mask failed serving ranks out, before the epoch without them is
        installed; shared by a failover (also one inside a scale-up) and a rollback. The failed
        ranks are fenced; the ranks in `pause` stop waiting for `gone` and pause with their
        requests intact; experts that only the failed ranks held are loaded from the checkpoint
        into the survivors' spare slots (where `target` differs from the committed placement)."""
        current = self.topology.placement
        await self.fence(failed)
        if not self.undoing:  # a failover's downtime starts with this pause (a rollback's is its commit's)
            self.pause_t0 = time.monotonic()
        await self.each(pause, lambda r: Pause(gone=gone), self.cfg.commit_timeout_s)
        changed = changed_slots(current, target)
        self.record.experts_from_disk += len(changed)
        if changed:  # none where every expert has a replica on a survivor: those serve it at once
            log.warning("[op %s] %d expert slots no survivor holds: loaded from the checkpoint", self.id, len(changed))
        reload = sorted({slot // target.slots_per_rank for _, slot in changed})
        await self.each(reload, lambda r: LoadExperts(placement=target, since=current))

    async def masked_out(self, failed: list[int]) -> None:
        """The epoch without these failed ranks is committed: the record says so (the scaler
        replaces them), and the serving ranks forget them."""
        if failed:
            self.record.masked = sorted({*self.record.masked, *failed})
            await self.each(self.active, lambda r: Disconnect(ranks=failed), self.cfg.commit_timeout_s)

    async def each(self, ranks, make: Callable[[int], object], timeout: float | None = None) -> None:
        """`call`, except while undoing (a rollback): then a rank that misses it is logged and the
        others go on, since the rollback must reach every rank it can."""
        if not self.undoing:
            await self.call(ranks, make, timeout)
            return
        results = await asyncio.gather(*(self.call([r], make, timeout) for r in ranks), return_exceptions=True)
        for r, res in zip(ranks, results):
            if isinstance(res, Exception):
                log.error("[op %s] rank %d missed the rollback: %s", self.id, r, res)

    # ---- the operations ----------------------------------------------------------------------
    async def scale_up(self) -> None:
        req = self.req
        if req.mode is ScaleMode.BLOCKING:
            self.transition(Phase.PAUSING, "mode A stops serving for the whole operation")
            await self.pause_all()
        target = await self.prepare_joiners()
        self.transition(Phase.COMMITTING)
        rebuild = req.mode.warms_inside_pause
        downtime = await self.commit(
            sorted(self.active + self.joiners), target, warm=self.joiners if rebuild else (), recapture=rebuild
        )
        self.scale_committed(downtime)
        await self.call(self.joiners, lambda r: SetRoutable(routable=True))

    async def prepare_joiners(self) -> Placement:
        """Start, load, warm up and connect the joiners; returns the placement to commit. A
        joiner whose process dies on the way is replaced by a new one (the others start anew
        too: they hold connections to it), up to Router.joiner_retries times."""
        fault, why, attempt = self.req.fault, f"joiners {self.joiners}", 1
        while True:
            self.transition(Phase.STARTING, why)
            try:
                return await self.prepare(fault)
            except Exception as e:
                dead = {j: "died" for j in self.joiners if self.provider.alive(j) is False}
                dead |= {j: "stalled" for j in self.joiners if j not in dead and self.stalled(j)}
                if not dead or self.preempted:
                    raise
                error = f"{type(e).__name__}: {e}"
                if attempt > self.cfg.joiner_retries:
                    hows = set(dead.values())
                    verb = hows.pop() if len(hows) == 1 else "died or stalled"
                    raise ScaleError(
                        f"joiners {sorted(dead)} {verb} during {self.phase.value}, after {attempt - 1} retries "
                        f"(Router.joiner_retries): {error}"
                    ) from e
                for j, how in dead.items():
                    self.record.joiner_retries.append(JoinerRetry(j, self.phase.value, error, attempt + 1))
                    log.warning(
                        "[op %s] joiner %d %s during %s (%s): a new one starts (attempt %d of %d)",
                        self.id,
                        j,
                        how,
                        self.phase.value,
                        error,
                        attempt + 1,
                        self.cfg.joiner_retries + 1,
                    )
                for j in [j for j, how in dead.items() if how == "stalled"]:
                    # SIGKILL now: a stopped process ignores the SIGTERM a release starts with.
                    await self.provider.fence(j, self.port.status(j).pid, self.id)
                self.undoing = True  # the serving group forgets the joiners whatever happens meanwhile
                try:
                    await self.drop_joiners()
                finally:
                    self.undoing = False
                attempt += 1
                fault, why = "", f"new joiners {self.joiners}, attempt {attempt}"  # a fault was the first's

    async def start_joiners(self, fault: str) -> None:
        """Bring the joiners' processes up (parked, restored from a snapshot, or new) and find them."""
        self.record.joined_from = await self.provider.acquire(self.joiners, self.id, fault)
        self.record.snapshot_refused = dict(self.provider.refused)
        for r, how in self.record.joined_from.items():
            if how != "parked":  # a new process: whatever instance this rank had is gone
                self.port.forget(r)
        await self.giving_way(self.port.discover(self.joiners, self.provider, self.cfg.prepare_timeout_s))
        for r, how in self.record.joined_from.items():
            if how != "parked":  # a new process says whether a snapshot fitted
                self.record.joined_from[r] = self.port.status(r).started_from
        restored = [r for r, how in self.record.joined_from.items() if how == "parked"]
        await self.call(restored, lambda r: Restore())

    async def prepare(self, fault: str) -> Placement:
        """One attempt of `prepare_joiners`, from STARTING."""
        req, current = self.req, self.topology.placement
        target = grow(current, self.joiners, self.num_experts, self.load)
        await self.start_joiners(fault)
        self.transition(Phase.LOADING, "dense weights spread over serving ranks, experts per the target map")
        await self.pull_experts(current, target, list(self.active), dense_to=self.joiners)
        if self.failed:  # masked out meanwhile: the joiners' slots as pulled, the others the survivors'
            S, now = target.slots_per_rank, self.topology.placement.slots
            rows = [
                [t if s // S in self.joiners else x for s, (t, x) in enumerate(zip(a, b))]
                for a, b in zip(target.slots, now)
            ]
            target = Placement(slots_per_rank=S, slots=rows)
        if not req.mode.warms_inside_pause:
            self.transition(Phase.WARMING, "joiners alone, remote peers masked")
            await self.call(self.joiners, lambda r: Warmup(placement=target))
        self.transition(Phase.CONNECTING, "serving ranks connect joiners masked")
        meta = {r: self.port.status(r).metadata for r in self.active + self.joiners}
        await self.call(self.active, lambda r: Connect(peers={j: meta[j] for j in self.joiners}, activate=False))
        await self.call(self.joiners, lambda r: Connect(peers={p: m for p, m in meta.items() if p != r}))
        return target

    async def rebuild(self) -> None:
        """Every serving rank failed: fence them all, then form a group of `req.dp_size` ranks
        from scratch as the first one was, every weight from the checkpoint."""
        lost = self.failures(self.failed) if self.failed else "no rank serves"
        self.transition(Phase.MASKING, f"{lost}: no survivor; a new group of {self.req.dp_size} from scratch")
        await self.fence(self.failed)
        self.record.masked = list(self.failed)
        # Not `gone` to anyone from here: their numbers may be the new ranks'.
        self.failed = []
        self.transition(Phase.STARTING, f"ranks {self.joiners}")
        await self.start_joiners(self.req.fault)
        st = self.port.status(self.joiners[0])
        placement = balanced_placement(
            st.num_moe_layers, self.num_experts, self.max_ranks, st.slots_per_rank, self.joiners
        )
        self.transition(Phase.LOADING, "every weight from the checkpoint")
        await self.call(self.joiners, lambda r: LoadWeights(placement=placement))
        self.transition(Phase.CONNECTING, "the new ranks connect each other")
        meta = {r: self.port.status(r).metadata for r in self.joiners}
        await self.call(self.joiners, lambda r: Connect(peers={p: m for p, m in meta.items() if p != r}))
        self.transition(Phase.COMMITTING)
        self.scale_committed(await self.commit(self.joiners, placement, involved=self.joiners))
        await self.call(self.joiners, lambda r: SetRoutable(routable=True))

    async def scale_down(self) -> None:
        req, current = self.req, self.topology.placement
        remaining = [r for r in self.active if r not in self.leaving]
        target = shrink(current, self.leaving, self.num_experts)
        if req.mode is ScaleMode.BLOCKING:
            # Blocking: serving stops first; the leaving ranks' requests move at once and wait.
            await self.pause_all()
        asked = " (removed as asked)" if req.remove else ""
        self.transition(Phase.DRAINING, f"ranks {self.leaving}{asked} out of routing")
        await self.call(self.leaving, lambda r: SetRoutable(routable=False))
        drain_s = 0.0 if req.mode is ScaleMode.BLOCKING else req.drain_timeout_s
        # Handed-over requests go to remaining ranks by name: a routing table that still lists a
        # leaving rank would send one to a rank about to park.
        targets = [self.port.status(r).instance_id for r in remaining]
        drained = asyncio.ensure_future(
            self.call(
                self.leaving,
                lambda r: Drain(timeout_s=drain_s, targets=targets),
                drain_s + self.cfg.prepare_timeout_s,
            )
        )
        self.transition(Phase.MIGRATING, "experts of leaving ranks to remaining ranks")
        interim_downtime = await self.migrate(current, target, sources=self.active)
        self.record.handed_over = sum(rep.handed_over for rep in await drained)
        self.transition(Phase.COMMITTING)
        rebuild = req.mode.warms_inside_pause  # re-warm and re-capture inside the pause
        self.scale_committed(
            interim_downtime
            + await self.commit(remaining, target, warm=remaining if rebuild else (), recapture=rebuild)
        )
        park = self.cfg.park_leaving
        self.transition(Phase.CLEANUP, f"ranks {self.leaving} disconnect and {'park' if park else 'exit'}")
        await self.call(remaining, lambda r: Disconnect(ranks=self.leaving))
        if park:
            checkpoint = self.provider.checkpoints_parked
            await self.call(self.leaving, lambda r: Park(checkpoint=checkpoint))
            for r in self.leaving:
                await self.provider.park(r, self.port.status(r).pid, self.id)
            self.record.parked = list(self.leaving)
            return
        await self.call(self.leaving, lambda r: Exit())
        for r in self.leaving:
            await self.provider.release(r, self.id)
            self.port.forget(r)

    async def failover(self) -> None:
        """Mask failed serving ranks out: a forced scale-down that asks nothing of them. The
        commit installs the survivors under a new epoch and every paused step runs again."""
        survivors, target = await self.ready_survivors(self.failed)
        self.transition(Phase.COMMITTING)
        self.scale_committed(await self.commit(survivors, target))
        await self.masked_out(self.failed)

    async def ready_survivors(self, failed: list[int]) -> tuple[list[int], Placement]:
        """Ready the survivors to serve without these failed serving ranks (`mask`); returns them
        and the placement to commit them with."""
        self.failed = sorted({*self.failed, *failed})
        survivors = [r for r in self.active if r not in self.failed]
        if not survivors:
            raise ScaleError(f"every serving rank failed ({self.failed}): nothing to fail over to")
        target = shrink(self.topology.placement, failed, self.num_experts)
        self.transition(Phase.MASKING, f"{self.failures(failed)}; survivors {survivors} pause and reload their experts")
        await self.mask(failed, target, survivors, self.failed)
        return survivors, target

    async def absorb(self, failed: list[int]) -> None:
        """A failover inside this scale-up: mask the failed serving ranks out and commit the
        survivors (the joiners, still loading, take no part), then go on loading."""
        survivors, target = await self.ready_survivors(failed)
        downtime = await self.commit(survivors, target, involved=survivors)
        self.record.failover_downtime_s, self.record.failover_committed_at = round(downtime, 6), time.time()
        await self.masked_out(failed)
        if self.req.mode is ScaleMode.BLOCKING:  # mode A keeps serving paused for the whole operation
            await self.pause_all()
        self.transition(Phase.LOADING, f"ranks {failed} masked out; the joiners' lost reads come from {survivors}")

    def scale_committed(self, downtime: float) -> None:
        self.committed = True
        self.record.downtime_s, self.record.committed_at = round(downtime, 6), time.time()

    async def pause_all(self) -> None:
        self.pause_t0 = time.monotonic()
        await self.call(self.active, lambda r: Pause(), self.cfg.commit_timeout_s)

    async def migrate(self, current: Placement, target: Placement, sources) -> float:
        """Refill the slots `target` changes; returns the downtime this cost. While serving, first
        stop routing to those slots (a short commit of the interim map, unless nothing routed
        changes); with serving paused (mode A) they are simply overwritten."""
        mid = interim(current, target)
        downtime = 0.0
        if mid.slots != current.slots and self.pause_t0 is None:
            downtime = await self.commit(self.active, mid)
        await self.pull_experts(mid, target, list(sources))
        return downtime

    async def rebalance(self, load: list[list[int]]) -> None:
        """Async EPLB after the scale: replicas follow the measured per-expert load."""
        current = self.topology.placement
        target = rebalance(current, self.active, self.num_experts, load)
        if target.slots == current.slots or not any(any(row) for row in load):
            return
        self.transition(Phase.MIGRATING, f"{len(changed_slots(current, target))} slots change")
        downtime = await self.migrate(current, target, self.active)
        self.transition(Phase.COMMITTING)
        downtime += await self.commit(self.active, target)
        self.record.rebalance_downtime_s = round(downtime, 6)

    async def abort(self, reason: str) -> None:
        """Undo a prepare: the serving group forgets the joiners, their processes go."""
        log.error("[op %s] aborting in %s: %s", self.id, self.phase.value, reason)
        self.undoing = True
        t = self.cfg.commit_timeout_s
        await self.drop_joiners()
        # Not those found dead (a failover's, or those its rollback masked out).
        back = [r for r in self.leaving if r in self.active and r not in self.failed]
        if back:  # back into routing: they never left the active set
            await asyncio.gather(
                *(self.call([r], lambda r: SetRoutable(routable=True), t) for r in back),
                return_exceptions=True,
            )
        if self.pause_t0 is not None:  # mode A paused serving for the operation
            await asyncio.gather(*(self.call([r], lambda r: Resume(), t) for r in self.active), return_exceptions=True)

    async def drop_joiners(self) -> None:
        """The serving group forgets the joiners, and their processes go."""
        t = self.cfg.commit_timeout_s
        if self.joiners:
            failing = self.failing_serving()
            disconnect = asyncio.gather(
                *(self.call([r], lambda r: Disconnect(ranks=self.joiners), t) for r in self.active if r not in failing),
                return_exceptions=True,
            )
            if failing:
                # The survivors' step loops wait in a collective for the failed ranks, and their
                # disconnect behind it, until the failover (next) masks those out: not awaited.
                self._background.add(disconnect)
                disconnect.add_done_callback(self._background.discard)
            else:
                await disconnect
            for j in self.joiners:
                if failing:  # the failover waits for this: no grace for a joiner, it serves nothing
                    await self.provider.fence(j, self.port.status(j).pid if self._known(j) else 0, self.id)
                else:
                    await self.provider.release(j, self.id, graceful=False)
                self.port.forget(j)

    async def execute(self, load_now: Callable[[], list[list[int]]]) -> Committed:
        """Run the operation; `load_now` gives the measured expert load for the follow-up EPLB."""
        try:
            kind = self.record.kind
            run = {"up": self.scale_up, "down": self.scale_down, "failover": self.failover, "rebuild": self.rebuild}
            await run[kind]()
            if self.cfg.rebalance and kind in ("up", "down"):
                self.transition(Phase.REBALANCING, "async EPLB from measured load")
                await self.rebalance(load_now())
            self.transition(Phase.DONE)
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
            if self.committed:
                # The new topology serves; only the follow-up (cleanup or rebalance) failed.
                self.record.followup_error = error
                log.error("[op %s] after the commit: %s", self.id, error)
                self.transition(Phase.DONE, f"committed; follow-up failed: {error}")
            elif self.rolled_back:
                self.record.error = error
                await self.abort(str(e))
                self.transition(Phase.ROLLED_BACK, error)
            else:
                self.record.error = error
                await self.abort(error)
                self.transition(Phase.ABORTED, error)
        finally:
            self.provider.settled(self.id)
        return self.topology


def by_source(items: list[PullItem]) -> dict[int, list[str]]:
    """Destinations per source rank."""
    out: dict[int, list[str]] = {}
    for it in items:
        out.setdefault(it.src_rank, []).append(it.dst_name)
    return out
