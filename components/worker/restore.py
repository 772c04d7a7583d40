"""A rank restored from a snapshot image: the process baked into the image, and the identity each
copy restored from it is told."""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path

import msgspec

from components.graph.component import (
    GraphContext,
)
from components.graph.spawn import die_with_parent
from components.protocol.config import WorkerConfig
from components.worker.component import OP_ENV

log = logging.getLogger("components.worker")


class RestoreIdentity(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Who a process restored from a snapshot image becomes: read from its stdin, a pipe the
    capacity provider hands each copy through CRIU's --inherit-fd."""

    rank: int
    pid: int  # its PID as the capacity provider sees it (inside, it has the baked process's)
    context: GraphContext  # namespace, discovery backend and endpoints, every component's config
    env: dict[str, str]  # the environment a cold joiner would have been given (GRAPH_ENV aside)
    nonce: str  # unique per copy: names its NIXL agents
    snapshot: str  # the snapshot id, for its log


def baked(spec_path: str) -> None:
    """The process `snapshot-bake bake --tier criu` dumps: a rank-0 joiner built and warmed alone,
    part of no group, with no NIXL agent and no sockets. It blocks reading stdin, where it is
    dumped; each copy restored from the image reads its RestoreIdentity there and serves."""
    from components.worker.process import serve
    from components.worker.server import RankServer
    from snapshot.bake import BakeSpec, warm_for_image
    from snapshot.criu_image import join_restorer_network

    die_with_parent()  # the baker: a bake that failed leaves nothing behind
    # Imported before the dump, so that no copy pays for them (1-2 s here); importing them starts
    # no thread and opens nothing.
    import dynamo.llm  # noqa: F401

    import components.graph.runtime  # noqa: F401

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
    asyncio.run(serve(who.rank, True, server))
