"""Router: the topology authority (epoch, active ranks, expert placement) with a control HTTP API.

At start it forms the first group from the worker ranks `dp_size` says: it learns each rank's
communicator metadata, connects every rank to every other, installs epoch 1 with a balanced
expert placement, starts the ranks stepping and makes them routable. The frontend never talks
to the router: what the frontend may route to is the set of routable worker instances.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import signal
import time
from typing import Any, ClassVar

import msgspec
from aiohttp import web

from components.control.capacity import LocalProvider
from components.control.scaling import MODES, Operation, OpRecord, Scaler, ScaleRequest
from components.graph.component import Component, component_config, load_context
from components.protocol.messages import (
    Configure,
    Connect,
    ControlReply,
    Describe,
    LoadExperts,
    RankStatus,
    Resume,
    SetRoutable,
    decode_reply,
    encode,
)
from components.protocol.placement import Placement, balanced_placement
from components.worker import Worker

log = logging.getLogger("components.control.router")

LOOPBACK = ("127.0.0.1", "localhost", "::1")
OPEN_PATHS = ("/health", "/metrics")  # served without the bearer token (GET only)


class Router(Component):
    class Config(msgspec.Struct, forbid_unknown_fields=True):
        host: str = "127.0.0.1"
        port: int = 8001
        token: str = ""  # bearer token for the control API; required when host is not loopback
        bootstrap_timeout_s: float = 300.0
        status_interval_s: float = 1.0
        prepare_timeout_s: float = 120.0  # a joiner that takes longer to start, load or warm up aborts the op
        commit_timeout_s: float = 10.0  # a rank that misses it rolls the commit back
        drain_timeout_s: float = 30.0  # leaving ranks' requests still running after this are handed over
        rebalance: bool = True  # async EPLB after each scale operation
        park_leaving: bool = True  # keep leaving ranks' processes parked for the next scale-up
        # CUDA: also checkpoint a parked rank's GPU state with the driver API, so it holds no GPU
        # memory. Needs Worker.vmm (the weights are released first, never exported for CUDA IPC).
        # A failed restore falls back to a cold start.
        checkpoint_parked: bool = False
        # Where joining ranks come from: "local" processes on this host, or "kubernetes" pods of the
        # worker StatefulSet ($ELASTIC_EP_CAPACITY overrides, as the manifests in deploy/ do).
        capacity: str = "local"
        allow_fault_injection: bool = False  # lets POST /scale inject faults into joiners (tests only)

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
        return super().processes(config, ctx)


class RankView(msgspec.Struct):
    rank: int
    pid: int
    instance_id: int
    state: str
    routable: bool
    paused: bool
    epoch: int
    steps: int
    running: int
    waiting: int
    requests_total: int
    expert_rows: int
    graph_captures: int
    replays_diverged: int
    kv_usage: float  # KV cache in use, 0..1 (RankStatus.kv_used / kv_total)
    experts_layer0: list[int]


class Topology(msgspec.Struct):
    epoch: int
    dp_size: int
    max_ranks: int
    active: list[int]
    ranks: list[RankView]
    scaling: bool
    target: int | None  # the size queued behind the running operation, if any
    operation: OpRecord | None  # the running operation, or the last one


class ControlError(RuntimeError):
    pass


class RouterService:
    def __init__(self, rt, ctx, cfg: Router.Config, wcfg: Worker.Config):
        self.rt, self.ctx, self.cfg, self.wcfg = rt, ctx, cfg, wcfg
        self.client = None
        self.instances: dict[int, int] = {}  # rank -> instance id
        self.status: dict[int, RankStatus] = {}
        self.epoch = 0
        self.active: list[int] = []
        self.placement: Placement | None = None
        self.num_experts = 0
        self.load_base: dict[int, list[list[int]]] = {}  # per rank: expert load at the last rebalance
        self.ready = asyncio.Event()
        self.started = time.monotonic()
        self.scaler: Scaler | None = None
        self.op_results: dict[tuple[str, str], int] = {}  # (kind, final phase) -> count

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
        self.status[rank] = reply.status
        return reply

    async def send_all(self, ranks, make) -> list[ControlReply]:
        return await asyncio.gather(*(self.send(r, make(r)) for r in ranks))

    async def discover(self, ranks: list[int], provider=None, timeout: float | None = None) -> None:
        """Wait until every rank in `ranks` registered, and learn which instance is which rank.
        Fails early when the provider reports one of them dead."""
        if self.client is None:
            self.client = await self.rt.endpoint(f"{self.ctx.namespace}.worker.control").client()
        timeout = timeout or self.cfg.bootstrap_timeout_s
        deadline = time.monotonic() + timeout
        while True:
            for iid in self.client.instance_ids():
                if iid not in self.instances.values():
                    try:
                        stream = await self.client.direct(encode(Describe()), iid)
                        async for item in stream:
                            st = decode_reply(item.data()).status
                    except Exception as e:  # a stale entry of a rank that just went away
                        log.debug("instance %x did not describe itself: %s", iid, e)
                        continue
                    self.instances[st.rank] = iid
                    self.status[st.rank] = st
                    log.info("found rank %d (instance %x, %s)", st.rank, iid, st.state)
            missing = [r for r in ranks if r not in self.instances]
            if not missing:
                return
            dead = [r for r in missing if provider is not None and provider.alive(r) is False]
            if dead:
                raise ControlError(f"ranks {dead} died before registering")
            if time.monotonic() > deadline:
                raise ControlError(f"ranks {missing} did not appear within {timeout:.0f} s")
            await asyncio.sleep(0.1)

    def forget(self, rank: int) -> None:
        self.instances.pop(rank, None)
        self.status.pop(rank, None)
        self.load_base.pop(rank, None)

    def expert_load(self) -> list[list[int]]:
        """Tokens routed to each expert per MoE layer since the last rebalance, over active ranks."""
        total = None
        for r in self.active:
            cur = self.status[r].load
            base = self.load_base.get(r)
            rows = [[c - (base[i][j] if base else 0) for j, c in enumerate(row)] for i, row in enumerate(cur)]
            total = rows if total is None else [[a + b for a, b in zip(x, y)] for x, y in zip(total, rows)]
        return total or []

    def reset_load(self) -> None:
        self.load_base = {r: self.status[r].load for r in self.active}

    async def bootstrap(self) -> None:
        ranks = list(range(self.wcfg.dp_size))
        await self.discover(ranks)
        identities = {self.status[r].model_identity for r in ranks}
        if len(identities) != 1:
            raise ControlError(f"ranks serve different models: {identities}")
        meta = {r: self.status[r].metadata for r in ranks}
        await self.send_all(ranks, lambda r: Connect(peers={p: m for p, m in meta.items() if p != r}))
        st = self.status[0]
        self.num_experts = st.num_experts
        placement = balanced_placement(st.num_moe_layers, st.num_experts, self.wcfg.max_ranks, st.slots_per_rank, ranks)
        await self.send_all(ranks, lambda r: LoadExperts(placement=placement))
        await self.send_all(ranks, lambda r: Configure(epoch=1, active=ranks, placement=placement))
        await self.send_all(ranks, lambda r: Resume())
        await self.send_all(ranks, lambda r: SetRoutable(routable=True))
        self.epoch, self.active, self.placement = 1, ranks, placement
        log.info("epoch 1: ranks %s active and routable (%.1f s after start)", ranks, time.monotonic() - self.started)
        self.ready.set()

    async def refresh(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.status_interval_s)
            for r in list(self.instances):
                try:
                    await asyncio.wait_for(self.send(r, Describe()), timeout=5)
                except Exception as e:
                    log.warning("rank %d did not answer: %s", r, e)

    def observe_op(self, op: Operation) -> None:
        key = (op.record.kind, op.record.phase)
        self.op_results[key] = self.op_results.get(key, 0) + 1

    # ---- HTTP ----------------------------------------------------------------------------------
    def topology(self) -> Topology:
        views = []
        for r, st in sorted(self.status.items()):
            experts = self.placement.experts_on(r, 0) if self.placement else []
            views.append(
                RankView(
                    rank=r,
                    pid=st.pid,
                    instance_id=st.instance_id,
                    state=st.state,
                    routable=st.routable,
                    paused=st.paused,
                    epoch=st.epoch,
                    steps=st.steps,
                    running=st.running,
                    waiting=st.waiting,
                    requests_total=st.requests_total,
                    expert_rows=st.expert_rows,
                    graph_captures=st.graph_captures,
                    replays_diverged=st.replays_diverged,
                    kv_usage=st.kv_used / st.kv_total if st.kv_total else 0.0,
                    experts_layer0=[e for e in experts if e >= 0],
                )
            )
        sc = self.scaler
        op = sc.current.record if sc and sc.current else (sc.history[-1] if sc and sc.history else None)
        return Topology(
            epoch=self.epoch,
            dp_size=len(self.active),
            max_ranks=self.wcfg.max_ranks,
            active=self.active,
            ranks=views,
            scaling=bool(sc and sc.busy),
            target=sc.pending.dp_size if sc and sc.pending else None,
            operation=op,
        )

    def metrics(self) -> str:
        def family(name, kind, help_, samples):
            return [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", *samples]

        st = sorted(self.status.items())
        last = self.scaler.history[-1] if self.scaler and self.scaler.history else None
        lines = family(
            "elastic_router_epoch", "gauge", "Current topology epoch.", [f"elastic_router_epoch {self.epoch}"]
        )
        lines += family(
            "elastic_router_active_ranks",
            "gauge",
            "Ranks in the active set.",
            [f"elastic_router_active_ranks {len(self.active)}"],
        )
        lines += family(
            "elastic_router_scaling",
            "gauge",
            "1 while a scale operation runs or is queued.",
            [f"elastic_router_scaling {int(bool(self.scaler and self.scaler.busy))}"],
        )
        lines += family(
            "elastic_scale_operations_total",
            "counter",
            "Scale operations by kind and outcome.",
            [
                f'elastic_scale_operations_total{{kind="{k}",result="{p}"}} {n}'
                for (k, p), n in sorted(self.op_results.items())
            ],
        )
        if last is not None:
            lines += family(
                "elastic_scale_last_downtime_seconds",
                "gauge",
                "Downtime of the last scale commit (first pause to last resume).",
                [f'elastic_scale_last_downtime_seconds{{op="{last.id}"}} {last.downtime_s or 0}'],
            )
            lines += family(
                "elastic_scale_last_total_seconds",
                "gauge",
                "Duration of the last scale operation.",
                [f'elastic_scale_last_total_seconds{{op="{last.id}"}} {last.total_s or 0}'],
            )
            lines += family(
                "elastic_scale_last_phase_seconds",
                "gauge",
                "Seconds per phase of the last operation.",
                [f'elastic_scale_last_phase_seconds{{op="{last.id}",phase="{p}"}} {v}' for p, v in last.phases.items()],
            )
        lines += family(
            "elastic_rank_steps",
            "counter",
            "Engine steps taken by a rank.",
            [f'elastic_rank_steps{{rank="{r}"}} {s.steps}' for r, s in st],
        )
        lines += family(
            "elastic_rank_running_requests",
            "gauge",
            "Requests running on a rank.",
            [f'elastic_rank_running_requests{{rank="{r}"}} {s.running}' for r, s in st],
        )
        lines += family(
            "elastic_rank_requests_total",
            "counter",
            "Requests a rank accepted.",
            [f'elastic_rank_requests_total{{rank="{r}"}} {s.requests_total}' for r, s in st],
        )
        lines += family(
            "elastic_rank_expert_rows",
            "counter",
            "Token-expert pairs computed by a rank.",
            [f'elastic_rank_expert_rows{{rank="{r}"}} {s.expert_rows}' for r, s in st],
        )
        return "\n".join(lines) + "\n"

    def parse_scale(self, body: bytes, field: str) -> ScaleRequest:
        """A scale request, or ValueError with what is wrong (the HTTP layer answers 400)."""
        try:
            raw = msgspec.json.decode(body) if body else None
        except msgspec.DecodeError as e:
            raise ValueError(f"request body is not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ValueError(f'expected a JSON object like {{"{field}": 4}}')
        if field not in raw:
            raise ValueError(f"missing field '{field}'")
        n = raw[field]
        if isinstance(n, bool) or not isinstance(n, int):
            raise ValueError(f"{field} must be an integer, got {msgspec.json.encode(n).decode()}")
        lo, hi = self.wcfg.min_ranks, self.wcfg.max_ranks
        if n < lo:
            raise ValueError(f"{field} must be at least {lo} (Worker.min_ranks), got {n}")
        if n > hi:
            raise ValueError(
                f"{field} {n} exceeds max_ranks {hi}: the EP buffers and expert slots were sized "
                f"for {hi} ranks at launch"
            )
        mode = raw.get("mode", "C")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        fault = raw.get("fault", "")
        if fault and not self.cfg.allow_fault_injection:
            raise ValueError("fault injection is off (Router.allow_fault_injection)")
        drain = raw.get("drain_timeout", raw.get("drain_timeout_s", self.cfg.drain_timeout_s))
        if not isinstance(drain, (int, float)) or isinstance(drain, bool) or drain < 0:
            raise ValueError(f"drain_timeout must be a number of seconds >= 0, got {drain!r}")
        return ScaleRequest(dp_size=n, mode=mode, drain_timeout_s=float(drain), fault=fault)

    def app(self) -> web.Application:
        @web.middleware
        async def auth(request, handler):
            # Probes and scrapers read health and metrics without the token; both are read-only.
            if self.cfg.token and not (request.method in ("GET", "HEAD") and request.path in OPEN_PATHS):
                given = request.headers.get("Authorization", "")
                if not hmac.compare_digest(given, f"Bearer {self.cfg.token}"):
                    return web.json_response({"error": "missing or wrong bearer token"}, status=401)
            return await handler(request)

        def error(status: int, message: str):
            return web.json_response({"error": {"message": message, "code": status}}, status=status)

        async def topology(_):
            return web.Response(body=msgspec.json.encode(self.topology()), content_type="application/json")

        async def health(_):
            ok = self.ready.is_set()
            return web.json_response(
                {"status": "ready" if ok else "starting", "epoch": self.epoch}, status=200 if ok else 503
            )

        async def metrics(_):
            return web.Response(text=self.metrics(), content_type="text/plain")

        async def submit(request, field):
            if not self.ready.is_set():
                return None, error(503, "the first group is still forming")
            try:
                req = self.parse_scale(await request.read(), field)
            except ValueError as e:
                return None, error(400, str(e))
            queued = self.scaler.pending or (self.scaler.current.req if self.scaler.current else None)
            now = queued.dp_size if queued else len(self.active)
            if req.dp_size == now:
                return None, error(409, f"{field} is already {now}" + (" (queued)" if queued else ""))
            self.scaler.request(req)
            return req, None

        async def scale(request):
            req, err = await submit(request, "dp_size")
            if err:
                return err
            if request.query.get("wait", "") in ("1", "true"):
                rec = await self.scaler.wait_idle()
                return web.Response(body=msgspec.json.encode(rec), content_type="application/json")
            return web.json_response({"accepted": True, "dp_size": req.dp_size, "mode": req.mode}, status=202)

        async def scale_elastic_ep(request):
            # vLLM's API: blocks until the deployment reached the size.
            req, err = await submit(request, "new_data_parallel_size")
            if err:
                return err
            rec = await self.scaler.wait_idle()
            ok = rec is not None and rec.phase == "done" and len(self.active) == req.dp_size
            return web.json_response(
                {"success": ok, "new_data_parallel_size": len(self.active), "operation": msgspec.to_builtins(rec)},
                status=200 if ok else 500,
            )

        async def is_scaling(_):
            return web.json_response({"is_scaling": bool(self.scaler and self.scaler.busy)})

        app = web.Application(middlewares=[auth])
        app.add_routes(
            [
                web.get("/topology", topology),
                web.get("/health", health),
                web.get("/metrics", metrics),
                web.post("/scale", scale),
                web.post("/scale_elastic_ep", scale_elastic_ep),
                web.post("/is_scaling_elastic_ep", is_scaling),
            ]
        )
        return app


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
    cfg = component_config(Router.Config)
    wcfg = msgspec.convert(ctx.configs.get("Worker", {}), Worker.Config)
    loop = asyncio.get_running_loop()
    rt = make_runtime(loop, ctx)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    svc = RouterService(rt, ctx, cfg, wcfg)
    provider = make_provider(os.environ.get("ELASTIC_EP_CAPACITY") or cfg.capacity, ctx)
    svc.scaler = Scaler(svc, provider)
    runner = web.AppRunner(svc.app())
    await runner.setup()
    await web.TCPSite(runner, cfg.host, cfg.port).start()
    log.info("control API on http://%s:%d", cfg.host, cfg.port)
    boot = asyncio.create_task(svc.bootstrap())
    refresh = asyncio.create_task(svc.refresh())
    scaler = asyncio.create_task(svc.scaler.run())
    waiter = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait({boot, waiter}, return_when=asyncio.FIRST_COMPLETED)
    if boot in done and boot.exception():
        raise boot.exception()
    await waiter
    for t in (boot, refresh, scaler):
        t.cancel()
    await provider.close()
    await runner.cleanup()
    rt.shutdown()
    log.info("router stopped")


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve())


if __name__ == "__main__":
    main()
