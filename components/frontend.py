"""Frontend: Dynamo's own OpenAI HTTP service (preprocessing, routing, migration).

It discovers workers that called `register_model` in the graph's namespace and routes to
their routable instances; the elastic router changes what is routable, not this process.

Dynamo's service listens on a loopback port of its own; the configured address is a thin guard in
front of it that refuses OpenAI parameters Dynamo accepts but drops in preprocessing (`DROPPED`),
and passes everything else through as it is, streams chunk by chunk.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
import sys
from typing import Any, ClassVar

from components.graph.component import Component, component_config, load_context
from components.protocol.config import FrontendConfig

log = logging.getLogger("components.frontend")

# OpenAI parameters that Dynamo's frontend accepts and then drops while preprocessing a request:
# no worker ever sees them, so the worker's own check (components/worker/generate_request.py, `to_request`) cannot
# refuse them, and answering would pretend they were honoured. (parameter, the values that mean
# "off", why). Accepted as they are: `user`, `metadata`, `service_tier` (identifiers),
# `prediction` and `parallel_tool_calls` (without tools, no effect on the output);
# `functions` / `function_call` Dynamo refuses itself.
DROPPED = (
    ("tools", (None, []), "it has no tool calling"),
    ("tool_choice", (None, "none"), "it has no tool calling"),
    ("logit_bias", (None, {}), "it applies no logit bias"),
    ("suffix", (None, ""), "it has no insertion (suffix) mode"),
    ("audio", (None,), "it generates text only"),
    ("modalities", (None, ["text"]), "it generates text only"),
    ("reasoning_effort", (None,), "it has no reasoning budget"),
    ("web_search_options", (None,), "it has no web search"),
    ("store", (None, False), "it stores no completions"),
)
GUARDED_PATHS = ("/v1/completions", "/v1/chat/completions")
MAX_BODY_BYTES = 64 << 20
# Per connection, not forwarded (RFC 9110 7.6.1); the length is the guard's own to set.
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "upgrade", "content-length", "host"}


def dropped_parameter(body: bytes) -> str | None:
    """Why a request body sets a parameter the engine would never see, or None."""
    try:
        req = json.loads(body)
    except ValueError:
        return None  # Dynamo answers malformed JSON itself
    if not isinstance(req, dict):
        return None
    for name, off, why in DROPPED:
        value = req.get(name)
        if value in off:
            continue
        shown = f"{name}={json.dumps(value)}" if isinstance(value, (str, int, float, bool)) else name
        return f"{shown} is not supported by this engine: {why}"
    return None


class Frontend(Component):
    Config = FrontendConfig

    module: ClassVar[str] = "components.frontend"

    @classmethod
    def urls(cls, config: Any) -> dict[str, str]:
        host = "127.0.0.1" if config.host in ("0.0.0.0", "::", "") else config.host
        return {"OpenAI API": f"http://{host}:{config.port}/v1"}


def _router_mode(name: str):  # -> dynamo.llm.RouterMode
    from dynamo.llm import RouterMode

    return {"round-robin": RouterMode.RoundRobin, "random": RouterMode.Random}[name]


def _free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def guard(cfg: FrontendConfig, upstream: str):
    """The public listener: refuse `DROPPED` parameters with a 400 naming them (in Dynamo's error
    shape), pass everything else to Dynamo's service at `upstream`."""
    import aiohttp
    from aiohttp import web

    from components.graph.runtime import nodelay_listener

    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0),
        timeout=aiohttp.ClientTimeout(total=None),
        auto_decompress=False,
    )

    async def forward(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if request.method == "POST" and request.path in GUARDED_PATHS:
            why = dropped_parameter(body)
            if why is not None:
                return web.json_response({"message": why, "type": "Bad Request", "code": 400}, status=400)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        try:
            up = await session.request(
                request.method, upstream + request.rel_url.raw_path_qs, headers=headers, data=body
            )
        except aiohttp.ClientConnectionError as e:
            return web.json_response(
                {"message": f"the OpenAI service is not reachable: {e}", "type": "Service Unavailable", "code": 503},
                status=503,
            )
        # Leaving this block early (the client went away) closes the upstream connection, which
        # cancels the request in Dynamo as a direct client's disconnect would.
        async with up:
            resp = web.StreamResponse(
                status=up.status,
                reason=up.reason,
                headers={k: v for k, v in up.headers.items() if k.lower() not in HOP_BY_HOP},
            )
            await resp.prepare(request)
            async for chunk in up.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            return resp

    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app.router.add_route("*", "/{tail:.*}", forward)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    # Clients find the port closed until Dynamo's service listens, as they would without the guard.
    host, port = upstream.rsplit("//", 1)[1].rsplit(":", 1)
    while True:
        try:
            _, w = await asyncio.open_connection(host, int(port))
            w.close()
            break
        except OSError:
            await asyncio.sleep(0.1)
    if not nodelay_listener(int(port)):
        log.warning("no listener on port %s in this process: Dynamo's responses keep Nagle's delay", port)
    await web.TCPSite(runner, cfg.host, cfg.port).start()
    return runner, session


async def serve(cfg: FrontendConfig) -> None:
    from dynamo.llm import EngineType, EntrypointArgs, RouterConfig, make_engine, run_input

    from components.graph.runtime import make_runtime

    ctx, _ = load_context()
    loop = asyncio.get_running_loop()
    rt = make_runtime(loop, ctx)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, rt.shutdown)

    internal = _free_loopback_port()
    public = asyncio.ensure_future(guard(cfg, f"http://127.0.0.1:{internal}"))
    args = EntrypointArgs(
        EngineType.Dynamic,
        http_host="127.0.0.1",
        http_port=internal,
        router_config=RouterConfig(_router_mode(cfg.router_mode)),
        namespace=ctx.namespace,
        migration_limit=cfg.migration_limit,
    )
    engine = await make_engine(rt, args)

    def listening(task: asyncio.Future) -> None:
        if task.cancelled():
            return
        if task.exception() is not None:  # the configured port taken, say: nothing could reach us
            log.error("cannot listen on %s:%d: %s", cfg.host, cfg.port, task.exception())
            failed.set()
            rt.shutdown()
            return
        log.info(
            "OpenAI HTTP service on http://%s:%d (namespace %s; Dynamo's own on 127.0.0.1:%d)",
            cfg.host,
            cfg.port,
            ctx.namespace,
            internal,
        )

    failed = asyncio.Event()
    public.add_done_callback(listening)
    try:
        await run_input(rt, "http", engine)
    except asyncio.CancelledError:
        pass
    finally:
        if public.done() and not public.cancelled() and public.exception() is None:
            runner, session = public.result()
            await runner.cleanup()
            await session.close()
        else:
            public.cancel()
    if failed.is_set():
        sys.exit(1)
    log.info("frontend stopped")


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = component_config(FrontendConfig)
    asyncio.run(serve(cfg))


if __name__ == "__main__":
    main()
