"""Router: the topology authority (epoch, active ranks, expert placement) with a control HTTP API.

At start it forms the first group from the worker ranks `dp_size` says: it learns each rank's
communicator metadata, connects every rank to every other, installs epoch 1 with a balanced
expert placement, starts the ranks stepping and makes them routable. The frontend never talks
to the router: what the frontend may route to is the set of routable worker instances.

It keeps no state the ranks do not hold: `dynamo serve` restarts it when it dies, and a restarted
router finds the ranks serving and adopts what they serve (`RouterService.adopt`); requests flow
on meanwhile, since they never pass through it.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, ClassVar

import msgspec
from aiohttp import web
from aiohttp.abc import AbstractAccessLogger
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from components.control.capacity import CapacityProvider, LocalProvider
from components.control.journal import OpJournal, Tally
from components.control.scaler import Scaler
from components.graph.component import EXIT_CANNOT_START, LOG_FORMAT, Component, component_config, load_context
from components.graph.runtime import unlist
from components.protocol.config import RouterConfig, WorkerConfig
from components.protocol.lifecycle import RankState
from components.protocol.messages import (
    Configure,
    Connect,
    ControlReply,
    Describe,
    Disconnect,
    EndExport,
    Exit,
    LoadExperts,
    Pause,
    RankStatus,
    Resume,
    SetRoutable,
    decode_reply,
    encode,
)
from components.protocol.placement import balanced_placement
from components.protocol.topology import Committed, OpRecord, RankView, ScaleMode, ScaleRequest, Topology

log = logging.getLogger("components.control.router")

LOOPBACK = ("127.0.0.1", "localhost", "::1")
OPEN_PATHS = ("/health", "/metrics")  # served without the bearer token (GET only)


class Router(Component):
    Config = RouterConfig

    module: ClassVar[str] = "components.control.router"

    @classmethod
    def urls(cls, config: Any) -> dict[str, str]:
        return {"control API": f"http://{config.host}:{config.port}/topology"}

    @classmethod
    def processes(cls, config: Any, ctx):
        if config.host not in LOOPBACK and not config.token:
            raise ValueError(f"Router.host {config.host!r} exposes the control API: set Router.token too")
        worker = ctx.configs.get("Worker", {})
        if config.checkpoint_parked and worker.get("device") == "cuda" and not worker.get("vmm"):
            raise ValueError(
                "Router.checkpoint_parked needs --Worker.vmm=true: a CUDA checkpoint of a "
                "worker whose weights are not in the VMM arena holds them all, and one whose "
                "memory was exported for CUDA IPC cannot be restored"
            )
        # Restarted when it dies or hangs: the ranks serve on meanwhile, and it adopts what they serve.
        return [
            msgspec.structs.replace(
                s,
                restart=True,
                health_url=config.health_url,
                liveness_timeout_s=config.liveness_timeout_s,
                startup_timeout_s=config.startup_timeout_s,
            )
            for s in super().processes(config, ctx)
        ]


class ControlError(RuntimeError):
    pass


class CannotStart(ControlError):
    """The deployment cannot be formed as configured: the router exits with EXIT_CANNOT_START,
    which stops the graph with this reason instead of restarting the router into it again."""


class ScaleBody(msgspec.Struct, forbid_unknown_fields=True):
    """POST /scale. Unknown fields are refused: a misspelt option must not fall back to a default."""

    dp_size: int | msgspec.UnsetType = msgspec.UNSET
    remove: list[int] | msgspec.UnsetType = msgspec.UNSET  # ranks to retire, instead of a dp_size
    mode: str = "C"
    drain_timeout: float | None = None  # seconds; default Router.drain_timeout_s
    fault: str = ""


class ElasticEPBody(msgspec.Struct, forbid_unknown_fields=True):
    """POST /scale_elastic_ep, vLLM's API."""

    new_data_parallel_size: int
    drain_timeout: float | None = None


MAX_BODY_BYTES = 64 << 10
ADOPT_SETTLE_S = 1.0
# How often a wait for registrations looks at the endpoint's instances: instance_ids() reads the
# client's watched set (no I/O), so polling it often costs nothing, while every poll interval is
# time a joiner that registered waits to be found (at 0.1 s: 83-100 ms of each join, bench.join).
DISCOVER_POLL_S = 0.01
RETRY_DESCRIBE_S = 0.1  # an instance that failed to describe itself is asked again after this
MAX_JSON_DEPTH = 8
NO_SERVING_RANK = "no serving rank"  # /health's status while every serving rank is lost


