"""Hands the step thread's token outputs to the event loop that streams them.

A decode step yields one output per running sequence, all within microseconds. One
`call_soon_threadsafe` per output wakes the loop (a write to its self-pipe, a select, a handle)
that many times a step; the loop then competes for the GIL with the step thread, which waits for
it between the step's CUDA calls. An outbox wakes the loop once per burst: the first output posted
since the loop's last delivery schedules the delivery, the rest ride along with it."""

from __future__ import annotations

import asyncio
import threading
from typing import Any


class Outbox:
    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.lock = threading.Lock()
        self.items: list[tuple[asyncio.Queue, Any]] = []

    def post(self, queue: asyncio.Queue, item: Any) -> None:
        """From any thread: `item` goes into `queue` on the loop, after every item posted before it."""
        with self.lock:
            self.items.append((queue, item))
            if len(self.items) > 1:  # a delivery is scheduled already and has not run yet
                return
        self.loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self.lock:
            items, self.items = self.items, []
        for queue, item in items:
            queue.put_nowait(item)
