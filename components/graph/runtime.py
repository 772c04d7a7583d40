"""Dynamo runtime construction for graph processes.

The Rust runtime reads its transport settings from the environment when the
`DistributedRuntime` is built, so they are set here, just before, from the graph context.
Verified in ai-dynamo-runtime 1.6.1: `DistributedRuntime(event_loop, discovery_backend,
request_plane, enable_nats=None, *, event_plane=None, response_plane=None)`; the binary reads
DYN_FILE_KV, DYN_TCP_RPC_HOST, DYN_TCP_RESPONSE_STREAM_HOST and ETCD_ENDPOINTS.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from pathlib import Path
from urllib.parse import quote

from dynamo.runtime import DistributedRuntime

from components.graph.component import GraphContext

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"


def runtime_env(ctx: GraphContext) -> dict[str, str]:
    """The environment the chosen discovery backend needs (nothing is overwritten that the
    user set explicitly for the transport hosts, so multi-host setups can advertise real IPs)."""
    env: dict[str, str] = {"DYN_REQUEST_PLANE": "tcp", "DYN_DISCOVERY_BACKEND": ctx.discovery}
    if ctx.discovery == "file":
        if not ctx.discovery_dir:
            raise ValueError("file discovery needs a discovery_dir")
        env["DYN_FILE_KV"] = ctx.discovery_dir
        # File discovery only spans one machine, so advertise loopback: no interface guessing.
        env["DYN_TCP_RPC_HOST"] = os.environ.get("DYN_TCP_RPC_HOST", LOOPBACK)
        env["DYN_TCP_RESPONSE_STREAM_HOST"] = os.environ.get("DYN_TCP_RESPONSE_STREAM_HOST", LOOPBACK)
    elif ctx.discovery == "etcd":
        if not ctx.etcd_endpoints:
            raise ValueError("etcd discovery needs etcd_endpoints")
        env["ETCD_ENDPOINTS"] = ctx.etcd_endpoints
    else:
        raise ValueError(f"unknown discovery backend {ctx.discovery!r} (file or etcd)")
    return env


def make_runtime(loop: asyncio.AbstractEventLoop, ctx: GraphContext) -> DistributedRuntime:
    env = runtime_env(ctx)
    os.environ.update(env)
    log.debug("runtime env %s", env)
    return DistributedRuntime(loop, ctx.discovery, "tcp")


def unlist(ctx: GraphContext, endpoint: str, instance_id: int) -> bool:
    """Take a killed process's instance of `endpoint` ("component.name") out of discovery; True
    if it was listed. A process's instances stay listed until it unregisters them or their lease
    lapses: in file discovery an entry outlives its process by its 10 s TTL (ai-dynamo-runtime
    1.6.1), and a frontend that cannot connect to it drops it only until the next change to the
    listing brings it back, which a scale operation's registrations make at once. Each request
    sent there then spends one of the frontend's migrations: beside a failover and a removal, one
    request met dead or leaving instances four times in a row and failed with 503 (migration
    limit 3). Only file discovery's entries can be removed from outside their process here; an
    etcd entry goes when its lease lapses."""
    if ctx.discovery != "file":
        return False
    key = quote("/".join([ctx.namespace, *endpoint.split("."), format(instance_id, "x")]), safe="")
    try:
        (Path(ctx.discovery_dir) / "v1" / "instances" / key).unlink()
    except FileNotFoundError:
        return False
    return True


def nodelay_listener(port: int) -> bool:
    """Set TCP_NODELAY on this process's socket listening on `port`; the connections it accepts
    inherit it (Linux copies a listener's options to them). For a server the Rust runtime opens
    with Nagle on: Dynamo's OpenAI service (ai-dynamo-runtime 1.6.1) does, and on a keep-alive
    connection each response's first data chunk after the headers then waits for the client's
    delayed ACK, 40 ms. False where no such socket is found."""
    for fd in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            s = socket.socket(fileno=os.dup(int(fd)))
        except OSError:  # closed meanwhile
            continue
        with s:  # closes the duplicate only
            if (
                s.family in (socket.AF_INET, socket.AF_INET6)
                and s.type == socket.SOCK_STREAM
                and s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
                and s.getsockname()[1] == port
            ):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return True
    return False
