"""The scaler: one operation at a time toward the latest requested size (a request that arrives
meanwhile only moves the target, and the latest target wins), failovers of serving ranks found
dead before any queued request, and replacements for what an operation masked out."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from typing import Protocol

import msgspec

from components.control.capacity import CapacityProvider
from components.control.journal import ENDED, HISTORY, INTERRUPTED, OpJournal, Tally
from components.control.operation import Operation, RankPort
from components.protocol.config import RouterConfig
from components.protocol.topology import Committed, OpRecord, ScaleRequest

log = logging.getLogger(__name__)


class Scaler:
    """Runs operations one at a time toward the latest requested size. While one runs, the
    topology it has committed so far is the deployment's (`topology`). With a `journal`, the
    history and the counters (`tally`) outlive the router: a restarted one reloads them (`settle`
    then says how what was in flight ended)."""

    def __init__(
        self,
        owner: TopologyOwner,
        port: RankPort,
        provider: CapacityProvider,
        cfg: RouterConfig,
        max_ranks: int,
        journal: OpJournal | None = None,
    ):
        self.owner, self.port, self.provider, self.cfg, self.max_ranks = owner, port, provider, cfg, max_ranks
        self.journal = journal
        self.pending: ScaleRequest | None = None
        self.resume: ScaleRequest | None = None  # a removal waiting for the scale-up before it
        self.failing: set[int] = set()  # serving ranks found dead, not yet failed over
        # Every serving rank failed: the size to rebuild the deployment at, until a rebuild is done.
        self.lost_size: int | None = None
        # The size the deployment is to have: where the last scale that was done took it (or, before
        # any, the size it had when the scaler first acted). A rebuild brings it back to that.
        self.wanted: int | None = None
        self.backoff_s = 0.0  # the pause before the next failover or rebuild, after one failed
        self.current: Operation | None = None
        self.history, self.tally = journal.load() if journal else ([], Tally())
        numbers = [int(m.group(1)) for r in self.history if (m := re.match(r"op-(\d+)-", r.id))]
        if numbers:
            Operation.number_after(max(numbers))
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def busy(self) -> bool:
        return self.current is not None or self.pending is not None or bool(self.failing) or self.lost

    @property
    def lost(self) -> bool:
        """Every serving rank failed, and the deployment is not back yet."""
        return self.lost_size is not None

    def request(self, req: ScaleRequest) -> None:
        self.pending, self.resume = req, None  # the latest target wins over one still queued
        if self.journal:
            self.journal.queue(req, time.time())
        self._idle.clear()
        self._wake.set()

    async def wait_idle(self) -> OpRecord | None:
        await self._idle.wait()
        return self.history[-1] if self.history else None

    def settle(self, outcome: str, size: int | None = None) -> None:
        """The reloaded operations the last router left unfinished are over: `interrupted`, with
        what the router that took over made of the deployment (`outcome`). Given the size of the
        group it adopted, what the last router was asked for is asked for again, not lost with it:
        the request it had queued, else the last interrupted scale (a scale the API accepted, or
        the router queued to replace a rank lost at start). An interrupted one once: one that was
        itself taken up again and interrupted is dropped, saying so (it may be what stops the
        router). Without a size (a group formed from scratch) none is."""
        cut = []
        for rec in self.history:
            if rec.phase not in ENDED:
                rec.error = f"the router running it stopped in {rec.phase}; the next one {outcome}"
                log.warning("[op %s] interrupted: %s", rec.id, rec.error)
                rec.phase = INTERRUPTED
                self.tally.count(rec)
                self._journal(rec)
                cut.append(rec)
        queued = self.journal.queued.queued if self.journal and self.journal.queued else None
        if size is None:  # a group formed from scratch: what the last one was asked is moot
            if self.journal:
                self.journal.drop_queued()
            return
        if queued is not None:  # the latest target wins, over the operation it waited behind too
            if queued.dp_size != size or queued.remove:
                log.info("the request for dp_size %d the last router had queued is asked for again", queued.dp_size)
                self.request(msgspec.structs.replace(queued, fault=""))
            else:
                self.journal.drop_queued()
            return
        last = next((r for r in reversed(cut) if r.kind in ("up", "down")), None)
        if last is None or last.to_size == size:
            return
        if last.resumes:
            log.warning(
                "[op %s] not asked for again: it took up op %s, which was interrupted too; dp_size stays %d",
                last.id,
                last.resumes,
                size,
            )
            return
        log.info(
            "[op %s] its target dp_size %d is asked for again (the group adopted has %d)", last.id, last.to_size, size
        )
        remove = last.leaving if last.kind == "down" else []
        self.request(ScaleRequest(dp_size=last.to_size, remove=remove, mode=last.mode, resumes=last.id))

    def _journal(self, record: OpRecord) -> None:
        if self.journal:
            self.journal.save(record)

    def fail(self, ranks: list[int]) -> None:
        """Serving ranks found dead: a failover runs before any queued request (after the
        operation in flight, whose calls to them fail at once)."""
        self.failing |= set(ranks)
        self._idle.clear()
        self._wake.set()

    async def run(self, ready: asyncio.Event) -> None:
        await ready.wait()
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                await self._work()
            except Exception:  # the scaler must outlive any bug: later requests still run
                log.exception("scaler: unexpected error; waiting for the next request")
                self.current = None
            self._idle.set()

    async def _work(self) -> None:
        while self.failing or self.pending is not None or self.lost:
            if self.backoff_s and (self.failing or self.lost):
                await asyncio.sleep(self.backoff_s)  # the last failover or rebuild failed (logged)
            start = self.owner.committed
            if self.wanted is None:
                self.wanted = len(start.active)
            self.failing &= set(start.active)  # a rank that no longer serves needs no failover
            failed = sorted(self.failing)
            note = ""  # what became of a removal the API took (_removal_now)
            if self.lost or not set(start.active) - self.failing:
                # Nothing to fail over to: rebuilt at the size it had, or one asked for since.
                size = self.pending.dp_size if self.pending else self.lost_size or self.wanted
                if not self.lost:
                    log.error("every serving rank failed (%s): rebuilding the deployment at %d ranks", failed, size)
                self.lost_size, self.pending, self.resume = size, None, None
                req = ScaleRequest(dp_size=size)
            elif failed:
                req = ScaleRequest(dp_size=len(start.active) - len(failed))
            elif self.pending is not None:
                req, self.pending = self.pending, None
                req, note = self._removal_now(req, start.active) if req.remove else (req, "")
                if req.dp_size == len(start.active):
                    if note:
                        log.warning("%s: nothing left to do", note)
                    continue
            else:
                continue
            op = Operation(
                req,
                start,
                self.owner.expert_load(),
                self.port,
                self.provider,
                self.cfg,
                self.max_ranks,
                self.owner.num_experts,
                failed,
                on_change=self._journal,
            )
            self.current = op
            if note:
                log.warning("[op %s] %s", op.id, note)
            if req.resumes:
                log.info("[op %s] takes up the target of op %s, interrupted with its router", op.id, req.resumes)
            if op.record.kind == "rebuild":  # it fences them now, and its new ranks may take their numbers
                self.failing -= set(failed)
            self.history.append(op.record)
            del self.history[:-HISTORY]
            self._journal(op.record)
            result = await op.execute(self.owner.expert_load)
            self.current = None
            self.tally.count(op.record)
            self.owner.operation_ended(op.record, result)
            self._count_failure(op)
            if op.record.phase == "done" and op.record.kind in ("up", "down", "rebuild"):
                self.wanted = op.record.to_size
            if op.record.kind == "rebuild":
                if op.record.phase == "done":
                    log.info("[op %s] the deployment serves again at %d ranks", op.id, len(result.active))
                    self.lost_size = None
                continue
            masked = set(op.record.masked)  # by a failover, a rollback, or a scale-up's own failover
            # Found dead by their provider before the router looked: failed over all the same.
            self.failing |= set(op.gave_way_to) - masked
            if (op.preempted or (masked and op.record.phase == "done")) and not failed and self.pending is None:
                # Cut short by a failed serving rank, or done less the ranks it masked out: tried
                # again once that rank is masked out (by the failover or its rollback), and then it
                # also replaces what failed (an injected fault was this attempt's).
                log.info("[op %s] its target dp_size %d is requested again", op.id, req.dp_size)
                self.pending = msgspec.structs.replace(req, fault="")
            if not masked.issuperset(failed):
                # A survivor failed too (it is found and joins `failing`): tried again, backing off.
                continue
            self.failing -= masked
            if masked and self.pending is None:
                # The capacity provider replaces what failed: back to the size before.
                self.pending = ScaleRequest(dp_size=len(start.active))
            self._resume_removal(op)

    def _removal_now(self, req: ScaleRequest, active: list[int]) -> tuple[ScaleRequest, str]:
        """What to run now of a removal, and what became of it if that is not the removal as
        asked. The API checked it against the active set it saw, and its dp_size is the size it
        leaves; a failover may have come between. A rank it names that failed has left already;
        other ranks that failed are replaced first (by numbers other than the leaving ones:
        after the removal the lowest free number would be a leaver's), the removal waiting in
        `resume` until that scale-up is done."""
        keep = [r for r in req.remove if r in active]
        gone = sorted(set(req.remove) - set(keep))
        note = f"removal of ranks {req.remove}: ranks {gone} no longer serve" if gone else ""
        if not keep:
            return msgspec.structs.replace(req, remove=[]), note  # to its size, without them
        short = req.dp_size - (len(active) - len(keep))
        if short > 0:
            self.resume = msgspec.structs.replace(req, remove=keep)
            why = f"removal of ranks {keep} waits: ranks that failed since it was asked are replaced first ({short})"
            return ScaleRequest(dp_size=len(active) + short, mode=req.mode), why
        return msgspec.structs.replace(req, remove=keep, dp_size=len(active) - len(keep)), note

    def _resume_removal(self, op: Operation) -> None:
        """A scale-up a removal waited for (`_removal_now`) ended: the removal runs next once it
        is done; while it is tried again it waits on; otherwise it is dropped, saying so."""
        if self.resume is None or op.record.kind != "up" or self.pending is not None:
            return
        if op.record.phase == "done":
            self.pending = self.resume
        else:
            log.warning("[op %s] the removal of ranks %s is dropped: %s", op.id, self.resume.remove, op.record.error)
        self.resume = None

    def _count_failure(self, op: Operation) -> None:
        """A failover or rebuild that failed doubles the pause before the next one (from
        status_interval_s up to Router.retry_backoff_max_s); one that is done resets it. One that
        gave way to a rank failing meanwhile did not fail: the next one, at once, has it too."""
        if op.record.kind not in ("failover", "rebuild") or op.preempted:
            return
        if op.record.phase == "done":
            self.backoff_s = 0.0
            return
        cap = self.cfg.retry_backoff_max_s
        self.backoff_s = min(cap, max(self.cfg.status_interval_s, 2 * self.backoff_s))
        log.warning("[op %s] %s %s: the next attempt in %.1f s", op.id, op.record.kind, op.record.phase, self.backoff_s)


class TopologyOwner(Protocol):
    """The one owner of topology state (the router): what the scaler reads, and where an
    operation's result goes."""

    @property
    def committed(self) -> Committed: ...

    @property
    def num_experts(self) -> int: ...

    def expert_load(self) -> list[list[int]]:
        """Tokens routed to each expert per MoE layer since the last rebalance, over active ranks."""

    def operation_ended(self, record: OpRecord, topology: Committed) -> None:
        """Take over the topology an operation left committed."""
