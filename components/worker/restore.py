"""What each copy of a snapshot image is told when it is restored: the rank and deployment it
becomes (the baked process itself is process.baked)."""

from __future__ import annotations

import msgspec

from components.graph.component import (
    GraphContext,
)


class RestoreIdentity(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Who a process restored from a snapshot image becomes: read from its stdin, a pipe the
    capacity provider hands each copy through CRIU's --inherit-fd."""

    rank: int
    pid: int  # its PID as the capacity provider sees it (inside, it has the baked process's)
    context: GraphContext  # namespace, discovery backend and endpoints, every component's config
    env: dict[str, str]  # the environment a cold joiner would have been given (GRAPH_ENV aside)
    nonce: str  # unique per copy: names its NIXL agents
    snapshot: str  # the snapshot id, for its log
