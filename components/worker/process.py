"""A rank's process: its server on the Dynamo runtime, ended with the graph (a joiner outlives the
router that started it, never the graph), and the process a snapshot image is baked from."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import uvloop

from components.graph.component import (
    EXIT_CANNOT_START,
    GRAPH_PID_ENV,
    component_config,
    load_context,
)
from components.graph.spawn import die_with_parent, graph_output, write_output_to
from components.protocol.config import WorkerConfig
from components.worker.component import OP_ENV, Worker, started_for
from components.worker.restore import RestoreIdentity
from components.worker.server import RankServer
from components.worker.stream_link import StreamLink

log = logging.getLogger("components.worker")


def die_with_graph(loop: asyncio.AbstractEventLoop, stop: Callable[[], None], streams: StreamLink, parent: int) -> None:
    """Stop (`stop`) when `dynamo serve` is gone. A joiner outlives the router that started it
    (`parent`; a restarted router adopts it, capacity.py) but never the graph; its output went
    through that router, so once the router is gone it goes to the graph's output itself, and
    so does its streaming process's (`streams`)."""
    graph = int(os.environ.get(GRAPH_PID_ENV) or 0)
    if not graph:
        return
    try:
        graph_fd = os.pidfd_open(graph)
    except ProcessLookupError:  # gone before we looked
        stop()
        return
    if parent == graph:
        loop.add_reader(graph_fd, stop)
        return
    try:
        parent_fd = os.pidfd_open(parent)
    except ProcessLookupError:
        parent_fd = -1
    watch_graph(loop, stop, streams, graph_fd, parent_fd, lambda: graph_output(graph))


def restored_watch(loop: asyncio.AbstractEventLoop, stop: Callable[[], None], streams: StreamLink) -> None:
    """die_with_graph for a copy restored from a snapshot image: in its own PID namespace it
    cannot name the graph or the router by PID, so it takes the pidfds its namespace's init
    holds for it (snapshot.nsinit), and that init's descriptor on the graph's output."""
    from snapshot.nsinit import GRAPH_FD, OUTPUT_FD, PARENT_FD

    try:
        init = os.pidfd_open(1)
        graph_fd, parent_fd = pidfd_getfd(init, GRAPH_FD), pidfd_getfd(init, PARENT_FD)
    except OSError as e:  # restored with no graph to die with (snapshot.criu_image.restore)
        log.info("rank %d: no graph to watch (%s): dies with the process that restored it", streams.rank, e)
        return
    out = f"/proc/1/fd/{OUTPUT_FD}"
    watch_graph(loop, stop, streams, graph_fd, parent_fd, lambda: os.open(out, os.O_WRONLY))


