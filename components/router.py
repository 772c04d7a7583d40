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
import signal
import time
from typing import Any, ClassVar

import msgspec
from aiohttp import web

from components.component import Component, component_config, load_context
from components.control import (
    Configure, Connect, ControlReply, Describe, Pause, RankStatus, Resume, SetRoutable, decode_reply, encode,
)
from components.engine.expert_map import Placement, balanced_placement
from components.worker import Worker

log = logging.getLogger("components.router")

LOOPBACK = ("127.0.0.1", "localhost", "::1")


class Router(Component):
    class Config(msgspec.Struct, forbid_unknown_fields=True):
        host: str = "127.0.0.1"
        port: int = 8001
        token: str = ""  # bearer token for the control API; required when host is not loopback
        bootstrap_timeout_s: float = 300.0
        status_interval_s: float = 1.0

    module: ClassVar[str] = "components.router"

    @classmethod
    def urls(cls, config: Any) -> dict[str, str]:
        return {"control API": f"http://{config.host}:{config.port}/topology"}

    @classmethod
    def processes(cls, config: Any, ctx):
        if config.host not in LOOPBACK and not config.token:
            raise ValueError(f"Router.host {config.host!r} exposes the control API: set Router.token too")
        return super().processes(config, ctx)


class RankView(msgspec.Struct):
    rank: int
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
    experts_layer0: list[int]


