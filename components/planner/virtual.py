"""Dynamo's planner drives the DP size (`--Planner.kind=dynamo`): the system side of its virtual
connector.

Dynamo's planner, run with its virtual connector, publishes absolute worker counts in etcd under
`v1/{namespace}/planner/` (`num_prefill_workers`, `num_decode_workers`, `decision_id`) through
`dynamo._core.VirtualConnectorCoordinator`, and holds back its next decision until the system
acknowledges this one (`scaled_decision_id`, written by `VirtualConnectorClient.complete`), or
until its `SCALING_MAX_WAIT_TIME` (1800 s by default) has passed. It counts the live workers
itself, from the `{namespace}.worker.generate` instances registered in discovery: a rank is
listed there only while it is routable, so a parked rank or a joiner still warming up is not
counted, and a scale's commit is done when the count matches.

Here a deployment is aggregated (DEP: no prefill workers) and one decode worker is one DP rank on
one GPU, so a decision's decode count is the DP size, and it is met when:
    - it lies within the planner's bounds (Planner.min_dp..max_dp, checked against the Worker's
      capacity as for the embedded planner) and asks for no prefill worker;
    - the router accepted it (POST /scale, the path every other scale takes);
    - the router is idle again at that size (the commit done): then it is completed.
A decision that cannot be met is failed with the reason and not acknowledged: the virtual
connector has no call that reports a failure, and acknowledging a size the deployment does not
have would tell Dynamo's planner a scale succeeded that did not (its worker count would then
disagree with the target it believes met). The failure is logged at ERROR (`[decision N]`),
counted on /metrics (`elastic_planner_dynamo_decisions_total{result="failed"}`, and
`elastic_planner_dynamo_decision_failed` 1 while the newest decision is a failed one) and listed
with its reason on /decisions; Dynamo's planner sees it unacknowledged (`is_scaling_ready()`
false) and its worker count unchanged. A decision that arrives while another is being met
supersedes it: its target goes to the router, which queues toward the latest target, and only
the newest is ever acknowledged (an acknowledgement of a later decision covers the earlier ones).
Decisions are desired states, so at start the newest one published is met whether or not an
earlier run of this process acknowledged it.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import logging
import time
from typing import Any

import msgspec
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from components.graph.component import LOG_FORMAT, component_config, load_context
from components.planner.router_client import RouterClient
from components.planner.service import Bounds, Planner, resolve, router_client, run_planner
from components.protocol.config import WorkerConfig

log = logging.getLogger("components.planner.virtual")

APPLY_POLL_S = 0.2  # while a decision is being met: the router's topology and etcd, this often
# wait() returns at once while the newest decision is unacknowledged, so after a failure the
# next decision is looked for by polling.
FAILED_POLL_S = 1.0


class Phase(enum.Enum):
    RECEIVED = "received"  # read from etcd, its target not yet accepted by the router
    APPLYING = "applying"  # the router accepted its target
    COMPLETED = "completed"  # the router settled at its target; acknowledged
    FAILED = "failed"  # it cannot be met, or the router settled elsewhere; not acknowledged
    SUPERSEDED = "superseded"  # a newer decision arrived before it was met; never acknowledged


OPEN = (Phase.RECEIVED, Phase.APPLYING)
NEXT = {
    Phase.RECEIVED: {Phase.APPLYING, Phase.COMPLETED, Phase.FAILED, Phase.SUPERSEDED},
    Phase.APPLYING: {Phase.COMPLETED, Phase.FAILED, Phase.SUPERSEDED},
}
RESULTS = (Phase.COMPLETED, Phase.FAILED, Phase.SUPERSEDED)


class DecisionRecord(msgspec.Struct):
    """One decision of Dynamo's planner and what became of it (/decisions)."""

    decision_id: int
    num_prefill_workers: int  # -1: not set
    num_decode_workers: int  # -1: not set
    received: float  # wall-clock time (unix)
    phase: Phase = Phase.RECEIVED
    reason: str = ""
    op: str = ""  # the router operation it ended with, if any
    ended: float | None = None


