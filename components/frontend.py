"""Frontend: Dynamo's own OpenAI HTTP service (preprocessing, routing, migration).

It discovers workers that called `register_model` in the graph's namespace and routes to
their routable instances; the elastic router changes what is routable, not this process.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Any, ClassVar

from components.graph.component import Component, component_config, load_context
from components.protocol.config import FrontendConfig

log = logging.getLogger("components.frontend")


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


async def serve(cfg: FrontendConfig) -> None:
    from dynamo.llm import EngineType, EntrypointArgs, RouterConfig, make_engine, run_input

    from components.graph.runtime import make_runtime

    ctx, _ = load_context()
    loop = asyncio.get_running_loop()
    rt = make_runtime(loop, ctx)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, rt.shutdown)

    args = EntrypointArgs(
        EngineType.Dynamic,
        http_host=cfg.host,
        http_port=cfg.port,
        router_config=RouterConfig(_router_mode(cfg.router_mode)),
        namespace=ctx.namespace,
        migration_limit=cfg.migration_limit,
    )
    engine = await make_engine(rt, args)
    log.info("OpenAI HTTP service on http://%s:%d (namespace %s)", cfg.host, cfg.port, ctx.namespace)
    try:
        await run_input(rt, "http", engine)
    except asyncio.CancelledError:
        pass
    log.info("frontend stopped")


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = component_config(FrontendConfig)
    asyncio.run(serve(cfg))


if __name__ == "__main__":
    main()
