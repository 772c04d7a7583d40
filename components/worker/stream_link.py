"""The rank's end of its streaming process (streamer.py): started with the rank, handed the loaded
model, sent each step's tokens from the step thread as one message, and read by a thread of its
own that submits and cancels requests straight into the engine. Neither touches the rank's event
loop, which the step thread would otherwise wait on for the GIL."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
import sys
import threading
from typing import TYPE_CHECKING, NoReturn

import msgspec

from components.worker import stream_wire as wire
from components.worker.component import started_for

if TYPE_CHECKING:
    from components.engine.rank import EngineRank
    from components.engine.request import TokenOutput

log = logging.getLogger("components.worker")

EXIT_STREAMER_GONE = 71  # EX_OSERR: the process serving this rank's streams ended under it
STOP_GRACE_S = 5.0


class StreamLink:
    def __init__(self, rank: int):
        self.rank = rank
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        # Spawned from the main thread: the parent-death signal it sets fires when the thread
        # that started it ends, and only this one lives as long as the process.
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "components.worker.streamer", "--fd", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
        )
        theirs.close()
        self.sock = ours
        self.lock = threading.Lock()  # the step thread, the loop and the reader all send
        self.instance_id = 0  # of the generate endpoint, once registered (Ready)
        self.open: set[str] = set()  # request ids whose streams have not closed yet
        self.pending: list[TokenOutput] = []  # this step's outputs, step thread only
        self.engine: EngineRank | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.ready: asyncio.Future | None = None
        self.routed: asyncio.Future | None = None
        self.route_lock: asyncio.Lock | None = None
        self.stopping = False
        self.gone = threading.Lock()

    def send(self, msg: msgspec.Struct) -> None:
        data = wire.frame(msg)
        try:
            with self.lock:
                self.sock.sendall(data)
        except OSError:  # its end closed: whichever thread finds out first ends the rank
            if not self.stopping:
                self._gone()

    def start(self, engine: EngineRank, model_dir: str, model_name: str) -> None:
        """Hand the streaming process the loaded model. Its endpoint registers meanwhile (a fresh
        interpreter's imports and runtime: 0.2 s on the 2-core CPU), overlapping the join's
        weight pull and warmup, which need only the control endpoint: routing waits for it."""
        self.engine, self.loop = engine, asyncio.get_running_loop()
        self.ready, self.routed, self.route_lock = self.loop.create_future(), None, asyncio.Lock()
        engine.on_released = self.flush
        threading.Thread(target=self._read, name=f"streams-{self.rank}", daemon=True).start()
        self.send(wire.Start(rank=self.rank, model_dir=model_dir, model_name=model_name, max_len=engine.max_len))

    def emit(self, out: TokenOutput) -> None:
        self.pending.append(out)

    def flush(self) -> None:
        """After the step thread emitted a step's outputs: one message for all of them."""
        if self.pending:
            outputs, self.pending = self.pending, []
            self.send(wire.Outputs(outputs))

    async def route(self, routable: bool) -> None:
        """In or out of routing, seen in discovery (the generate endpoint lives over there)."""
        await self.ready
        async with self.route_lock:
            self.routed = self.loop.create_future()
            self.send(wire.Route(routable))
            error = await self.routed
        if error:
            raise RuntimeError(f"the generate endpoint could not {'enter' if routable else 'leave'} routing: {error}")

    def hand_over(self, request_id: str, instance_id: int, op: str) -> None:
        self.send(wire.Handover(request_id, instance_id, op))

    def output_moved(self, label: str) -> None:
        self.send(wire.OutputMoved(label))

    async def stop(self) -> None:
        """End the streaming process: it unregisters its endpoint and exits (killed if it does not)."""
        self.stopping = True
        self.send(wire.Stop())
        try:
            await asyncio.to_thread(self.proc.wait, STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def _read(self) -> None:
        frames = wire.Frames(wire.ToRank)
        while True:
            try:
                data = self.sock.recv(wire.READ_SIZE)
            except ConnectionResetError:  # it died with data of ours unread
                data = b""
            if not data:
                break
            for msg in frames.feed(data):
                self._handle(msg)
        if not self.stopping:
            self._gone()

    def _handle(self, msg: wire.ToRank) -> None:
        if isinstance(msg, wire.Submit):
            self._submit(msg)
        elif isinstance(msg, wire.Cancel):
            self.engine.cancel(msg.request_id)
        elif isinstance(msg, wire.Closed):
            self.open.discard(msg.request_id)
            self.engine.cancel(msg.request_id)  # a client gone mid-stream; a no-op once finished
        elif isinstance(msg, wire.Ready):
            self.instance_id = msg.instance_id
            log.info(
                "[op %s] rank %d: generate endpoint registered (instance %x)", started_for(), self.rank, msg.instance_id
            )
            self.loop.call_soon_threadsafe(self.ready.set_result, None)
        elif isinstance(msg, wire.Routed):
            self.loop.call_soon_threadsafe(self.routed.set_result, msg.error)

    def _gone(self) -> NoReturn:
        """The streaming process ended under this rank: its streams are gone, so the rank serves
        nobody. Exit, and the router fails it over (as when the step loop breaks) rather than keep
        a rank no request reaches."""
        self.gone.acquire()  # once: a second thread to find out waits here for the exit
        try:
            how = f"exited ({self.proc.wait(STOP_GRACE_S)})"
        except subprocess.TimeoutExpired:
            how = "closed its socket"
        log.critical("rank %d: its streaming process %s; exiting", self.rank, how)
        logging.shutdown()
        os._exit(EXIT_STREAMER_GONE)

    def _submit(self, msg: wire.Submit) -> None:
        from components.engine.request import RequestError

        self.open.add(msg.req.request_id)
        try:
            self.engine.submit(msg.req, self.emit)
        except RequestError as e:
            self.send(wire.Refused(msg.req.request_id, str(e)))