def advance(rec: DecisionRecord, phase: Phase, reason: str) -> None:
    """The one way a decision changes phase, with its log line."""
    if phase not in NEXT.get(rec.phase, ()):
        raise RuntimeError(f"decision {rec.decision_id}: no transition {rec.phase.value} -> {phase.value}")
    level = logging.ERROR if phase is Phase.FAILED else logging.INFO
    log.log(level, "[decision %d] %s -> %s: %s", rec.decision_id, rec.phase.value, phase.value, reason)
    rec.phase, rec.reason = phase, reason
    if phase in RESULTS:
        rec.ended = time.time()


def unmet(bounds: Bounds, prefill: int, decode: int) -> str:
    """Why a decision cannot be met here, or "" when it can."""
    if prefill > 0:
        return (
            f"it asks for {prefill} prefill workers, and this deployment is aggregated "
            "(DEP ranks serve prefill and decode; run Dynamo's planner in agg mode)"
        )
    if decode < 0:
        return "it sets no decode worker count"
    if not bounds.min_dp <= decode <= bounds.max_dp:
        return (
            f"{decode} decode workers is outside the planner's bounds {bounds.min_dp}..{bounds.max_dp} "
            "(Planner.min_dp..Planner.max_dp; a decode worker is one DP rank on one GPU)"
        )
    return ""


