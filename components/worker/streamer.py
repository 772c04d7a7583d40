"""A rank's streaming process: the generate endpoint, on a Dynamo runtime of its own.

Streaming a token costs the serving side tens of microseconds of Python (a wake-up, a generator
resumed, an item handed through Dynamo's bridge to the runtime's threads), and a decode step
streams one token per running sequence: at 32 sequences and a 1.7 ms step, most of a core's GIL.
In the rank's process that GIL is the step thread's too, which takes it back after every CUDA call
that released it, waiting up to a switch interval each time the serving loop holds it; the served
step grew from 1.67 ms in process to 2.2-2.5 ms (H200, docs/design.md). Here the streams have a
GIL of their own. The rank sends one message a step with every token it emitted (stream_wire), and
takes requests, cancels and stream ends back; this process ends with the rank (parent-death
signal, and the socket's end) and the rank with it (stream_link.py)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import signal
import socket
import sys
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import uvloop

from components.graph.component import LOG_FORMAT, load_context
from components.graph.spawn import die_with_parent, write_output_to
from components.worker.component import Faults
from components.worker.generate_request import to_request, usage
from components.worker.presence import Presence
from components.worker.stream_wire import (
    READ_SIZE,
    Cancel,
    Closed,
    Frames,
    Handover,
    OutputMoved,
    Outputs,
    Ready,
    Refused,
    Route,
    Routed,
    Start,
    Stop,
    Submit,
    ToStreamer,
    frame,
)

log = logging.getLogger("components.worker")
REROUTE_POLL_S = 0.01  # instance_ids() reads the client's watched set: no I/O


class Streamer:
    def __init__(self, start: Start, writer: asyncio.StreamWriter):
        self.rank, self.max_len, self.writer = start.rank, start.max_len, writer
        self.faults = Faults.from_env()
        self.routable = asyncio.Event()
        self.streams: dict[str, asyncio.Queue] = {}  # request id -> its output queue
        self.presence: Presence | None = None
        self.client = None  # of the generate endpoint: a handover's continuation goes through it
        self.unreachable: set[int] = set()  # generate instances a killed rank left listed

    def send(self, msg: msgspec.Struct) -> None:
        self.writer.write(frame(msg))

    def deliver(self, msg: ToStreamer) -> None:
        if isinstance(msg, Outputs):
            for o in msg.outputs:
                # A stream handed over or closed leaves the engine's last outputs unclaimed.
                if (q := self.streams.get(o.request_id)) is not None:
                    q.put_nowait(o)
        elif isinstance(msg, (Refused, Handover)):
            if (q := self.streams.get(msg.request_id)) is not None:
                q.put_nowait(msg)

    async def route(self, routable: bool) -> None:
        try:
            if routable:
                await self.presence.enter()
                self.routable.set()
            else:
                if self.faults.leave_lag_s:  # still listed a while after it stops taking requests
                    self.routable.clear()
                    await asyncio.sleep(self.faults.leave_lag_s)
                await self.presence.leave()
                self.routable.clear()
        except Exception as e:  # the rank's SetRoutable fails with it
            self.send(Routed(error=f"{type(e).__name__}: {e}"))
            return
        self.send(Routed())

    async def generate(self, raw: dict[str, Any], context: Any = None) -> AsyncIterator[dict[str, Any]]:
        if not self.routable.is_set():
            async for chunk in self.reroute(raw):
                yield chunk
            return
        if (raw.get("stop_conditions") or {}).get("max_tokens") == 0:
            # Dynamo's frontend refuses max_tokens 0 from a client (400), so this is its migration
            # of a stream whose rank died after the last token went out but before the stream
            # closed: it resends with max_tokens less the tokens it got (lib/llm/src/migration.rs)
            # and nothing is left to generate. Refusing it would fail a request that had completed;
            # an empty stream ends it with the client's one finish_reason, already sent.
            return
        req = to_request(raw, self.max_len)
        out: asyncio.Queue = asyncio.Queue()
        self.streams[req.request_id] = out
        self.send(Submit(req))
        produced: list[int] = []
        held = None  # a handover taken from the queue behind tokens sent first
        try:
            while True:
                o, held = held or await out.get(), None
                if isinstance(o, Refused):
                    # A request the engine cannot serve is the client's fault: Dynamo's frontend
                    # turns InvalidArgument into a 400 with this message (a finish_reason
                    # "error: ..." is a 500).
                    from dynamo.llm.exceptions import InvalidArgument

                    raise InvalidArgument(o.error)
                if isinstance(o, Handover):
                    self.send(Cancel(req.request_id))
                    async for chunk in self.hand_over(raw, req, produced, o):
                        yield chunk
                    return
                tokens, reason = list(o.token_ids), o.finish_reason
                # Tokens that queued up while this stream waited go out as one chunk: a chunk costs
                # the loop (and Dynamo's bridge) tens of microseconds whatever it holds.
                while not reason and not out.empty():
                    nxt = out.get_nowait()
                    if isinstance(nxt, Handover):
                        held = nxt
                        break
                    tokens += nxt.token_ids
                    reason = nxt.finish_reason
                produced += tokens
                chunk: dict[str, Any] = {"token_ids": tokens}
                if reason:
                    chunk["finish_reason"] = reason
                    chunk["completion_usage"] = usage(len(req.prompt) - req.replay, req.replay + len(produced))
                yield chunk
                if reason:
                    if self.faults.exit_after_finish:
                        await asyncio.sleep(0.2)  # the last chunk goes out, the stream's end never does
                        log.error("rank %d: injected fault: exiting after finishing %s", self.rank, req.request_id)
                        os._exit(17)  # and the rank with it: it reads the end of the socket
                    return
        finally:
            del self.streams[req.request_id]
            self.send(Closed(req.request_id))  # the engine cancels it: a no-op once finished

    async def reroute(self, raw: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """A request routed here as this rank left routing (the frontend chose it from a list its
        leave had not reached yet) goes on on a rank that is listed, its stream coming back
        through this one; waiting here for this rank to be routed to again would wait for ever
        once it is parked. With none listed it waits for one, or for this rank's return."""
        while not self.routable.is_set():
            if sent := await self.send_on(raw):
                log.info("rank %d: out of routing: a request sent on to instance %x", self.rank, sent[0])
                async for item in sent[1]:
                    yield dict(item.data())
                return
            await asyncio.sleep(REROUTE_POLL_S)
        async for chunk in self.generate(raw):
            yield chunk

    async def send_on(self, raw: dict[str, Any], to: int | None = None) -> tuple[int, Any] | None:
        """(instance, its stream of `raw`) from another rank's generate instance: `to`, else, or
        where `to` cannot be reached, one that is listed; None while none is. One that cannot be
        reached is a killed rank's, listed until the router takes it out: the request goes to the
        next rather than failing with it (a 500, which the frontend does not migrate)."""
        me = self.presence.endpoint.connection_id()
        while True:
            if to is None:
                others = [i for i in self.client.instance_ids() if i != me and i not in self.unreachable]
                if not others:
                    return None
                to = random.choice(others)
            try:
                return to, await self.client.direct(raw, to)
            except Exception as e:  # not reached: no stream was opened, nothing was sent
                log.warning("rank %d: instance %x cannot be reached (%s): sending to another", self.rank, to, e)
                self.unreachable.add(to)
                to = None

    async def hand_over(
        self, raw: dict[str, Any], req, produced: list[int], to: Handover
    ) -> AsyncIterator[dict[str, Any]]:
        """Continue a request on a remaining rank's generate instance: its prompt plus the tokens
        so far go there, to be replayed as decode steps (GenerateRequest.replay), and its stream
        comes back through this one, so the client never notices."""
        log.info(
            "[op %s] rank %d: handing request %s over to instance %x after %d tokens",
            to.op,
            self.rank,
            req.request_id,
            to.instance_id,
            len(produced),
        )
        stop = dict(raw.get("stop_conditions") or {})
        stop["max_tokens"] = req.max_tokens - len(produced)
        cont = {
            **raw,
            "token_ids": list(req.prompt) + produced,
            "stop_conditions": stop,
            "replay": req.replay + len(produced),
        }
        n = req.replay + len(produced)
        sent = await self.send_on(cont, to.instance_id)
        if sent is None:  # no rank listed: the stream ends unfinished, and the frontend migrates it
            return
        async for item in sent[1]:
            chunk = dict(item.data())
            n += len(chunk.get("token_ids") or [])
            if chunk.get("finish_reason"):
                chunk["completion_usage"] = usage(len(req.prompt) - req.replay, n)
            yield chunk


