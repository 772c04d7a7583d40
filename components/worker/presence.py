"""A rank's presence in routing: its generate endpoint listed in discovery, where the frontend
finds the instances it sends requests to.

Dynamo's `serve_endpoint` lists the instance from a task of its own, some time after it is
called (a few ms, more under load). An `unregister_endpoint_instance` that runs before then
either removes nothing, the registration landing after it, or fails ("Unable to unregister
endpoint instance from discovery"); either way the instance stays listed (ai-dynamo-runtime
1.6.1, file discovery: of 60 leaves 0-4 ms after the enter, 7 raised and left it listed; one in
the same tick returned, and the registration listed it afterwards). A scale-down right behind a
scale-up sends a joiner such a leave: a failed SetRoutable aborts the scale-down (the likely
cause of a test_router_restart flake under CI's load), a silent one leaves a parked rank listed.
So `enter` and `leave` return only once this process's own client of the endpoint, which
watches discovery the way the frontend does, sees the change: a scale-up is done when its
joiners can be routed to, and a leave cannot run ahead of the registration before it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dynamo.runtime import Client, Endpoint

POLL_S = 0.002  # instance_ids() reads the client's watched set: no I/O
LISTING_TIMEOUT_S = 10.0


class Presence:
    def __init__(self, endpoint: Endpoint, client: Client, handler: Callable, timeout_s: float = LISTING_TIMEOUT_S):
        self.endpoint, self.client, self.handler, self.timeout_s = endpoint, client, handler, timeout_s
        self.serving: asyncio.Future | None = None  # serve_endpoint, from the first enter on
        self._landed = False  # serve_endpoint's own registration was seen
        self._lock = asyncio.Lock()  # one change at a time, each seen through before the next

    @property
    def listed(self) -> bool:
        return self.endpoint.connection_id() in self.client.instance_ids()

    async def enter(self) -> None:
        async with self._lock:
            # Generate is first served here, not at start: until its group committed, a rank
            # must not appear in routing even for a moment.
            if self.serving is None:
                self.serving = asyncio.ensure_future(self.endpoint.serve_endpoint(self.handler))
            elif self._landed:
                await self.endpoint.register_endpoint_instance()
            await self._until_listed()

    async def leave(self) -> None:
        async with self._lock:
            if self.serving is None:
                return  # never entered: nothing listed (and Dynamo's unregister would fail)
            if not self._landed:
                await self._until_listed()  # else it could land after the unregister
            await self.endpoint.unregister_endpoint_instance()
            await self._until(listed=False)

    async def _until_listed(self) -> None:
        await self._until(listed=True)
        self._landed = True

    async def _until(self, listed: bool) -> None:
        deadline = time.monotonic() + self.timeout_s
        while self.listed != listed:
            if self.serving is not None and self.serving.done():
                self.serving.result()  # its exception, if it raised one
                raise RuntimeError("the generate endpoint stopped serving")
            if time.monotonic() > deadline:
                state = "does not list it" if listed else "still lists it"
                raise TimeoutError(f"discovery {state} {self.timeout_s:.0f} s after this rank asked")
            await asyncio.sleep(POLL_S)