class VirtualConnectorService:
    """Meets Dynamo's planner's decisions through the router; `client` is a
    `dynamo._core.VirtualConnectorClient` of the graph's namespace."""

    def __init__(self, cfg: Planner.Config, bounds: Bounds, router: RouterClient, client: Any):
        self.cfg, self.bounds, self.router, self.client = cfg, bounds, router, client
        self.decisions: collections.deque[DecisionRecord] = collections.deque(maxlen=500)
        self.current: DecisionRecord | None = None  # the newest decision taken up
        self.counts = {p.value: 0 for p in RESULTS}
        self.registry = CollectorRegistry()
        self.registry.register(self)

    def _end(self, rec: DecisionRecord, phase: Phase, reason: str) -> None:
        advance(rec, phase, reason)
        self.counts[phase.value] += 1

    def take(self, decision: Any) -> DecisionRecord:
        """A decision not seen before: it supersedes one still being met, and fails at once
        when it cannot be met here."""
        rec = DecisionRecord(
            decision_id=decision.decision_id,
            num_prefill_workers=decision.num_prefill_workers,
            num_decode_workers=decision.num_decode_workers,
            received=time.time(),
        )
        asked = (("decode", rec.num_decode_workers), ("prefill", rec.num_prefill_workers))
        counts = [f"{n} {kind} workers" for kind, n in asked if n >= 0]
        log.info("[decision %d] received: %s", rec.decision_id, ", ".join(counts) or "no worker count")
        if self.current is not None and self.current.phase in OPEN:
            self._end(self.current, Phase.SUPERSEDED, f"decision {rec.decision_id} arrived before it was met")
        self.current = rec
        self.decisions.append(rec)
        why = unmet(self.bounds, rec.num_prefill_workers, rec.num_decode_workers)
        if why:
            self._end(rec, Phase.FAILED, f"cannot be met: {why}; not acknowledged")
        return rec

    async def step(self) -> None:
        """One look at etcd and, while a decision is being met, at the router."""
        decision = await self.client.get()
        if decision.decision_id >= 0 and (self.current is None or decision.decision_id != self.current.decision_id):
            self.take(decision)
        rec = self.current
        if rec is None or rec.phase not in OPEN or decision.decision_id != rec.decision_id:
            return  # (the last: etcd lost the planner's state; nothing to acknowledge)
        target = rec.num_decode_workers
        if rec.phase is Phase.RECEIVED:
            try:
                status, body = await self.router.scale(target, self.cfg.mode)
            except Exception as e:  # tried again at the next look
                log.warning("[decision %d] router unreachable (%s); trying again", rec.decision_id, e)
                return
            if status == 503:  # the first group still forming
                return
            if status not in (202, 409):  # 409: already that size, or queued toward it
                self._end(rec, Phase.FAILED, f"the router refused dp_size {target}: HTTP {status}: {body[:300]}")
                return
            advance(rec, Phase.APPLYING, f"router: {'accepted' if status == 202 else body[:200]}")
        try:
            topo = await self.router.topology()
        except Exception as e:
            log.warning("[decision %d] no topology from the router (%s); looking again", rec.decision_id, e)
            return
        if topo.scaling or topo.target is not None:
            return
        op = topo.operation
        # The operation that met it committed after it arrived; else it was met already (409).
        ours = op is not None and (op.committed_at or 0.0) >= rec.received
        by = f" [op {op.id}]" if ours else " (already that size: no operation)"
        if topo.dp_size != target:
            rec.op = op.id if op else ""
            what = f"{op.id} ended {op.phase}{f': {op.error}' if op.error else ''}" if op else "none ran"
            self._end(
                rec,
                Phase.FAILED,
                f"the router settled at dp_size {topo.dp_size}, not {target} (last operation {what}); not acknowledged",
            )
            return
        rec.op = op.id if ours else ""
        await self.client.complete(decision)
        self._end(rec, Phase.COMPLETED, f"dp_size {target} committed at epoch {topo.epoch}{by}; acknowledged")

    async def run(self, stop: asyncio.Event) -> None:
        import aiohttp

        async with aiohttp.ClientSession() as session:
            self.router.session = session
            log.info(
                "planner: Dynamo's planner decides (virtual connector); decode workers = dp_size "
                "within %d..%d, through router %s",
                self.bounds.min_dp,
                self.bounds.max_dp,
                self.router.url,
            )
            await self.router.wait_ready(stop)
            while not stop.is_set():
                try:
                    await self.step()
                except Exception:  # never let one bad look end the planner
                    log.exception("planner: looking at Dynamo's decision failed")
                    await _until(stop, FAILED_POLL_S)
                    continue
                rec = self.current
                if rec is None or rec.phase is Phase.COMPLETED:
                    await self._next_decision(stop)
                else:
                    await _until(stop, APPLY_POLL_S if rec.phase in OPEN else FAILED_POLL_S)

    async def _next_decision(self, stop: asyncio.Event) -> None:
        """Until Dynamo's planner publishes a decision not yet acknowledged, or `stop`."""
        waiting = asyncio.ensure_future(self.client.wait())
        stopping = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({waiting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (waiting, stopping):
                t.cancel()
        if waiting.done() and not waiting.cancelled() and waiting.exception() is not None:
            raise waiting.exception()

    def collect(self):
        """Prometheus collector (`self.registry`)."""
        rec = self.current
        yield GaugeMetricFamily(
            "elastic_planner_target_dp",
            "Decode workers (DP size) of Dynamo's newest decision (0: none yet).",
            value=max(rec.num_decode_workers, 0) if rec else 0,
        )
        yield GaugeMetricFamily("elastic_planner_min_dp", "Lower bound.", value=self.bounds.min_dp)
        yield GaugeMetricFamily("elastic_planner_max_dp", "Upper bound.", value=self.bounds.max_dp)
        yield GaugeMetricFamily(
            "elastic_planner_dynamo_decision_id",
            "Id of Dynamo's newest decision (-1: none yet).",
            value=rec.decision_id if rec else -1,
        )
        yield GaugeMetricFamily(
            "elastic_planner_dynamo_decision_failed",
            "1 while Dynamo's newest decision failed (not acknowledged; the reason is in /decisions).",
            value=int(rec is not None and rec.phase is Phase.FAILED),
        )
        c = CounterMetricFamily(
            "elastic_planner_dynamo_decisions_total", "Dynamo's decisions by how they ended.", labels=["result"]
        )
        for k, n in self.counts.items():
            c.add_metric([k], n)
        yield c


async def _until(stop: asyncio.Event, seconds: float) -> None:
    try:
        await asyncio.wait_for(stop.wait(), seconds)
    except TimeoutError:
        pass


async def serve() -> None:
    from dynamo._core import VirtualConnectorClient

    from components.graph.runtime import make_runtime

    ctx, _ = load_context()
    cfg = component_config(Planner.Config)
    bounds = resolve(cfg, msgspec.convert(ctx.configs.get("Worker", {}), WorkerConfig))
    rt = make_runtime(asyncio.get_running_loop(), ctx)  # sets ETCD_ENDPOINTS, which the client reads
    client = VirtualConnectorClient(rt, ctx.namespace)
    try:
        await run_planner(VirtualConnectorService(cfg, bounds, router_client(ctx, cfg), client), cfg.port)
    finally:
        rt.shutdown()


def main() -> None:
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    asyncio.run(serve())


if __name__ == "__main__":
    main()