def pidfd_getfd(pidfd: int, fd: int) -> int:
    """A copy of descriptor `fd` of the process `pidfd` refers to (Linux pidfd_getfd)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    got = libc.syscall(438, pidfd, fd, 0)  # SYS_pidfd_getfd, the same number on every architecture
    if got < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"pidfd_getfd({fd}): {os.strerror(err)}")
    return got


def watch_graph(
    loop: asyncio.AbstractEventLoop,
    stop: Callable[[], None],
    streams: StreamLink,
    graph_fd: int,
    parent_fd: int,
    open_output: Callable[[], int],
) -> None:
    """Stop when the process of `graph_fd` ends; when the one of `parent_fd` (the router that
    started this joiner; -1: gone already) ends, write to `open_output()` instead of to it."""
    loop.add_reader(graph_fd, stop)

    def parent_gone() -> None:
        try:
            fd = open_output()
        except OSError:
            fd = os.open(os.devnull, os.O_WRONLY)
        label = f"Worker.{streams.rank}"
        write_output_to(fd, label)
        streams.output_moved(label)
        log.info("rank %d: the router that started this joiner is gone; serving on", streams.rank)

    if parent_fd < 0:
        parent_gone()
        return

    def on_parent_exit() -> None:
        loop.remove_reader(parent_fd)
        os.close(parent_fd)
        parent_gone()

    loop.add_reader(parent_fd, on_parent_exit)


async def serve(rank: int, join: bool, server: RankServer | None = None) -> None:
    """Run rank `rank`: built here, or `server`, restored from a snapshot image (engine built)."""
    from components.graph.runtime import make_runtime

    ctx, _ = load_context()
    cfg = component_config(Worker.Config)
    # Before the first NIXL agent reads UCX's configuration (a restored copy opens its agents
    # after this, as it goes live).
    os.environ["UCX_NET_DEVICES"] = cfg.net_devices
    restored = server is not None
    if server is None:
        server = RankServer(rank, cfg, ctx, join)
        start = server.load
    else:
        start = functools.partial(server.go_live, time.perf_counter())
    parent = os.getppid()  # before loading: who started this process, however long loading takes
    # Started first, it sets up (imports, a runtime) while the engine loads.
    server.streams = StreamLink(rank)
    try:
        await asyncio.to_thread(start)
    except ValueError as e:  # the model or the configuration: the same on every rank, every retry
        log.error("rank %d cannot start: %s", rank, e)
        sys.exit(EXIT_CANNOT_START)
    except ImportError as e:  # the environment (a package missing or broken): likewise
        log.error("rank %d cannot start: %s cannot import the engine: %s", rank, sys.executable, e)
        sys.exit(EXIT_CANNOT_START)
    loop = asyncio.get_running_loop()
    rt = make_runtime(loop, ctx)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, rt.shutdown)
    if restored:  # in another PID namespace
        restored_watch(loop, rt.shutdown, server.streams)
    else:
        die_with_graph(loop, rt.shutdown, server.streams, parent)
    server.ctl_ep = rt.endpoint(f"{ctx.namespace}.worker.control")
    server.streams.start(server.engine, server.model_dir, server.model_name)
    server.note(started_for(), f"serving {server.model_name!r}, waiting for the router")
    ctl = asyncio.ensure_future(server.ctl_ep.serve_endpoint(server.control))
    exit_wait = asyncio.ensure_future(server.exit.wait())
    try:
        await asyncio.wait({ctl, exit_wait}, return_when=asyncio.FIRST_COMPLETED)
        if server.exit.is_set():
            await asyncio.sleep(0.2)  # let the reply to Exit go out
            rt.shutdown()
    finally:
        await server.streams.stop()
        server.engine.stop()
        server.store.close()
        log.info("rank %d: stopped", rank)


def baked(spec_path: str) -> None:
    """The process `snapshot-bake bake --tier criu` dumps: a rank-0 joiner built and warmed alone,
    part of no group, with no NIXL agent and no sockets. It blocks reading stdin, where it is
    dumped; each copy restored from the image reads its RestoreIdentity there and serves."""
    from snapshot.bake import BakeSpec, warm_for_image
    from snapshot.criu_image import join_restorer_network

    die_with_parent()  # the baker: a bake that failed leaves nothing behind
    # Imported before the dump, so that no copy pays for them (1-2 s here); importing them starts
    # no thread and opens nothing. (The streaming process a copy starts imports its own.)
    import components.graph.runtime  # noqa: F401
    import components.worker.stream_link  # noqa: F401

    spec = msgspec.json.decode(Path(spec_path).read_bytes(), type=BakeSpec)
    server = RankServer(0, WorkerConfig(), None, join=True)
    server.engine = warm_for_image(spec)
    # CRIU restores a parent-death signal, and a copy's first parent (criu restore -d) exits at
    # once. A baker gone from here on closes the pipe, and the read below ends this process.
    die_with_parent(0)
    log.info("warm; waiting to be dumped")
    who = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=RestoreIdentity)
    # Before the runtime, the NIXL agent and their threads open anything: peers and discovery are
    # in the restorer's network namespace, not in this copy's own.
    if join_restorer_network():
        log.info("[op %s] rank %d: joined the restorer's network namespace", who.env.get(OP_ENV, "-"), who.rank)
    server.restored(who)
    uvloop.run(serve(who.rank, True, server))