async def messages(reader: asyncio.StreamReader) -> AsyncIterator[ToStreamer]:
    """The rank's messages, until its end is closed."""
    frames = Frames(ToStreamer)
    while True:
        try:
            data = await reader.read(READ_SIZE)
        except ConnectionResetError:
            return
        if not data:
            return
        for msg in frames.feed(data):
            yield msg


def output_moved(msg: OutputMoved) -> None:
    """Write where the rank's stdout goes now: its descriptor opened anew through /proc (a pipe
    or /dev/null, never a shared regular file: spawn.graph_output)."""
    write_output_to(os.open(f"/proc/{os.getppid()}/fd/1", os.O_WRONLY | os.O_CLOEXEC), msg.label)


async def serve(fd: int) -> None:
    from dynamo.llm import ModelInput, ModelType, WorkerType, register_model

    from components.graph.runtime import make_runtime

    sock = socket.socket(fileno=fd)
    reader, writer = await asyncio.open_unix_connection(sock=sock)
    rank = messages(reader)
    async for start in rank:
        if isinstance(start, Start):
            break
        output_moved(start)
    else:
        return  # the rank ended before it loaded
    ctx, _ = load_context()
    loop = asyncio.get_running_loop()
    rt = make_runtime(loop, ctx)
    s = Streamer(start, writer)
    ep = rt.endpoint(f"{ctx.namespace}.worker.generate")
    await register_model(
        ModelInput.Tokens,
        ModelType.Chat | ModelType.Completions,
        ep,
        start.model_dir,
        start.model_name,
        worker_type=WorkerType.Aggregated,
        # The card in the discovery store, where the frontend reads it: serving it from the
        # worker needs a system port per process (DYN_SYSTEM_PORT), and Dynamo's default asks for
        # that, warning and falling back to the store on every start.
        self_host_metadata=False,
    )
    s.client = await ep.client()
    s.presence = Presence(ep, s.client, s.generate)
    s.send(Ready(ep.connection_id()))
    routing: set[asyncio.Task] = set()
    async for msg in rank:
        if isinstance(msg, Route):
            task = asyncio.create_task(s.route(msg.routable))
            routing.add(task)
            task.add_done_callback(routing.discard)
        elif isinstance(msg, Stop):
            rt.shutdown()
            return
        elif isinstance(msg, OutputMoved):
            output_moved(msg)
        else:
            s.deliver(msg)
    # The rank is gone without a word (killed, or failed): so are its streams. Ending now drops
    # their connections, as the rank's own death would, and the frontend migrates them.
    os._exit(0)


