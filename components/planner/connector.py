"""A connector that lets Dynamo's own planner (`dynamo.planner`) drive this deployment.

Dynamo's planner scales "replicas" of prefill and decode workers through a connector
(`dynamo.planner.connectors.base.PlannerConnector`: `async_init`, `validate_deployment`,
`wait_for_deployment_ready`, `get_model_name`, `get_gpu_counts`, `get_actual_worker_counts`,
`set_component_replicas`, and the older `add_component` / `remove_component`). Here a DEP
deployment is aggregated (no prefill workers) and one decode "replica" is one DP/EP rank, so:

    decode desired_replicas = N   ->  POST /scale {"dp_size": N} on the router
    get_actual_worker_counts()    ->  (0, dp_size, not scaling)
    prefill targets               ->  only 0 is accepted

Use it as the planner's connector where `dynamo.planner` is installed, e.g. by constructing
`ElasticDPConnector(router_url=..., model_name=...)` in place of a `VirtualConnector`. It needs
nothing from `dynamo.planner` itself: targets may be its `TargetReplica` objects or this module's.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass
from typing import Any

import aiohttp

log = logging.getLogger("components.planner.connector")

DECODE, PREFILL = "decode", "prefill"


@dataclass
class TargetReplica:
    """Shape of `dynamo.planner`'s TargetReplica (sub_component_type, component_name, desired_replicas)."""

    sub_component_type: Any
    desired_replicas: int
    component_name: str | None = None


@dataclass
class WorkerInfo:
    """What the planner asks `get_worker_info` for (component and endpoint of the workers)."""

    component_name: str = "worker"
    endpoint: str = "generate"
    model_name: str = ""
    backend: str = "elastic-ep"


def _kind(t: Any) -> str:
    v = getattr(t, "sub_component_type", None)
    if v is None and isinstance(t, dict):
        v = t.get("sub_component_type")
    return str(getattr(v, "value", v)).lower()


def _desired(t: Any) -> int:
    return int(t["desired_replicas"] if isinstance(t, dict) else t.desired_replicas)


class ElasticDPConnector:
    def __init__(
        self,
        router_url: str = "http://127.0.0.1:8001",
        model_name: str = "",
        token: str = "",
        gpus_per_rank: int = 1,
        timeout_s: float = 600.0,
    ):
        self.router_url = router_url.rstrip("/")
        self.model_name = model_name.lower()
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.gpus_per_rank = gpus_per_rank
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    # ---- plumbing --------------------------------------------------------------------------------
    async def _s(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(headers=self.headers, timeout=self.timeout)
        return self._session

    async def topology(self) -> dict:
        async with (await self._s()).get(f"{self.router_url}/topology") as r:
            if r.status != 200:
                raise RuntimeError(f"router /topology: HTTP {r.status}: {await r.text()}")
            return await r.json()

    async def _scale(self, dp: int, blocking: bool) -> None:
        url = f"{self.router_url}/scale" + ("?wait=true" if blocking else "")
        async with (await self._s()).post(url, json={"dp_size": dp}) as r:
            body = await r.json(content_type=None)
            if r.status == 409:  # already at (or queued for) that size
                log.info("connector: dp_size is already %d", dp)
                if blocking:
                    await self._wait_idle()
                return
            if r.status == 400:
                raise ValueError(body.get("error", {}).get("message", str(body)))
            if r.status not in (200, 202):
                raise RuntimeError(f"router /scale: HTTP {r.status}: {body}")
            if r.status == 200 and body and body.get("phase") not in ("done", None):
                raise RuntimeError(f"scale to {dp} ended {body.get('phase')}: {body.get('error', '')}")
            log.info("connector: dp_size -> %d (%s)", dp, "done" if blocking else "accepted")

    async def _wait_idle(self, poll_s: float = 0.5) -> None:
        while True:
            topo = await self.topology()
            if not topo["scaling"] and topo.get("target") is None:
                return
            await asyncio.sleep(poll_s)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    # ---- PlannerConnector ------------------------------------------------------------------------
    async def async_init(self) -> None:
        await self.topology()  # fails early when the router is not reachable

    def get_worker_info(self, sub_component_type: Any = DECODE, backend: str = "vllm") -> WorkerInfo:
        return WorkerInfo(model_name=self.model_name)

    async def validate_deployment(
        self,
        prefill_component_name: str | None = None,
        decode_component_name: str | None = None,
        require_prefill: bool = True,
        require_decode: bool = True,
    ) -> None:
        if require_prefill:
            raise ValueError(
                "this deployment is aggregated DEP (no prefill workers): run the planner with "
                "require_prefill=False / decode only"
            )
        topo = await self.topology()
        if require_decode and not topo["active"]:
            raise ValueError("the deployment has no active rank")

    async def wait_for_deployment_ready(self, include_planner: bool = True) -> None:
        while True:
            try:
                async with (await self._s()).get(f"{self.router_url}/health") as r:
                    if r.status == 200:
                        break
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(1.0)
        await self._wait_idle()

    def get_model_name(self, require_prefill: bool = True, require_decode: bool = True) -> str:
        return self.model_name

    def get_gpu_counts(
        self, require_prefill: bool = True, require_decode: bool = True
    ) -> tuple[int | None, int | None]:
        return (None if require_prefill else 0), self.gpus_per_rank

    async def get_actual_worker_counts(
        self, prefill_component_name: str | None = None, decode_component_name: str | None = None
    ) -> tuple[int, int, bool]:
        topo = await self.topology()
        stable = not topo["scaling"] and topo.get("target") is None
        return 0, int(topo["dp_size"]), stable

    async def set_component_replicas(self, target_replicas: list[Any], blocking: bool = True) -> None:
        if not target_replicas:
            raise ValueError("target_replicas cannot be empty")
        dp = None
        for t in target_replicas:
            kind, n = _kind(t), _desired(t)
            if kind == PREFILL:
                if n != 0:
                    raise ValueError(f"prefill replicas must be 0 for an aggregated DEP deployment, got {n}")
            elif kind == DECODE:
                dp = n
            else:
                raise ValueError(f"unknown sub_component_type {kind!r}")
        if dp is None:
            return
        await self._scale(dp, blocking)

    async def add_component(self, sub_component_type: Any = DECODE, blocking: bool = True) -> None:
        await self._step(sub_component_type, +1, blocking)

    async def remove_component(self, sub_component_type: Any = DECODE, blocking: bool = True) -> None:
        await self._step(sub_component_type, -1, blocking)

    async def _step(self, sub_component_type: Any, delta: int, blocking: bool) -> None:
        if str(getattr(sub_component_type, "value", sub_component_type)).lower() != DECODE:
            raise ValueError("only decode workers (DP ranks) scale in this deployment")
        topo = await self.topology()
        base = topo["target"] if topo.get("target") is not None else topo["dp_size"]
        await self._scale(max(1, base + delta), blocking)

    # ---- GPU-sized steps ---------------------------------------------------------------------------
    def ranks_for_gpus(self, gpus: int) -> int:
        """Dynamo's planner budgets in GPUs; a rank takes `gpus_per_rank`."""
        return max(1, math.floor(gpus / self.gpus_per_rank))


__all__ = ["ElasticDPConnector", "TargetReplica", "WorkerInfo"]