class Topology(msgspec.Struct):
    epoch: int
    dp_size: int
    max_ranks: int
    active: list[int]
    ranks: list[RankView]
    operation: dict | None = None


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
        self.ready = asyncio.Event()
        self.started = time.monotonic()

    # ---- talking to ranks --------------------------------------------------------------------
    async def send(self, rank: int, msg) -> RankStatus:
        stream = await self.client.direct(encode(msg), self.instances[rank])
        reply: ControlReply | None = None
        async for item in stream:
            reply = decode_reply(item.data())
        if reply is None or not reply.ok:
            raise ControlError(f"rank {rank}: {type(msg).__name__.lower()} failed: "
                               f"{reply.error if reply else 'no reply'}")
        self.status[rank] = reply.status
        return reply.status

    async def send_all(self, ranks, make) -> list[RankStatus]:
        return await asyncio.gather(*(self.send(r, make(r)) for r in ranks))

    async def discover(self, want: int) -> None:
        """Wait for `want` ranks and learn which instance is which rank."""
        self.client = await self.rt.endpoint(f"{self.ctx.namespace}.worker.control").client()
        deadline = time.monotonic() + self.cfg.bootstrap_timeout_s
        while True:
            for iid in self.client.instance_ids():
                if iid not in self.instances.values():
                    stream = await self.client.direct(encode(Describe()), iid)
                    async for item in stream:
                        st = decode_reply(item.data()).status
                        self.instances[st.rank] = iid
                        self.status[st.rank] = st
                        log.info("found rank %d (instance %x)", st.rank, iid)
            if len(self.instances) >= want:
                return
            if time.monotonic() > deadline:
                raise ControlError(f"only ranks {sorted(self.instances)} of {want} appeared within "
                                   f"{self.cfg.bootstrap_timeout_s:.0f} s")
            await asyncio.sleep(0.2)

    async def bootstrap(self) -> None:
        want = self.wcfg.dp_size
        await self.discover(want)
        ranks = list(range(want))
        identities = {self.status[r].model_identity for r in ranks}
        if len(identities) != 1:
            raise ControlError(f"ranks serve different models: {identities}")
        meta = {r: self.status[r].metadata for r in ranks}
        await self.send_all(ranks, lambda r: Connect(peers={p: m for p, m in meta.items() if p != r}))
        st = self.status[0]
        placement = balanced_placement(st.num_moe_layers, st.num_experts, self.wcfg.max_ranks,
                                       st.slots_per_rank, ranks)
        await self.send_all(ranks, lambda r: Configure(epoch=1, active=ranks, placement=placement))
        await self.send_all(ranks, lambda r: Resume())
        await self.send_all(ranks, lambda r: SetRoutable(routable=True))
        self.epoch, self.active, self.placement = 1, ranks, placement
        log.info("epoch 1: ranks %s active and routable (%.1f s after start)", ranks,
                 time.monotonic() - self.started)
        self.ready.set()

    async def refresh(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.status_interval_s)
            for r in list(self.instances):
                try:
                    await asyncio.wait_for(self.send(r, Describe()), timeout=5)
                except Exception as e:
                    log.warning("rank %d did not answer: %s", r, e)

    # ---- HTTP ----------------------------------------------------------------------------------
    def topology(self) -> Topology:
        views = []
        for r, st in sorted(self.status.items()):
            experts = self.placement.experts_on(r, 0) if self.placement else []
            state = "ACTIVE" if r in self.active and st.routable else ("CONNECTED" if st.connected else "LOADED")
            views.append(RankView(rank=r, instance_id=st.instance_id, state=state, routable=st.routable,
                                  paused=st.paused, epoch=st.epoch, steps=st.steps, running=st.running,
                                  waiting=st.waiting, requests_total=st.requests_total, expert_rows=st.expert_rows,
                                  experts_layer0=[e for e in experts if e >= 0]))
        return Topology(epoch=self.epoch, dp_size=len(self.active), max_ranks=self.wcfg.max_ranks,
                        active=self.active, ranks=views)

    def metrics(self) -> str:
        lines = [
            "# HELP elastic_router_epoch Current topology epoch.", "# TYPE elastic_router_epoch gauge",
            f"elastic_router_epoch {self.epoch}",
            "# HELP elastic_router_active_ranks Ranks in the active set.", "# TYPE elastic_router_active_ranks gauge",
            f"elastic_router_active_ranks {len(self.active)}",
            "# HELP elastic_rank_steps Engine steps taken by a rank.", "# TYPE elastic_rank_steps counter",
        ]
        lines += [f'elastic_rank_steps{{rank="{r}"}} {st.steps}' for r, st in sorted(self.status.items())]
        lines += ["# HELP elastic_rank_running_requests Requests running on a rank.",
                  "# TYPE elastic_rank_running_requests gauge"]
        lines += [f'elastic_rank_running_requests{{rank="{r}"}} {st.running}' for r, st in sorted(self.status.items())]
        lines += ["# HELP elastic_rank_requests_total Requests a rank accepted.",
                  "# TYPE elastic_rank_requests_total counter"]
        lines += [f'elastic_rank_requests_total{{rank="{r}"}} {st.requests_total}' for r, st in sorted(self.status.items())]
        lines += ["# HELP elastic_rank_expert_rows Token-expert pairs computed by a rank.",
                  "# TYPE elastic_rank_expert_rows counter"]
        lines += [f'elastic_rank_expert_rows{{rank="{r}"}} {st.expert_rows}' for r, st in sorted(self.status.items())]
        return "\n".join(lines) + "\n"

    def app(self) -> web.Application:
        @web.middleware
        async def auth(request, handler):
            if self.cfg.token:
                given = request.headers.get("Authorization", "")
                if not hmac.compare_digest(given, f"Bearer {self.cfg.token}"):
                    return web.json_response({"error": "missing or wrong bearer token"}, status=401)
            return await handler(request)

        async def topology(_):
            return web.Response(body=msgspec.json.encode(self.topology()), content_type="application/json")

        async def health(_):
            ok = self.ready.is_set()
            return web.json_response({"status": "ready" if ok else "starting", "epoch": self.epoch},
                                     status=200 if ok else 503)

        async def metrics(_):
            return web.Response(text=self.metrics(), content_type="text/plain")

        app = web.Application(middlewares=[auth])
        app.add_routes([web.get("/topology", topology), web.get("/health", health), web.get("/metrics", metrics)])
        return app


async def serve() -> None:
    from components.runtime import make_runtime

    ctx, _ = load_context()
    cfg = component_config(Router.Config)
    wcfg = msgspec.convert(ctx.configs.get("Worker", {}), Worker.Config)
    loop = asyncio.get_running_loop()
    rt = make_runtime(loop, ctx)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    svc = RouterService(rt, ctx, cfg, wcfg)
    runner = web.AppRunner(svc.app())
    await runner.setup()
    await web.TCPSite(runner, cfg.host, cfg.port).start()
    log.info("control API on http://%s:%d", cfg.host, cfg.port)
    boot = asyncio.create_task(svc.bootstrap())
    refresh = asyncio.create_task(svc.refresh())
    waiter = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait({boot, waiter}, return_when=asyncio.FIRST_COMPLETED)
    if boot in done and boot.exception():
        raise boot.exception()
    await waiter
    for t in (boot, refresh):
        t.cancel()
    await runner.cleanup()
    rt.shutdown()
    log.info("router stopped")


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve())


if __name__ == "__main__":
    main()
