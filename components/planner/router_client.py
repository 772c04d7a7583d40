"""The router's control API as a planner uses it: its topology, a scale request, its health.
Both planners (ours, and Dynamo's through the virtual connector) act only through it."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import msgspec

from components.protocol.topology import ScaleMode, Topology

if TYPE_CHECKING:
    import aiohttp


class RouterClient:
    def __init__(self, url: str, token: str = "", timeout_s: float = 5.0):
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.timeout_s = timeout_s
        self.session: aiohttp.ClientSession | None = None  # the owner's, set when it runs

    def _timeout(self):
        import aiohttp

        return aiohttp.ClientTimeout(total=self.timeout_s)

    async def topology(self) -> Topology:
        async with self.session.get(f"{self.url}/topology", headers=self.headers, timeout=self._timeout()) as r:
            if r.status != 200:
                raise RuntimeError(f"GET {self.url}/topology: HTTP {r.status}")
            return msgspec.json.decode(await r.read(), type=Topology)

    async def scale(self, dp_size: int, mode: str) -> tuple[int, str]:
        """POST /scale: the HTTP status and body (202 accepted, 409 already that size or queued,
        400 refused with the reason, 503 the first group still forming)."""
        async with self.session.post(
            f"{self.url}/scale",
            json={"dp_size": dp_size, "mode": ScaleMode.parse(mode).value},
            headers=self.headers,
            timeout=self._timeout(),
        ) as r:
            return r.status, (await r.text()).strip()

    async def wait_ready(self, stop: asyncio.Event) -> None:
        """Until the router answers /health with 200 (its first group formed), or `stop`."""
        while not stop.is_set():
            try:
                async with self.session.get(f"{self.url}/health", headers=self.headers) as r:
                    if r.status == 200:
                        return
            except Exception:
                pass
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except TimeoutError:
                pass