def main() -> None:
    p = argparse.ArgumentParser(description="A rank's generate endpoint (started by the rank's process).")
    p.add_argument("--fd", type=int, required=True, help="this end of the socket pair to the rank")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    die_with_parent(signal.SIGKILL)
    # A signal to the rank's process group (the graph stopping it) is the rank's to act on: it
    # stops this process once its own endpoints are down.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Dynamo's runtime threads take the GIL to hand each item between the loop and Rust; at the
    # default 5 ms switch interval one could wait that long behind the loop, busy streaming a
    # step's tokens, for every item. 0.2 ms is what the rank's process used when it did this work
    # itself (50 us measured worse there: 6.9k against 7.7k output tok/s, README).
    sys.setswitchinterval(2e-4)
    # A step's tokens wake a stream each, and each hands Dynamo an item: asyncio's loop runs that
    # in Python, libuv's in C (as Dynamo's own workers run it). Measured when the streams shared
    # the rank's process (one rank, 32 streaming clients, H100, 5.4 GiB Mixtral-shaped bf16):
    # decode-only 6.9k -> 12.5k tok/s, ITL p50 4.5 -> 2.4 ms; 512-token prompts, 64 out: 6.1k ->
    # 8.8k tok/s.
    uvloop.run(serve(args.fd))


if __name__ == "__main__":
    main()
