"""Planner: grows and shrinks the DP/EP size from load, so capacity follows demand.

Every `interval_s` it reads the frontend's Prometheus metrics (request rate, in-flight and queued
requests, request duration, TTFT / ITL histograms) and the router's `/topology` (per-rank running
and waiting requests, KV use where a rank reports it), smooths them (EWMA), predicts the
concurrency it must serve, and picks a DP size:

    load        = max(EWMA(in-flight requests), EWMA(request rate) * mean request duration)
    up          : load / dp > scale_up_threshold            -> ceil(load / scale_up_threshold)
                  (or a TTFT / ITL p95 over its SLO, or KV use over kv_high: dp + 1)
    down        : ceil(load / scale_down_threshold) < dp    -> that size
    then        : clamp to [min_dp, max_dp], move at most `step` ranks per operation,
                  only after `up_intervals` / `down_intervals` consecutive intervals that agree,
                  never while the router is scaling, never within `cooldown_s` of the end of the
                  last operation (the planner's or anyone's).

The band between the two thresholds is the hysteresis that keeps a steady load from flapping.
It acts only through the router's `POST /scale` (the router asks its capacity provider for the
joining ranks). It is not a critical process: if it dies the deployment keeps serving at its
current size. Every decision is logged (`planner: decision ...`): one that acts, and a keep whose
reason changes in kind, at INFO; a keep for the same reason as the one before at DEBUG (one
every interval would bury the rest). Each is counted on its own `/metrics` (127.0.0.1:`port`);
`/decisions` returns the last ones as JSON.

Defaults keep an idle default deployment where it started: `min_dp` = 0 means Worker.dp_size
(the start size), `max_dp` = 0 means Worker.max_ranks, and `scale_up_threshold` = 0 means
Worker.max_seqs (scale up only when the ranks' batches are full on average). Set
`--Planner.min_dp=1` to let it shrink below the start size, `--Planner.enabled=false` for
manual control only, `--Planner.kind=dynamo` to have Dynamo's own planner decide instead
(`components/planner/virtual.py`: this module's config, bounds and endpoints, its decisions).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from typing import Any, ClassVar

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from components.graph.component import LOG_FORMAT, Component, GraphContext, ProcessSpec, component_config, load_context
from components.planner.router_client import RouterClient
from components.protocol.config import FrontendConfig, RouterConfig, WorkerConfig
from components.protocol.topology import ScaleMode, Topology

log = logging.getLogger("components.planner.service")

ACTIONS = ("keep", "up", "down")
KINDS = {"embedded": "components.planner.service", "dynamo": "components.planner.virtual"}
_UNSEEN = object()


class Planner(Component):
    class Config(msgspec.Struct, forbid_unknown_fields=True):
        enabled: bool = True
        # Who decides the size: "embedded" (this module's policy) or "dynamo" (Dynamo's own
        # planner, through its virtual connector in etcd: components/planner/virtual.py). Both
        # stay within min_dp..max_dp and act through the router's POST /scale.
        kind: str = "embedded"
        min_dp: int = 0  # 0 = Worker.dp_size (an idle deployment stays at its start size)
        max_dp: int = 0  # 0 = Worker.max_ranks
        step: int = 1  # the most ranks (GPUs) one operation adds or removes
        interval_s: float = 5.0
        # Load = running + waiting requests (predicted); thresholds are per rank.
        scale_up_threshold: float = 0.0  # 0 = Worker.max_seqs
        scale_down_threshold: float = 0.0  # 0 = scale_up_threshold / 4
        up_intervals: int = 2  # consecutive intervals above before scaling up
        down_intervals: int = 6  # consecutive intervals below before scaling down
        cooldown_s: float = 30.0  # after any scale operation ends
        smoothing: float = 0.5  # EWMA weight of the newest sample (1 = no smoothing)
        ttft_p95_slo_s: float = 0.0  # > 0: a TTFT p95 above it asks for one more rank
        itl_p95_slo_s: float = 0.0  # > 0: same for the inter-token latency p95
        kv_high: float = 0.9  # KV cache use (0..1) above which a rank counts as full, where reported
        mode: str = "C"  # scale mode passed to the router
        port: int = 8002  # the planner's own /metrics on 127.0.0.1 (0 = none)
        http_timeout_s: float = 5.0

        def __post_init__(self) -> None:
            # Raised here so `dynamo serve` refuses a bad value before anything starts.
            if self.kind not in KINDS:
                raise ValueError(f"kind must be one of {', '.join(KINDS)} (got {self.kind!r})")
            if self.step < 1:
                raise ValueError(f"step must be >= 1 (got {self.step}): it is how many ranks one operation moves")
            if self.min_dp < 0 or self.max_dp < 0:
                raise ValueError("min_dp and max_dp must be >= 0 (0 = the Worker's dp_size / max_ranks)")
            if self.min_dp and self.max_dp and self.min_dp > self.max_dp:
                raise ValueError(f"min_dp ({self.min_dp}) is greater than max_dp ({self.max_dp})")
            if self.interval_s <= 0:
                raise ValueError("interval_s must be > 0")
            if self.cooldown_s < 0:
                raise ValueError("cooldown_s must be >= 0")
            if self.scale_up_threshold < 0 or self.scale_down_threshold < 0:
                raise ValueError("scale_up_threshold and scale_down_threshold must be >= 0 (0 = default)")
            if self.up_intervals < 1 or self.down_intervals < 1:
                raise ValueError("up_intervals and down_intervals must be >= 1")
            if not 0 < self.smoothing <= 1:
                raise ValueError("smoothing must be in (0, 1]")
            ScaleMode.parse(self.mode)  # ValueError naming the modes
            if not 0 <= self.port <= 65535:
                raise ValueError("port must be in 0..65535")

    module: ClassVar[str] = "components.planner.service"

    @classmethod
    def urls(cls, config: Any) -> dict[str, str]:
        if not config.enabled or not config.port:
            return {}
        return {"planner metrics": f"http://127.0.0.1:{config.port}/metrics"}

    @classmethod
    def processes(cls, config: Any, ctx: GraphContext) -> list[ProcessSpec]:
        if not config.enabled:
            return []
        resolve(config, msgspec.convert(ctx.configs.get("Worker", {}), WorkerConfig))  # ValueError: what is wrong
        if config.kind == "dynamo" and ctx.discovery != "etcd":
            raise ValueError(
                "Planner.kind=dynamo needs --discovery etcd: Dynamo's planner publishes its decisions "
                "in etcd and counts the workers it sees registered there"
            )
        # Not critical: a planner that dies leaves the deployment serving at its current size.
        return [ProcessSpec(label=cls.name(), argv=[sys.executable, "-m", KINDS[config.kind]], critical=False)]


class Bounds(msgspec.Struct, frozen=True):
    min_dp: int
    max_dp: int
    up: float  # load per rank above which to grow
    down: float  # load per rank at the smaller size below which to shrink


def _visible_gpus() -> int | None:
    """GPUs a local provider could give ranks, or None when it cannot tell."""
    vis = os.environ.get("CUDA_VISIBLE_DEVICES")
    if vis is not None:
        return len([d for d in vis.split(",") if d.strip() and d.strip() != "-1"])
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return len([ln for ln in out.splitlines() if ln.startswith("GPU ")]) or None


def resolve(cfg: Planner.Config, worker: WorkerConfig) -> Bounds:
    """The planner's effective bounds, checked against the Worker's config (the capacity the EP
    buffers and expert slots were sized for at launch). ValueError says what is wrong."""
    w_min, w_max, w_dp = worker.min_ranks, worker.max_ranks, worker.dp_size
    lo = cfg.min_dp or w_dp
    hi = cfg.max_dp or w_max
    if lo > hi:
        raise ValueError(
            f"Planner.min_dp ({lo}{'' if cfg.min_dp else ' = Worker.dp_size'}) is greater than "
            f"Planner.max_dp ({hi}{'' if cfg.max_dp else ' = Worker.max_ranks'})"
        )
    if hi > w_max:
        raise ValueError(
            f"Planner.max_dp ({hi}) is over capacity: Worker.max_ranks is {w_max} (the EP buffers "
            f"and expert slots are sized for {w_max} ranks at launch)"
        )
    if lo < w_min:
        raise ValueError(f"Planner.min_dp ({lo}) is below Worker.min_ranks ({w_min})")
    if not lo <= w_dp <= hi:
        raise ValueError(
            f"Worker.dp_size ({w_dp}) is outside the planner's bounds {lo}..{hi} (Planner.min_dp..Planner.max_dp)"
        )
    if worker.device == "cuda":
        # Ranks past the GPU count share GPUs (rank r on GPU r % n), which runs but does not add
        # compute: worth saying, not refusing (one GPU serving 1 -> 2 -> 1 is how it is tested).
        gpus = _visible_gpus()
        if gpus is not None and hi > gpus:
            log.warning(
                "Planner.max_dp (%d) is over this host's %d visible GPUs: ranks past %d share GPUs "
                "(rank r on GPU r %% %d), so growing past %d adds no compute", hi, gpus, gpus, gpus, gpus,
            )  # fmt: skip
    up = cfg.scale_up_threshold or float(worker.max_seqs)
    down = cfg.scale_down_threshold or up / 4
    if down >= up:
        raise ValueError(
            f"Planner.scale_down_threshold ({down}) must be below scale_up_threshold ({up}): "
            "the band between them is what keeps a steady load from flapping"
        )
    return Bounds(min_dp=lo, max_dp=hi, up=up, down=down)


# ---------------------------------------------------------------------------------------------
# metrics input


def parse_prometheus(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Samples by name (a histogram's `_bucket`, `_sum` and `_count` apart), each with its labels.
    A malformed exposition raises ValueError, as a Prometheus scrape of it fails."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def metric_sum(samples: dict, name: str) -> float | None:
    rows = samples.get(name)
    return None if rows is None else sum(v for _, v in rows)


def histogram(samples: dict, name: str) -> dict[float, float]:
    """Cumulative bucket counts by upper bound, summed over label sets."""
    out: dict[float, float] = {}
    for labels, v in samples.get(f"{name}_bucket", []):
        le = labels.get("le")
        if le is None:
            continue
        bound = math.inf if le == "+Inf" else float(le)
        out[bound] = out.get(bound, 0.0) + v
    return out


def quantile(now: dict[float, float], before: dict[float, float], q: float) -> float | None:
    """Quantile of the observations between two cumulative histogram snapshots (linear within a
    bucket, like PromQL's histogram_quantile); None without observations."""
    bounds = sorted(now)
    cum = [now[b] - before.get(b, 0.0) for b in bounds]
    if not cum or cum[-1] <= 0:
        return None
    rank = q * cum[-1]
    prev_b, prev_c = 0.0, 0.0
    for b, c in zip(bounds, cum):
        if c >= rank:
            if math.isinf(b):
                return prev_b
            return prev_b + (b - prev_b) * ((rank - prev_c) / (c - prev_c) if c > prev_c else 1.0)
        prev_b, prev_c = b, c
    return prev_b


class Inputs(msgspec.Struct):
    dp: int
    scaling: bool
    inflight: float  # frontend in-flight + queued, or the ranks' running + waiting, the larger
    running: int
    waiting: int
    rate: float | None  # requests/s started at the frontend over the last interval
    duration_s: float | None  # mean request duration over the last interval
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    itl_p50_s: float | None
    itl_p95_s: float | None
    kv_use: float | None  # highest KV cache use of an active rank, where ranks report it
    load_ewma: float
    rate_ewma: float | None
    predicted: float  # the load the decision sizes for

    def brief(self) -> dict[str, Any]:
        def r(x):
            return round(x, 3) if isinstance(x, float) else x

        return {k: r(v) for k, v in msgspec.structs.asdict(self).items() if v is not None}


class Decision(msgspec.Struct):
    time: float
    action: str  # keep | up | down
    current: int
    target: int
    reason: str
    inputs: dict[str, Any]
    acted: bool = False  # a /scale request was accepted
    error: str = ""


class Policy:
    """The decision rule, pure (no I/O) so it can be tested on its own."""

    def __init__(self, cfg: Planner.Config, bounds: Bounds):
        self.cfg, self.b = cfg, bounds
        self.up_streak = 0
        self.down_streak = 0
        self.last_op_end: float = -math.inf

    def decide(self, x: Inputs, now: float) -> tuple[str, int, str]:
        n, b, cfg = x.dp, self.b, self.cfg
        if x.scaling:
            self.up_streak = self.down_streak = 0
            return "keep", n, "router is scaling: waiting for the operation to end"
        if n < b.min_dp or n > b.max_dp:
            desired = min(max(n, b.min_dp), b.max_dp)
            why = f"dp {n} is outside the bounds {b.min_dp}..{b.max_dp}"
            self.up_streak = self.down_streak = 0
            return self._move(n, desired, why, now, streak_ok=True)
        per_rank = x.predicted / n
        pressure = []
        if cfg.ttft_p95_slo_s > 0 and x.ttft_p95_s is not None and x.ttft_p95_s > cfg.ttft_p95_slo_s:
            pressure.append(f"ttft_p95 {x.ttft_p95_s:.3f}s > slo {cfg.ttft_p95_slo_s}s")
        if cfg.itl_p95_slo_s > 0 and x.itl_p95_s is not None and x.itl_p95_s > cfg.itl_p95_slo_s:
            pressure.append(f"itl_p95 {x.itl_p95_s:.3f}s > slo {cfg.itl_p95_slo_s}s")
        if x.kv_use is not None and x.kv_use > cfg.kv_high:
            pressure.append(f"kv use {x.kv_use:.2f} > {cfg.kv_high}")
        if per_rank <= b.down:
            pressure = []  # an idle deployment is not short of ranks whatever its latency says
        up_want = math.ceil(x.predicted / b.up - 1e-9) if per_rank > b.up else n
        if pressure:
            up_want = max(up_want, n + 1)
        down_want = max(b.min_dp, math.ceil(x.predicted / b.down - 1e-9))
        if up_want > n:
            self.up_streak += 1
            self.down_streak = 0
            desired = min(up_want, b.max_dp)
            reasons = ([f"load/rank {per_rank:.2f} > up threshold {b.up:g}"] if per_rank > b.up else []) + pressure
            why = "; ".join(reasons) + f"; wants {up_want}"
            if desired <= n:
                return "keep", n, why + f", but already at max_dp {b.max_dp}"
            return self._move(
                n,
                desired,
                why,
                now,
                self.up_streak >= cfg.up_intervals,
                f"{self.up_streak}/{cfg.up_intervals} intervals above",
            )
        if down_want < n:
            self.down_streak += 1
            self.up_streak = 0
            why = f"load {x.predicted:.2f} fits {down_want} ranks at <= {b.down:g}/rank (now {per_rank:.2f}/rank)"
            return self._move(
                n,
                down_want,
                why,
                now,
                self.down_streak >= cfg.down_intervals,
                f"{self.down_streak}/{cfg.down_intervals} intervals below",
            )
        self.up_streak = self.down_streak = 0
        at = " (at min_dp)" if n == b.min_dp and per_rank <= b.down else ""
        return "keep", n, f"load/rank {per_rank:.2f} within band ({b.down:g}, {b.up:g}]{at}"

    def _move(
        self, n: int, desired: int, why: str, now: float, streak_ok: bool, streak: str = ""
    ) -> tuple[str, int, str]:
        if desired == n:
            return "keep", n, why
        if not streak_ok:
            return "keep", n, f"{why}; hysteresis {streak}"
        left = self.cfg.cooldown_s - (now - self.last_op_end)
        if left > 0:
            return "keep", n, f"{why}; cooldown {left:.1f}s left"
        step = self.cfg.step
        target = min(desired, n + step) if desired > n else max(desired, n - step)
        return ("up" if target > n else "down"), target, why


# ---------------------------------------------------------------------------------------------
# the service


def _kind(reason: str) -> str:
    """A decision's reason without its numbers: what kind of reason it is."""
    return re.sub(r"-?\d+(\.\d+)?", "#", reason)


class PlannerService:
    def __init__(self, cfg: Planner.Config, bounds: Bounds, frontend_url: str, router: RouterClient):
        self.cfg, self.bounds = cfg, bounds
        self.frontend_url = frontend_url.rstrip("/")
        self.router = router
        self.policy = Policy(cfg, bounds)
        self.decisions: collections.deque[Decision] = collections.deque(maxlen=500)
        self.counts = {a: 0 for a in ACTIONS}
        self.requests = {"accepted": 0, "refused": 0, "failed": 0}
        # Its own registry, not the global one: several planners may live in one process (the tests').
        self.registry = CollectorRegistry()
        self.registry.register(self)
        self.session = None
        self.prev: dict | None = None  # previous frontend sample
        self.prev_t = 0.0
        self.load_ewma: float | None = None
        self.rate_ewma: float | None = None
        self.duration: float | None = None
        self.seen_op: Any = _UNSEEN  # (id, phase) of the router's last operation
        self.last: Decision | None = None
        self.last_inputs: Inputs | None = None

    async def _frontend_metrics(self) -> dict:
        import aiohttp

        url = f"{self.frontend_url}/metrics"
        async with self.session.get(url, timeout=aiohttp.ClientTimeout(total=self.cfg.http_timeout_s)) as r:
            if r.status != 200:
                raise RuntimeError(f"GET {url}: HTTP {r.status}")
            return parse_prometheus((await r.read()).decode())

    async def observe(self) -> Inputs | None:
        topo = await self.router.topology()
        fe: dict | None = None
        try:
            fe = await self._frontend_metrics()
        except Exception as e:
            log.warning("planner: frontend metrics unavailable (%s); deciding from the router's view", e)
        now = time.monotonic()
        self._track_operation(topo, now)
        ranks = [r for r in topo.ranks if r.rank in topo.active]
        running = sum(r.running for r in ranks)
        waiting = sum(r.waiting for r in ranks)
        kv = [r.kv_usage for r in ranks if r.kv_total]
        inflight = float(running + waiting)
        rate = duration = None
        ttft50 = ttft95 = itl50 = itl95 = None
        if fe is not None:
            # Queued requests are in flight too: the larger of the two views, never their sum.
            inflight = max(
                inflight,
                metric_sum(fe, "dynamo_frontend_inflight_requests") or 0.0,
                metric_sum(fe, "dynamo_frontend_queued_requests") or 0.0,
            )
            cur = {
                "started": metric_sum(fe, "dynamo_frontend_requests_started_total"),
                "done": metric_sum(fe, "dynamo_frontend_requests_total"),
                "dur_sum": metric_sum(fe, "dynamo_frontend_request_duration_seconds_sum"),
                "dur_count": metric_sum(fe, "dynamo_frontend_request_duration_seconds_count"),
                "ttft": histogram(fe, "dynamo_frontend_time_to_first_token_seconds"),
                "itl": histogram(fe, "dynamo_frontend_inter_token_latency_seconds"),
            }
            if self.prev is not None and now > self.prev_t:
                dt = now - self.prev_t
                started = cur["started"] if cur["started"] is not None else cur["done"]
                before = self.prev["started"] if cur["started"] is not None else self.prev["done"]
                if started is not None and before is not None:
                    rate = max(0.0, started - before) / dt
                if cur["dur_count"] is not None and self.prev["dur_count"] is not None:
                    dn = cur["dur_count"] - self.prev["dur_count"]
                    if dn > 0:
                        duration = (cur["dur_sum"] - self.prev["dur_sum"]) / dn
                ttft50, ttft95 = (
                    quantile(cur["ttft"], self.prev["ttft"], 0.5),
                    quantile(cur["ttft"], self.prev["ttft"], 0.95),
                )
                itl50, itl95 = quantile(cur["itl"], self.prev["itl"], 0.5), quantile(cur["itl"], self.prev["itl"], 0.95)
            self.prev, self.prev_t = cur, now
        a = self.cfg.smoothing
        self.load_ewma = inflight if self.load_ewma is None else a * inflight + (1 - a) * self.load_ewma
        if rate is not None:
            self.rate_ewma = rate if self.rate_ewma is None else a * rate + (1 - a) * self.rate_ewma
        if duration is not None:
            self.duration = duration if self.duration is None else a * duration + (1 - a) * self.duration
        predicted = self.load_ewma
        if self.rate_ewma is not None and self.duration is not None:
            predicted = max(predicted, self.rate_ewma * self.duration)  # Little's law
        return Inputs(
            dp=topo.dp_size,
            scaling=topo.scaling or topo.target is not None,
            inflight=inflight,
            running=running,
            waiting=waiting,
            rate=rate,
            duration_s=self.duration,
            ttft_p50_s=ttft50,
            ttft_p95_s=ttft95,
            itl_p50_s=itl50,
            itl_p95_s=itl95,
            kv_use=max(kv) if kv else None,
            load_ewma=self.load_ewma,
            rate_ewma=self.rate_ewma,
            predicted=predicted,
        )

    def _track_operation(self, topo: Topology, now: float) -> None:
        """Cooldown runs from the end of the last operation, whoever asked for it."""
        op = topo.operation
        key = (op.id, op.phase) if op else None
        if topo.scaling:
            self.policy.last_op_end = now  # still running: the cooldown starts when it ends
        elif self.seen_op is not _UNSEEN and key != self.seen_op:
            self.policy.last_op_end = now  # an operation ended since the last look
        self.seen_op = key

    async def act(self, target: int) -> tuple[bool, str]:
        try:
            status, body = await self.router.scale(target, self.cfg.mode)
        except Exception as e:
            self.requests["failed"] += 1
            return False, f"router unreachable: {e}"
        if status == 202:
            self.requests["accepted"] += 1
            self.policy.last_op_end = time.monotonic()
            return True, ""
        self.requests["refused"] += 1
        return False, f"router answered {status}: {body[:300]}"

    async def tick(self) -> Decision:
        now = time.monotonic()
        try:
            x = await self.observe()
        except Exception as e:
            d = Decision(
                time=time.time(),
                action="keep",
                current=self.last.current if self.last else 0,
                target=self.last.current if self.last else 0,
                reason=f"no topology from the router ({e})",
                inputs={},
            )
            return self._record(d)
        self.last_inputs = x
        action, target, reason = self.policy.decide(x, now)
        d = Decision(time=time.time(), action=action, current=x.dp, target=target, reason=reason, inputs=x.brief())
        if action != "keep":
            d.acted, d.error = await self.act(target)
            if not d.acted:
                d.reason += f"; not applied: {d.error}"
        return self._record(d)

    def _record(self, d: Decision) -> Decision:
        repeated = (
            d.action == "keep"
            and self.last is not None
            and (self.last.action, _kind(self.last.reason)) == (d.action, _kind(d.reason))
        )
        self.counts[d.action] += 1
        self.decisions.append(d)
        self.last = d
        log.log(
            logging.DEBUG if repeated else logging.INFO,
            "planner: decision %s target=%d current=%d inputs=%s reason=%s",
            d.action,
            d.target,
            d.current,
            msgspec.json.encode(d.inputs).decode(),
            d.reason,
        )
        return d

    def collect(self):
        """Prometheus collector (`self.registry`): the last decision and inputs, read at each scrape."""
        x, d = self.last_inputs, self.last
        yield GaugeMetricFamily(
            "elastic_planner_target_dp", "DP size the planner last decided on.", value=d.target if d else 0
        )
        yield GaugeMetricFamily("elastic_planner_current_dp", "DP size the router reported.", value=x.dp if x else 0)
        yield GaugeMetricFamily("elastic_planner_min_dp", "Lower bound.", value=self.bounds.min_dp)
        yield GaugeMetricFamily("elastic_planner_max_dp", "Upper bound.", value=self.bounds.max_dp)
        for name, help_, label, counts in (
            ("elastic_planner_decisions_total", "Planner decisions by action.", "action", self.counts),
            ("elastic_planner_scale_requests_total", "POST /scale sent, by result.", "result", self.requests),
        ):
            c = CounterMetricFamily(name, help_, labels=[label])
            for k, n in counts.items():
                c.add_metric([k], n)
            yield c
        if x is not None:
            for name, v, help_ in (
                ("elastic_planner_load", x.predicted, "Predicted load (running + waiting requests)."),
                ("elastic_planner_inflight_requests", x.inflight, "Requests in flight (last sample)."),
                ("elastic_planner_request_rate", x.rate_ewma, "Smoothed request rate (1/s)."),
                ("elastic_planner_ttft_p95_seconds", x.ttft_p95_s, "TTFT p95, last interval."),
                ("elastic_planner_itl_p95_seconds", x.itl_p95_s, "ITL p95, last interval."),
            ):
                if v is not None:
                    yield GaugeMetricFamily(name, help_, value=v)

    async def run(self, stop: asyncio.Event) -> None:
        import aiohttp

        async with aiohttp.ClientSession() as self.session:
            self.router.session = self.session
            log.info(
                "planner: bounds %d..%d, step %d, thresholds up %g / down %g per rank, interval %gs, "
                "hysteresis %d up / %d down intervals, cooldown %gs; router %s, frontend %s",
                self.bounds.min_dp,
                self.bounds.max_dp,
                self.cfg.step,
                self.bounds.up,
                self.bounds.down,
                self.cfg.interval_s,
                self.cfg.up_intervals,
                self.cfg.down_intervals,
                self.cfg.cooldown_s,
                self.router.url,
                self.frontend_url,
            )
            await self.router.wait_ready(stop)
            while not stop.is_set():
                t0 = time.monotonic()
                try:
                    await self.tick()
                except Exception:  # never let one bad sample end the planner
                    log.exception("planner: tick failed")
                try:
                    await asyncio.wait_for(stop.wait(), max(0.0, self.cfg.interval_s - (time.monotonic() - t0)))
                except TimeoutError:
                    pass


def _local(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def router_client(ctx: GraphContext, cfg: Planner.Config) -> RouterClient:
    """The graph's router, as its config says where it listens."""
    rt = msgspec.convert(ctx.configs.get("Router", {}), RouterConfig)
    return RouterClient(f"http://{_local(rt.host)}:{rt.port}", rt.token, cfg.http_timeout_s)


async def serve() -> None:
    ctx, _ = load_context()
    cfg = component_config(Planner.Config)
    bounds = resolve(cfg, msgspec.convert(ctx.configs.get("Worker", {}), WorkerConfig))
    fe = msgspec.convert(ctx.configs.get("Frontend", {}), FrontendConfig)
    svc = PlannerService(cfg, bounds, f"http://{_local(fe.host)}:{fe.port}", router_client(ctx, cfg))
    await run_planner(svc, cfg.port)


async def run_planner(svc: Any, port: int) -> None:
    """Run a planner service (`svc.run(stop)`) until SIGTERM or SIGINT, its `registry` served at
    127.0.0.1:`port`/metrics and its `decisions` at /decisions (none for port 0)."""
    from aiohttp import web

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    async def metrics(_):
        return web.Response(body=generate_latest(svc.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def decisions(_):
        return web.Response(body=msgspec.json.encode(list(svc.decisions)), content_type="application/json")

    runner = None
    if port:
        app = web.Application()
        app.add_routes([web.get("/metrics", metrics), web.get("/decisions", decisions)])
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        try:
            await web.TCPSite(runner, "127.0.0.1", port).start()
            log.info("planner metrics on http://127.0.0.1:%d/metrics", port)
        except OSError as e:  # the planner still plans; only its own endpoint is missing
            log.warning("planner: cannot serve metrics on 127.0.0.1:%d (%s); running without them", port, e)
    try:
        await svc.run(stop)
    finally:
        if runner is not None:
            await runner.cleanup()
    log.info("planner stopped; the deployment keeps its current size")


def main() -> None:
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    asyncio.run(serve())


if __name__ == "__main__":
    main()