class ControlAccessLog(AbstractAccessLogger):
    """The control API's access lines: calls that change something and refusals at INFO, reads
    at DEBUG. The graph's liveness checks and the planner poll /health and /topology every second
    or so, and Prometheus scrapes /metrics: at INFO they were a third of the log, between the lines
    about scaling."""

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        read = request.method in ("GET", "HEAD") and (response.status < 400 or request.path == "/health")
        self.logger.log(
            logging.DEBUG if read else logging.INFO,
            "%s %s %s -> %d in %.1f ms",
            request.remote,
            request.method,
            request.path_qs,
            response.status,
            time * 1e3,
        )


class RouterService:
    """The one owner of topology state (the committed epoch, active set and expert placement, and
    each rank's instance and status) behind the control HTTP API. Scale operations reach ranks
    through it as their `RankPort` and hand their committed topology back (`operation_ended`)."""

    def __init__(self, rt, ctx, cfg: RouterConfig, wcfg: WorkerConfig):
        self.rt, self.ctx, self.cfg, self.wcfg = rt, ctx, cfg, wcfg
        self.client = None
        self.instances: dict[int, int] = {}  # rank -> instance id
        self.statuses: dict[int, RankStatus] = {}
        self.last_seen: dict[int, float] = {}  # rank -> when it last answered (monotonic)
        self._undescribed: dict[int, float] = {}  # instance id -> when it last failed to describe itself
        self._committed = Committed(epoch=0, active=[], placement=None)
        self.num_experts = 0
        self.load_base: dict[int, list[list[int]]] = {}  # per rank: expert load at the last rebalance
        self.ready = asyncio.Event()
        self.started = time.monotonic()
        self.scaler: Scaler | None = None
        # Its own registry, not the global one: several routers may live in one process (the tests').
        self.registry = CollectorRegistry()
        self.registry.register(self)

    @property
    def committed(self) -> Committed:
        """What the ranks serve: while an operation runs, what it has committed so far."""
        op = self.scaler.current if self.scaler else None
        return op.topology if op else self._committed

    @property
    def epoch(self) -> int:
        return self.committed.epoch

    @property
    def active(self) -> list[int]:
        return self.committed.active

    def status(self, rank: int) -> RankStatus:
        return self.statuses[rank]

    def failed(self, rank: int) -> bool:
        return self.scaler is not None and rank in self.scaler.failing

    def silent_s(self, rank: int) -> float:
        now = time.monotonic()
        return now - self.last_seen.get(rank, now)

    def operation_ended(self, record: OpRecord, topology: Committed) -> None:
        self._committed = topology
        if record.rebalance_downtime_s is not None:  # an EPLB committed: load counts from here
            self.load_base = {r: self.statuses[r].load for r in topology.active}

    # ---- talking to ranks --------------------------------------------------------------------
    async def send(self, rank: int, msg) -> ControlReply:
        stream = await self.client.direct(encode(msg), self.instances[rank])
        reply: ControlReply | None = None
        async for item in stream:
            reply = decode_reply(item.data())
        if reply is None or not reply.ok:
            raise ControlError(
                f"rank {rank}: {type(msg).__name__.lower()} failed: {reply.error if reply else 'no reply'}"
            )
        self.statuses[rank] = reply.status
        self.last_seen[rank] = time.monotonic()
        return reply

    async def send_all(self, ranks, make) -> list[ControlReply]:
        return await asyncio.gather(*(self.send(r, make(r)) for r in ranks))

    async def discover(
        self,
        ranks: list[int],
        provider: CapacityProvider | None = None,
        timeout: float | None = None,
        partial: bool = False,
    ) -> list[int]:
        """Wait until every rank in `ranks` registered, and learn which instance is which rank.
        Fails early when the provider reports one of them dead, and at the timeout; `partial`
        waits until each registered or died, or the timeout, and returns those that registered."""
        timeout = timeout or self.cfg.bootstrap_timeout_s
        deadline = time.monotonic() + timeout
        while True:
            await self.scan()
            missing = [r for r in ranks if r not in self.instances]
            dead = [r for r in missing if provider is not None and provider.alive(r) is False]
            if partial and (missing == dead or time.monotonic() > deadline):
                return [r for r in ranks if r not in missing]
            if not missing:
                return ranks
            if dead:
                raise ControlError(f"ranks {dead} died before registering")
            if time.monotonic() > deadline:
                raise ControlError(f"ranks {missing} did not appear within {timeout:.0f} s")
            await asyncio.sleep(DISCOVER_POLL_S)

    async def scan(self) -> None:
        """Ask every registered instance not yet known which rank it is."""
        if self.client is None:
            self.client = await self.rt.endpoint(f"{self.ctx.namespace}.worker.control").client()
        ids = self.client.instance_ids()
        self._undescribed = {i: t for i, t in self._undescribed.items() if i in ids}
        for iid in ids:
            if iid in self.instances.values():
                continue
            if time.monotonic() - self._undescribed.get(iid, float("-inf")) < RETRY_DESCRIBE_S:
                continue
            try:
                st = await asyncio.wait_for(self._describe(iid), self.cfg.rank_timeout_s)
            except Exception as e:  # a stale entry of a rank that just went away, or a stalled one
                log.debug("instance %x did not describe itself: %s", iid, e or type(e).__name__)
                self._undescribed[iid] = time.monotonic()
                continue
            self._undescribed.pop(iid, None)
            self.instances[st.rank] = iid
            self.statuses[st.rank] = st
            self.last_seen[st.rank] = time.monotonic()
            log.info("found rank %d (instance %x, %s, epoch %d)", st.rank, iid, st.state, st.epoch)

    async def _describe(self, iid: int) -> RankStatus:
        stream = await self.client.direct(encode(Describe()), iid)
        async for item in stream:
            return decode_reply(item.data()).status
        raise ControlError(f"instance {iid:x} did not reply")

    def unlist(self, rank: int, op: str) -> None:
        endpoints = {"worker.control": self.instances.get(rank)}
        if rank in self.statuses:
            endpoints["worker.generate"] = self.statuses[rank].instance_id
        gone = [f"{name} {iid:x}" for name, iid in endpoints.items() if iid is not None and unlist(self.ctx, name, iid)]
        if gone:
            log.info("[op %s] rank %d's instances out of discovery: %s", op, rank, ", ".join(gone))

    def forget(self, rank: int) -> None:
        self.instances.pop(rank, None)
        self.statuses.pop(rank, None)
        self.last_seen.pop(rank, None)
        self.load_base.pop(rank, None)

    def expert_load(self) -> list[list[int]]:
        """Tokens routed to each expert per MoE layer since the last rebalance, over active ranks
        (a failed rank being masked out counts no more)."""
        total = None
        for r in self.active:
            if r not in self.statuses:
                continue
            cur = self.statuses[r].load
            base = self.load_base.get(r)
            rows = [[c - (base[i][j] if base else 0) for j, c in enumerate(row)] for i, row in enumerate(cur)]
            total = rows if total is None else [[a + b for a, b in zip(x, y)] for x, y in zip(total, rows)]
        return total or []

    async def start(self, provider: CapacityProvider) -> None:
        """Form the first group, or, when the ranks already serve one (this router was restarted),
        adopt it."""
        while not self.statuses:
            await self.scan()
            if not self.client.instance_ids() and all(provider.alive(r) is False for r in range(self.wcfg.dp_size)):
                break  # no rank will come: bootstrap says why
            await asyncio.sleep(DISCOVER_POLL_S)
        # Registrations appear together, but a stalled rank's describe takes its timeout: give
        # every instance the chance to answer before judging what the ranks serve.
        await asyncio.sleep(ADOPT_SETTLE_S)
        await self.scan()
        if any(st.epoch > 0 for st in self.statuses.values()):
            await self.adopt(provider)
        else:
            await self.bootstrap(provider)

    async def bootstrap(self, provider: CapacityProvider) -> None:
        """Form epoch 1 of the ranks `dynamo serve` started. Those that died before registering
        (killed while loading, say), or have not registered `bootstrap_timeout_s` after the
        first did (hung: stopped now, so that none comes back as a second process of its rank),
        are left out, and a scale-up brings the deployment to its size with new ones, as a
        failover would, while the rest serve."""
        first = list(range(self.wcfg.dp_size))
        ranks = await self.discover(first, provider, partial=True)
        lost = [r for r in first if r not in ranks]
        late = [r for r in lost if provider.alive(r) is not False]
        if late:
            log.warning(
                "ranks %s did not register within %.0f s of the first: stopping them (SIGKILL)",
                late,
                self.cfg.bootstrap_timeout_s,
            )
            await asyncio.gather(*(provider.fence(r, 0, "-") for r in late))
        if not ranks:
            raise CannotStart(
                f"every rank of the first group ({lost}) died before registering: their last lines say why"
            )
        if len(ranks) < self.wcfg.min_ranks:
            raise CannotStart(
                f"ranks {lost} of the first group died or hung before registering (their last lines say why): "
                f"{len(ranks)} left, fewer than Worker.min_ranks ({self.wcfg.min_ranks})"
            )
        identities = {self.statuses[r].model_identity for r in ranks}
        if len(identities) != 1:
            raise ControlError(f"ranks serve different models: {identities}")
        meta = {r: self.statuses[r].metadata for r in ranks}
        await self.send_all(ranks, lambda r: Connect(peers={p: m for p, m in meta.items() if p != r}))
        st = self.statuses[ranks[0]]
        self.num_experts = st.num_experts
        placement = balanced_placement(st.num_moe_layers, st.num_experts, self.wcfg.max_ranks, st.slots_per_rank, ranks)
        await self.send_all(ranks, lambda r: LoadExperts(placement=placement))
        await self.send_all(ranks, lambda r: Configure(epoch=1, active=ranks, placement=placement))
        await self.send_all(ranks, lambda r: Resume())
        await self.send_all(ranks, lambda r: SetRoutable(routable=True))
        self._committed = Committed(epoch=1, active=ranks, placement=placement)
        log.info("epoch 1: ranks %s active and routable (%.1f s after start)", ranks, time.monotonic() - self.started)
        self.scaler.settle(f"found no rank serving and formed epoch 1 of ranks {ranks}")
        self.ready.set()
        if lost:
            log.warning("ranks %s lost before registering: scaling up to %d ranks with new ones", lost, len(first))
            self.scaler.request(ScaleRequest(dp_size=len(first)))

    async def adopt(self, provider: CapacityProvider) -> None:
        """After a restart: rebuild the topology from the ranks' own state and take it over, with
        the ranks serving throughout. The highest epoch a serving rank reports wins (a commit the
        last router left half done is completed under a new epoch); ranks it lists that cannot be
        found are failed over; parked ranks are parked capacity again; a joiner or leaver of the
        operation the last router left unfinished is told to exit (or stopped), as an abort would."""
        t0 = time.monotonic()
        serving = [st for st in self.statuses.values() if st.placement is not None and st.rank in st.active]
        if not serving:
            raise ControlError(f"no rank serves a group: {sorted((r, s.state) for r, s in self.statuses.items())}")
        top = max(serving, key=lambda st: st.epoch)
        epoch, active, placement = top.epoch, sorted(top.active), top.placement
        try:
            await self.discover(active, provider, self.cfg.rank_timeout_s)
        except ControlError as e:
            log.warning("adopting epoch %d: %s", epoch, e)
        missing = [r for r in active if r not in self.statuses]
        self.num_experts = top.num_experts
        for r, st in sorted(self.statuses.items()):
            provider.adopt(r, st.pid, st.joiner, parked=st.state is RankState.PARKED and r not in active)
        # The last router's operation, if one ran: its joiners and leavers go; no export of
        # weights stays open.
        stray = [r for r, st in self.statuses.items() if r not in active and st.state is not RankState.PARKED]
        serving_ranks = [r for r in active if r in self.statuses]
        if stray:
            await self.send_all(serving_ranks, lambda r: Disconnect(ranks=stray))
        await asyncio.gather(*(self._retire(r, provider) for r in stray))
        await self.send_all(serving_ranks, lambda r: EndExport())
        consistent = all(
            (st := self.statuses[r]).epoch == epoch
            and sorted(st.active) == active
            and st.placement == placement
            and not st.paused
            and st.state is RankState.ACTIVE
            for r in serving_ranks
        )
        if not consistent and not missing:  # a failover re-commits anyway
            epoch += 1
            log.warning("ranks %s disagree on the topology; committing it again as epoch %d", active, epoch)
            await self.send_all(active, lambda r: Pause())
            await self.send_all(active, lambda r: Configure(epoch=epoch, active=active, placement=placement))
            await self.send_all(active, lambda r: Resume())
        hidden = [r for r in serving_ranks if not self.statuses[r].routable]
        await self.send_all(hidden, lambda r: SetRoutable(routable=True))
        self._committed = Committed(epoch=epoch, active=active, placement=placement)
        self.load_base = {r: self.statuses[r].load for r in serving_ranks}
        parked = sorted(r for r, st in self.statuses.items() if st.state is RankState.PARKED)
        outcome = (
            f"adopted epoch {epoch}: ranks {active} active"
            f"{f' ({missing} not found: failing them over)' if missing else ''}, "
            f"{parked or 'none'} parked, {sorted(stray) or 'none'} stopped"
        )
        log.info("%s (%.1f s)", outcome, time.monotonic() - t0)
        self.scaler.settle(outcome, size=len(active))
        self.ready.set()
        if missing:
            self.scaler.fail(missing)

    async def _retire(self, rank: int, provider: CapacityProvider) -> None:
        """A rank of an unfinished operation: one that may still relay handed-over streams
        (leaving) or was connected (staged) exits itself; any other is killed (fenced)."""
        st = self.statuses[rank]
        graceful = st.state in (RankState.STAGED, RankState.LEAVING)
        if graceful:
            try:
                await self.send(rank, Exit(op="adopt"))
            except ControlError as e:
                log.warning("rank %d did not exit: %s", rank, e)
                graceful = False
        log.info(
            "rank %d (%s, epoch %d) was in the last router's operation: %s",
            rank,
            st.state,
            st.epoch,
            "exiting" if graceful else "stopping it",
        )
        if not graceful:  # it holds nothing yet: no reason to wait for it
            await provider.fence(rank, st.pid, "adopt")
        elif st.joiner:
            await provider.release(rank, "adopt")
        self.forget(rank)

    async def refresh(self, provider: CapacityProvider) -> None:
        """Every status_interval_s: ask every rank for its status (its heartbeat), and fail over
        serving ranks that are found dead."""
        # A rank that does not answer holds only its own probe up (until rank_timeout_s): the
        # others are asked, and dead processes found, every interval all the same.
        probes: dict[int, asyncio.Task] = {}
        interval = self.cfg.status_interval_s
        while True:
            await asyncio.sleep(interval)
            probes = {r: t for r, t in probes.items() if not t.done()}
            probes.update({r: asyncio.create_task(self._probe(r)) for r in self.instances if r not in probes})
            if probes:
                await asyncio.wait(probes.values(), timeout=interval)
            for r, st in list(self.statuses.items()):
                provider.watch(r, st.pid)
            await self.drop_dead_spares(provider)
            failed = self.find_failed(provider)
            if failed:
                self.scaler.fail(sorted(failed))

    async def drop_dead_spares(self, provider: CapacityProvider) -> None:
        """Parked ranks whose process died are dropped at once (and dead standby copies, by the
        provider): a scale-up must never choose one."""
        provider.prune()
        op = self.scaler.current if self.scaler else None
        taken = set(op.joiners) if op else set()
        for r, st in list(self.statuses.items()):
            if st.state is RankState.PARKED and r not in taken and provider.alive(r) is False:
                log.warning("rank %d (parked, pid %d) died: dropped from the topology", r, st.pid)
                self.forget(r)
                await provider.fence(r, st.pid, "-")  # its process is gone: only the provider's state goes

    def unavailable(self) -> str | None:
        """Why no rank serves, or None while one does (or the first group is still forming)."""
        sc = self.scaler
        if not self.ready.is_set() or sc is None:
            return None
        if self.active and not sc.lost and not set(self.active) <= sc.failing:
            return None
        op = sc.current
        doing = f" (operation {op.id}, {op.phase.value})" if op and op.record.kind == "rebuild" else ""
        size = sc.lost_size or len(self.active)
        return f"every serving rank failed: no serving rank until the deployment is rebuilt at {size} ranks{doing}"

    async def _probe(self, rank: int) -> None:
        try:
            await asyncio.wait_for(self.send(rank, Describe()), timeout=self.cfg.rank_timeout_s)
        except Exception as e:
            log.warning("rank %d did not answer: %s", rank, e or type(e).__name__)

    def find_failed(self, provider: CapacityProvider) -> dict[int, str]:
        """Serving ranks to fail over, with the reason for each (logged once)."""
        if not self.ready.is_set():
            return {}
        now, active = time.monotonic(), self.committed.active
        why: dict[int, str] = {}
        for r in active:
            if r in self.scaler.failing:
                continue
            silent = now - self.last_seen.get(r, now)
            if provider.alive(r) is False:
                why[r] = "its process died"
            elif silent > self.cfg.rank_timeout_s:
                why[r] = f"no answer for {silent:.1f} s"
        epoch = self.committed.epoch
        for r in active:
            st = self.statuses.get(r)
            # Only a report about the serving epoch: an older one is about a topology since replaced.
            for p in st.ep_failed_peers if st and r not in why and st.epoch == epoch else ():
                if p in active and p not in why and p not in self.scaler.failing:
                    why[p] = f"rank {r}'s EP collective failed on it"
        for r, reason in why.items():
            log.error("rank %d failed: %s; failing it over", r, reason)
        return why

    # ---- HTTP ----------------------------------------------------------------------------------
    def topology(self) -> Topology:
        placement = self.committed.placement
        sc = self.scaler
        # A rank found dead is shown so, not as the state it last reported.
        dead = {r for r in self.statuses if sc and (r in sc.failing or sc.provider.alive(r) is False)}
        views = [
            RankView.of(msgspec.structs.replace(st, state=RankState.FAILED) if r in dead else st, placement)
            for r, st in sorted(self.statuses.items())
        ]
        op = sc.current.record if sc and sc.current else (sc.history[-1] if sc and sc.history else None)
        active = [] if self.unavailable() else self.active
        return Topology(
            epoch=self.epoch,
            dp_size=len(active),
            max_ranks=self.wcfg.max_ranks,
            active=active,
            ranks=views,
            scaling=bool(sc and sc.busy),
            target=sc.pending.dp_size if sc and sc.pending else None,
            operation=op,
            snapshot=sc.provider.snapshot if sc else None,
        )

    def collect(self):
        """Prometheus collector (`self.registry`): the values are read at each scrape from what the
        service holds, the ranks' last statuses and the scaler's history and counters (which a
        restarted router reloads from its journal: they go on from its predecessor's)."""
        st = sorted(self.statuses.items())
        tally = self.scaler.tally if self.scaler else Tally()
        last = self.scaler.history[-1] if self.scaler and self.scaler.history else None
        yield GaugeMetricFamily("elastic_router_epoch", "Current topology epoch.", value=self.epoch)
        yield GaugeMetricFamily("elastic_router_active_ranks", "Ranks in the active set.", value=len(self.active))
        yield GaugeMetricFamily(
            "elastic_router_scaling",
            "1 while a scale operation runs or is queued.",
            value=int(bool(self.scaler and self.scaler.busy)),
        )
        ops = CounterMetricFamily(
            "elastic_scale_operations_total", "Scale operations by kind and outcome.", labels=["kind", "result"]
        )
        for kind, ends in sorted(tally.outcomes.items()):
            for phase, n in sorted(ends.items()):
                ops.add_metric([kind, phase], n)
        yield ops
        yield CounterMetricFamily(
            "elastic_scale_followup_failures_total",
            "Operations whose commit held but whose follow-up (rebalance or cleanup) failed.",
            value=tally.followup_failures,
        )
        yield CounterMetricFamily(
            "elastic_scale_masked_ranks_total",
            "Failed serving ranks masked out: by a failover, a rollback, or a scale-up whose pull source failed.",
            value=tally.masked_ranks,
        )
        if last is not None:
            for name, help_, v in (
                (
                    "elastic_scale_last_downtime_seconds",
                    "Downtime of the last scale commit (first pause to last resume).",
                    last.downtime_s,
                ),
                ("elastic_scale_last_total_seconds", "Duration of the last scale operation.", last.total_s),
            ):
                g = GaugeMetricFamily(name, help_, labels=["op"])
                g.add_metric([last.id], v or 0)
                yield g
            phases = GaugeMetricFamily(
                "elastic_scale_last_phase_seconds", "Seconds per phase of the last operation.", labels=["op", "phase"]
            )
            for p, v in last.phases.items():
                phases.add_metric([last.id, p], v)
            yield phases
        for family, name, help_, field in (
            (CounterMetricFamily, "elastic_rank_steps", "Engine steps taken by a rank.", "steps"),
            (GaugeMetricFamily, "elastic_rank_running_requests", "Requests running on a rank.", "running"),
            (CounterMetricFamily, "elastic_rank_requests_total", "Requests a rank accepted.", "requests_total"),
            (CounterMetricFamily, "elastic_rank_expert_rows", "Token-expert pairs computed by a rank.", "expert_rows"),
        ):
            m = family(name, help_, labels=["rank"])
            for r, s in st:
                m.add_metric([str(r)], getattr(s, field))
            yield m

    def parse_scale(self, body: bytes, body_type: type[ScaleBody] | type[ElasticEPBody]) -> ScaleRequest:
        """A scale request, or ValueError with what is wrong (the HTTP layer answers 400)."""
        try:
            raw = msgspec.json.decode(body)
        except msgspec.DecodeError as e:
            raise ValueError(f"request body is not valid JSON: {e}") from None
        except RecursionError:
            raise ValueError(f"request body nests deeper than {MAX_JSON_DEPTH} levels") from None
        if _depth(raw) > MAX_JSON_DEPTH:
            raise ValueError(f"request body nests deeper than {MAX_JSON_DEPTH} levels")
        field = body_type.__struct_fields__[0]
        if not isinstance(raw, dict):
            raise ValueError(f'expected a JSON object like {{"{field}": 4}}')
        try:
            b = msgspec.convert(raw, body_type)
        except msgspec.ValidationError as e:
            raise ValueError(str(e)) from None
        remove = getattr(b, "remove", msgspec.UNSET)
        n = getattr(b, field)
        if remove is not msgspec.UNSET:
            if n is not msgspec.UNSET:
                raise ValueError("give dp_size or remove, not both")
            n = self.size_without(remove)
        elif n is msgspec.UNSET:
            raise ValueError("Object missing required field `dp_size` (or `remove`)")
        lo, hi = self.wcfg.min_ranks, self.wcfg.max_ranks
        if n < lo:
            raise ValueError(f"{field} must be at least {lo} (Worker.min_ranks), got {n}")
        if n > hi:
            raise ValueError(
                f"{field} {n} exceeds max_ranks {hi}: the EP buffers and expert slots were sized "
                f"for {hi} ranks at launch"
            )
        mode = ScaleMode.parse(b.mode) if isinstance(b, ScaleBody) else ScaleMode.PREPARE_ASYNC_REUSE_GRAPHS
        fault = b.fault if isinstance(b, ScaleBody) else ""
        if fault and not self.cfg.allow_fault_injection:
            raise ValueError("fault injection is off (Router.allow_fault_injection)")
        drain = self.cfg.drain_timeout_s if b.drain_timeout is None else b.drain_timeout
        if not 0 <= drain <= 24 * 3600:
            raise ValueError(f"drain_timeout must be in 0..86400 seconds, got {drain!r}")
        remove = sorted(remove) if remove is not msgspec.UNSET else []
        return ScaleRequest(dp_size=n, remove=remove, mode=mode, drain_timeout_s=float(drain), fault=fault)

    def size_without(self, remove: list[int]) -> int:
        """The DP size once the ranks `remove` names left, or ValueError saying why they cannot."""
        active, lo = self.active, self.wcfg.min_ranks
        if not remove:
            raise ValueError("remove names no rank")
        twice = sorted({r for r in remove if remove.count(r) > 1})
        if twice:
            raise ValueError(f"remove names rank {twice[0]} more than once")
        absent = [r for r in remove if r not in active]
        if absent:
            raise ValueError(f"remove: rank {absent[0]} is not active (active ranks: {active})")
        left = len(active) - len(remove)
        if left == 0:
            raise ValueError(f"remove names every active rank {active}: at least one must stay")
        if left < lo:
            raise ValueError(f"remove would leave {left} of {len(active)} ranks, fewer than Worker.min_ranks {lo}")
        return left

    def app(self) -> web.Application:
        def error(status: int, message: str):
            return web.json_response({"error": {"message": message, "code": status}}, status=status)

        @web.middleware
        async def guard(request, handler):
            # Probes and scrapers read health and metrics without the token; both are read-only.
            if self.cfg.token and not (request.method in ("GET", "HEAD") and request.path in OPEN_PATHS):
                given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
                if not hmac.compare_digest(given, f"Bearer {self.cfg.token}".encode()):
                    return web.json_response({"error": "missing or wrong bearer token"}, status=401)
            # A web page on this machine must not drive the API: a browser names a foreign page in
            # Origin (CSRF), and a rebound DNS name in Host; other clients send neither.
            origin = request.headers.get("Origin")
            if origin is not None and _hostname(origin.partition("://")[2]) not in self.hosts:
                return error(403, f"cross-origin request from {origin!r} refused")
            if not self.cfg.token and _hostname(request.host) not in self.hosts:
                return error(403, f"Host {request.host!r} is not this control API")
            if request.method == "POST" and request.can_read_body and request.content_type != "application/json":
                return error(415, f"expected content-type application/json, got {request.content_type!r}")
            return await handler(request)

        async def topology(_):
            return web.Response(body=msgspec.json.encode(self.topology()), content_type="application/json")

        async def operations(_):
            history = self.scaler.history if self.scaler else []
            return web.Response(body=msgspec.json.encode(history), content_type="application/json")

        async def health(_):
            ok = self.ready.is_set()
            why = self.unavailable()
            if why:  # the frontend answers completions with this reason meanwhile
                return web.json_response({"status": NO_SERVING_RANK, "epoch": self.epoch, "reason": why}, status=503)
            return web.json_response(
                {"status": "ready" if ok else "starting", "epoch": self.epoch}, status=200 if ok else 503
            )

        async def metrics(_):
            return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

        async def submit(request, body_type):
            if not self.ready.is_set():
                return None, error(503, "the first group is still forming")
            try:
                req = self.parse_scale(await request.read(), body_type)
            except ValueError as e:
                return None, error(400, str(e))
            field = body_type.__struct_fields__[0]
            queued = self.scaler.pending or (self.scaler.current.req if self.scaler.current else None)
            now = queued.dp_size if queued else len(self.active)
            if req.dp_size == now and not req.remove:  # a removal changes which ranks serve
                return None, error(409, f"{field} is already {now}" + (" (queued)" if queued else ""))
            self.scaler.request(req)
            return req, None

        async def scale(request):
            req, err = await submit(request, ScaleBody)
            if err:
                return err
            if request.query.get("wait", "") in ("1", "true"):
                rec = await self.scaler.wait_idle()
                # An operation that aborted or rolled back did not do what was asked: not a 2xx.
                ok = rec is None or rec.phase == "done"
                return web.Response(
                    body=msgspec.json.encode(rec), content_type="application/json", status=200 if ok else 500
                )
            accepted = {"accepted": True, "dp_size": req.dp_size, "mode": req.mode.value}
            return web.json_response(accepted | ({"remove": req.remove} if req.remove else {}), status=202)

        async def scale_elastic_ep(request):
            # vLLM's API: blocks until the deployment reached the size.
            req, err = await submit(request, ElasticEPBody)
            if err:
                return err
            rec = await self.scaler.wait_idle()
            if rec is not None and rec.to_size != req.dp_size:
                return error(409, f"superseded by operation {rec.id} (to dp_size {rec.to_size})")
            ok = rec is not None and rec.phase == "done" and len(self.active) == req.dp_size
            return web.json_response(
                {"success": ok, "new_data_parallel_size": len(self.active), "operation": msgspec.to_builtins(rec)},
                status=200 if ok else 500,
            )

        async def is_scaling(_):
            return web.json_response({"is_scaling": bool(self.scaler and self.scaler.busy)})

        app = web.Application(middlewares=[guard], client_max_size=MAX_BODY_BYTES)
        app.add_routes(
            [
                web.get("/topology", topology),
                web.get("/operations", operations),
                web.get("/health", health),
                web.get("/metrics", metrics),
                web.post("/scale", scale),
                web.post("/scale_elastic_ep", scale_elastic_ep),
                web.post("/is_scaling_elastic_ep", is_scaling),
            ]
        )
        return app

    @property
    def hosts(self) -> set[str]:
        """Names this API answers to: loopback, and the configured host."""
        return {*LOOPBACK, self.cfg.host}


