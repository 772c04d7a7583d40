"""Frontend: Dynamo's own OpenAI HTTP service (preprocessing, routing, migration).

It discovers workers that called `register_model` in the graph's namespace and routes to
their routable instances; the elastic router changes what is routable, not this process.

Dynamo's service listens on a loopback port of its own; the configured address is a thin guard in
front of it that refuses what Dynamo would answer wrongly: OpenAI parameters it accepts but drops
in preprocessing (`GUARDED`, per endpoint), bodies it repairs (invalid UTF-8, raw control
characters) or cannot parse without a 500 (JSON nested too deeply), a body that never arrives in
full. It names the token id Dynamo refuses with a bare "Invalid request", gives a stream the
worker refuses its 4xx before any of it, and passes everything else through as it is, streams
chunk by chunk.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import signal
import socket
import sys
from collections.abc import Callable
from http import HTTPStatus
from pathlib import Path
from typing import Any, ClassVar

import msgspec

from components.graph.component import LOG_FORMAT, Component, component_config, load_context
from components.protocol.config import FrontendConfig
from components.protocol.config import RouterConfig as ElasticRouterConfig
from components.protocol.prompt import out_of_vocabulary

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
# The same for the Responses API, whose conversion drops the sampling penalties too (Dynamo 1.6.1;
# `text.format` reaches the worker, which refuses it). Accepted: `instructions` (applied),
# `user`, `metadata`, `safety_identifier`, `prompt_cache_key`, `service_tier` (identifiers),
# `parallel_tool_calls`; `background`, `previous_response_id`, `prompt` and `max_tool_calls`
# Dynamo refuses itself (501).
RESPONSES_DROPPED = (
    ("tools", (None, []), "it has no tool calling"),
    ("tool_choice", (None, "none"), "it has no tool calling"),
    ("reasoning", (None,), "it has no reasoning budget"),
    ("include", (None, []), "it adds nothing to a response (no logprobs, reasoning or tool output)"),
    ("top_logprobs", (None, 0), "it returns no log probabilities"),
    ("truncation", (None, "disabled"), "it does not truncate the input (a longer one is refused)"),
    ("conversation", (None,), "it keeps no conversations"),
    ("store", (None, False), "it stores no responses"),
    ("presence_penalty", (None, 0), "it applies no sampling penalties"),
    ("frequency_penalty", (None, 0), "it applies no sampling penalties"),
)
# Every endpoint Dynamo's service answers with generated text, and what its preprocessing drops
# there (its other routes need a model of another type, which the workers never register).
GUARDED = {
    "/v1/completions": DROPPED,
    "/v1/chat/completions": DROPPED,
    "/v1/responses": RESPONSES_DROPPED,
    "/v1/responses/input_tokens": RESPONSES_DROPPED,
}
MAX_BODY_BYTES = 64 << 20
# Per connection, not forwarded (RFC 9110 7.6.1); the length is the guard's own to set.
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "upgrade", "content-length", "host"}
# Events of a Responses stream that Dynamo sends before the worker has answered.
PREAMBLE_EVENTS = {"response.created", "response.in_progress"}
MAX_PREAMBLE_BYTES = 1 << 20


READ_METHODS = ("GET", "HEAD", "OPTIONS")


def dropped_parameter(req: dict, dropped=DROPPED) -> str | None:
    """Why a request sets a parameter the engine would never see (`dropped`: an endpoint's table),
    or None."""
    for name, off, why in dropped:
        value = req.get(name)
        if value in off:
            continue
        shown = f"{name}={json.dumps(value)}" if isinstance(value, (str, int, float, bool)) else name
        return f"{shown} is not supported by this engine: {why}"
    return None


def body_refusal(path: str, body: bytes) -> str | None:
    """Why a POST body is refused before Dynamo reads it, or None. Dynamo repairs invalid UTF-8
    and raw control characters in JSON strings (U+FFFD, escapes) and answers the repaired request;
    both are invalid JSON (RFC 8259 8.1, 7), refused here with where they are. Other malformed JSON
    Dynamo refuses itself, saying where."""
    if not body:
        return None
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        return f"the request body is not valid UTF-8: byte 0x{body[e.start]:02x} at offset {e.start}"
    try:
        req = json.loads(text)
    except RecursionError:
        return "the request body's JSON is nested too deeply"
    except json.JSONDecodeError as e:
        try:
            json.loads(text, strict=False)
        except (ValueError, RecursionError):
            return None
        return (
            f"the request body holds a raw control character (0x{ord(text[e.pos]):02x}) in a JSON string at "
            f"line {e.lineno} column {e.colno}: JSON strings escape it (\\u{ord(text[e.pos]):04x})"
        )
    dropped = GUARDED.get(path)
    if dropped is None or not isinstance(req, dict):
        return None
    return dropped_parameter(req, dropped)


def token_prompts(body: bytes) -> tuple[str, list[list[int]]]:
    """(model, prompts) of a completions body whose prompt is token ids (one list or a batch of
    them); no prompts for anything else."""
    try:
        req = json.loads(body)
    except (ValueError, RecursionError):
        return "", []
    if not isinstance(req, dict):
        return "", []

    def ids(p) -> bool:
        return isinstance(p, list) and bool(p) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)

    p, model = req.get("prompt"), str(req.get("model"))
    if ids(p):
        return model, [p]
    if isinstance(p, list) and p and all(ids(x) for x in p):
        return model, p
    return model, []


def vocabulary_refusal(prompts: list[list[int]], vocab: int) -> str | None:
    """The first token id of `prompts` outside the vocabulary, named with its prompt and index."""
    for i, prompt in enumerate(prompts):
        why = out_of_vocabulary(prompt, vocab)
        if why is not None:
            return f"prompt {why}" if len(prompts) == 1 else f"prompt {i}: {why}"
    return None


def vocabulary_sizes(configs: dict[str, dict[str, Any]]) -> dict[str, int]:
    """{served model name: the number of token ids a prompt may use} for the graph's workers: ids
    below both the tokenizer's size (Dynamo's preprocessing refuses the others, saying only
    "Invalid request") and the model's vocab_size (the rank refuses the others)."""
    import msgspec

    from components.worker.component import Worker, model_source

    if Worker.__name__ not in configs:
        return {}
    model_dir, name = model_source(msgspec.convert(configs[Worker.__name__], Worker.Config))
    d = Path(model_dir)
    sizes = [json.loads((d / "config.json").read_text())["vocab_size"]]
    if (d / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        sizes.append(Tokenizer.from_file(str(d / "tokenizer.json")).get_vocab_size(with_added_tokens=True))
    return {name: min(sizes)}


def error_body(status: int, message: str) -> dict[str, Any]:
    """An error in the shape Dynamo's service answers with."""
    return {"message": message, "type": HTTPStatus(status).phrase, "code": status}


def _event(raw: bytes) -> tuple[str, Any]:
    """(event name, its data as JSON or None) of one SSE event."""
    name, data = "", []
    for line in raw.decode("utf-8", "replace").splitlines():
        if line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
    try:
        return name, json.loads("\n".join(data)) if data else None
    except ValueError:
        return name, None


def stream_refusal(name: str, data: Any) -> tuple[int, str] | None:
    """(status, message) when a stream's first event is the refusal of its request: a chat or
    completions error event with a 4xx code, or a Responses `response.failed` for an invalid
    prompt (what Dynamo answers 400 when not streaming)."""
    if not isinstance(data, dict):
        return None
    err = data.get("error")
    if isinstance(err, dict) and isinstance(err.get("code"), int) and 400 <= err["code"] < 500:
        return err["code"], str(err.get("message"))
    resp = data.get("response")
    if name == "response.failed" and isinstance(resp, dict) and isinstance(resp.get("error"), dict):
        if resp["error"].get("code") == "invalid_prompt":
            return 400, str(resp["error"].get("message"))
    return None


async def first_event(content) -> tuple[bytes, tuple[int, str] | None]:
    """Read an SSE stream up to its first event that is not a preamble (an SSE comment, or a
    Responses event Dynamo sends before the worker answered); (the bytes read, that event's
    refusal or None)."""
    buf = b""
    while len(buf) < MAX_PREAMBLE_BYTES:
        chunk = await content.readany()
        if not chunk:
            return buf, None
        buf += chunk
        events = buf.replace(b"\r\n", b"\n").split(b"\n\n")
        for raw in events[:-1]:  # the last one is not complete yet
            name, data = _event(raw)
            if (data is None and name == "") or name in PREAMBLE_EVENTS:
                continue
            return buf, stream_refusal(name, data)
    return buf, None


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


async def guard(
    cfg: FrontendConfig, upstream: str, vocabularies: Callable[[], dict[str, int]], router_health: str = ""
):
    """The public listener: refuse what Dynamo's service would answer wrongly (`body_refusal`,
    in its error shape), say why for a token prompt it refuses without a reason, give a refused
    stream its 4xx before any of it, pass everything else to Dynamo's service at `upstream`.
    `vocabularies`: `vocabulary_sizes` of the graph, called once when first needed. While the
    router's `router_health` says no rank serves, Dynamo's answer that no instance serves the
    model becomes a 503 with the router's reason."""
    import aiohttp
    from aiohttp import web

    from components.graph.runtime import nodelay_listener

    sizes: asyncio.Future | None = None

    async def vocabulary(model: str) -> int | None:
        nonlocal sizes
        if sizes is None:
            sizes = asyncio.ensure_future(asyncio.to_thread(vocabularies))
        try:
            return (await asyncio.shield(sizes)).get(model)
        except Exception as e:  # a reason left unsaid: Dynamo's own answer goes out
            log.warning("cannot read the served models' vocabularies: %s", e)
            return None

    def refuse(status: int, message: str) -> web.Response:
        return web.json_response(error_body(status, message), status=status)

    async def no_serving_rank() -> str | None:
        try:
            async with session.get(router_health, timeout=aiohttp.ClientTimeout(total=2)) as r:
                health = await r.json()
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
            return None
        return health.get("reason") if health.get("status") == "no serving rank" else None

    async def forward(request: web.Request) -> web.StreamResponse:
        try:
            body = await asyncio.wait_for(request.read(), cfg.body_timeout_s)
        except TimeoutError:
            announced = f" of the {request.content_length} bytes announced" if request.content_length else ""
            why = f"the request body did not arrive in full{announced} within {cfg.body_timeout_s:g} s"
            resp = refuse(408, why + " (Frontend.body_timeout_s)")
            resp.force_close()  # the rest of the body may still come: this connection is done
            return resp
        if request.method not in READ_METHODS and not request.path.startswith("/v1/"):
            # Dynamo's own admin routes (POST /busy_threshold sets the load-shedding thresholds)
            # share its port; the public one serves the OpenAI API and read-only probes only.
            return refuse(404, f"{request.method} {request.path} is not served on the OpenAI port")
        if request.method == "POST":
            why = body_refusal(request.path, body)
            if why is not None:
                return refuse(400, why)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        try:
            up = await session.request(
                request.method, upstream + request.rel_url.raw_path_qs, headers=headers, data=body
            )
        except aiohttp.ClientConnectionError as e:
            return refuse(503, f"the OpenAI service is not reachable: {e}")
        # Leaving this block early (the client went away) closes the upstream connection, which
        # cancels the request in Dynamo as a direct client's disconnect would.
        async with up:
            # No instance serves the model: Dynamo's 503 "not ready", or 404 once it dropped the model.
            if up.status in (404, 503) and request.path in GUARDED and router_health:
                why = await no_serving_rank()
                if why is not None:
                    return refuse(503, why)
            head = b""
            if up.status == 400 and request.path == "/v1/completions":
                head = await up.read()
                model, prompts = token_prompts(body)
                vocab = await vocabulary(model) if prompts else None
                why = vocabulary_refusal(prompts, vocab) if vocab is not None else None
                if why is not None:
                    return refuse(400, why)
            elif up.status == 200 and up.content_type == "text/event-stream":
                head, refused = await first_event(up.content)
                if refused is not None:
                    return refuse(*refused)
            resp = web.StreamResponse(
                status=up.status,
                reason=up.reason,
                headers={k: v for k, v in up.headers.items() if k.lower() not in HOP_BY_HOP},
            )
            await resp.prepare(request)
            if head:
                await resp.write(head)
            async for chunk in up.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            return resp

    # Clients find the port closed until Dynamo's service listens, as they would without the guard.
    # Nothing to close is opened before: a graph stopped while this waits leaves no session behind.
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
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0),
        timeout=aiohttp.ClientTimeout(total=None),
        auto_decompress=False,
    )
    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app.router.add_route("*", "/{tail:.*}", forward)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, cfg.host, cfg.port).start()
    return runner, session


async def serve(cfg: FrontendConfig) -> None:
    from dynamo.llm import EngineType, EntrypointArgs, RouterConfig, make_engine, run_input

    from components.graph.runtime import make_runtime

    ctx, _ = load_context()
    loop = asyncio.get_running_loop()
    rt = make_runtime(loop, ctx)
    stopping = asyncio.Event()

    def stop() -> None:
        stopping.set()
        rt.shutdown()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop)

    internal = _free_loopback_port()
    vocabularies = functools.partial(vocabulary_sizes, ctx.configs)
    health = msgspec.convert(ctx.configs.get("Router", {}), ElasticRouterConfig).health_url
    public = asyncio.ensure_future(guard(cfg, f"http://127.0.0.1:{internal}", vocabularies, health))
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
    except Exception as e:
        # Stopped while starting (a rank that cannot start stops the graph within a second): Dynamo
        # says its discovery watch was cancelled, which is the stop, not a fault to report.
        if not stopping.is_set():
            raise
        log.info("stopped while starting (%s)", e)
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
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    cfg = component_config(FrontendConfig)
    asyncio.run(serve(cfg))


if __name__ == "__main__":
    main()