def _hostname(netloc: str) -> str:
    """The host of `host[:port]` or `[v6][:port]`."""
    if netloc.startswith("["):
        return netloc[1:].partition("]")[0]
    return netloc.rsplit(":", 1)[0] if netloc.count(":") == 1 else netloc


def _depth(value, limit: int = MAX_JSON_DEPTH + 1) -> int:
    """Nesting depth of decoded JSON, counted up to `limit`."""
    if limit == 0 or not isinstance(value, (dict, list)):
        return 0
    children = value.values() if isinstance(value, dict) else value
    return 1 + max((_depth(c, limit - 1) for c in children), default=0)


def make_provider(kind: str, ctx):
    if kind == "local":
        return LocalProvider(ctx)
    if kind == "kubernetes":
        from components.control.capacity_k8s import KubernetesProvider

        return KubernetesProvider()
    raise ValueError(f"Router.capacity must be 'local' or 'kubernetes', not {kind!r}")


async def serve() -> None:
    from components.graph.runtime import make_runtime

    ctx, _ = load_context()
    cfg = component_config(RouterConfig)
    wcfg = msgspec.convert(ctx.configs.get("Worker", {}), WorkerConfig)
    loop = asyncio.get_running_loop()
    rt = make_runtime(loop, ctx)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    svc = RouterService(rt, ctx, cfg, wcfg)
    provider = make_provider(os.environ.get("ELASTIC_EP_CAPACITY") or cfg.capacity, ctx)
    state_dir = cfg.state_dir or (os.path.join(ctx.run_dir, "router") if ctx.run_dir else "")
    journal = OpJournal(Path(state_dir) / "operations.jsonl") if state_dir else None
    svc.scaler = Scaler(svc, svc, provider, cfg, wcfg.max_ranks, journal)
    runner = web.AppRunner(svc.app(), access_log_class=ControlAccessLog)
    await runner.setup()
    await web.TCPSite(runner, cfg.host, cfg.port).start()
    log.info("control API on http://%s:%d", cfg.host, cfg.port)
    boot = asyncio.create_task(svc.start(provider))
    refresh = asyncio.create_task(svc.refresh(provider))
    scaler = asyncio.create_task(svc.scaler.run(svc.ready))
    waiter = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait({boot, waiter}, return_when=asyncio.FIRST_COMPLETED)
    cannot_start = boot in done and isinstance(boot.exception(), CannotStart)
    if cannot_start:
        log.error("router cannot start: %s", boot.exception())
    elif boot in done and boot.exception():
        raise boot.exception()
    else:
        await waiter
    for t in (boot, refresh, scaler):
        t.cancel()
    await provider.close()
    await runner.cleanup()
    rt.shutdown()
    log.info("router stopped")
    if cannot_start:
        sys.exit(EXIT_CANNOT_START)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    asyncio.run(serve())


if __name__ == "__main__":
    main()
