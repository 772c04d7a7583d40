"""Test graph: one restartable process, which sleeps, (`exit_at_start`) exits at once, or
(`health_port`) serves HTTP there, declared as its health URL."""

from __future__ import annotations

import sys
from typing import Any, ClassVar

import msgspec

from components.graph.component import Component, GraphContext, ProcessSpec


class Sidecar(Component):
    class Config(msgspec.Struct, forbid_unknown_fields=True):
        exit_at_start: bool = False
        health_port: int = 0
        liveness_timeout_s: float = 2.0

    module: ClassVar[str] = "unused"

    @classmethod
    def processes(cls, config: Any, ctx: GraphContext) -> list[ProcessSpec]:
        if config.health_port:
            argv = [sys.executable, "-m", "http.server", str(config.health_port), "--bind", "127.0.0.1"]
            return [
                ProcessSpec(
                    label="Sidecar",
                    argv=argv,
                    restart=True,
                    health_url=f"http://127.0.0.1:{config.health_port}/",
                    liveness_timeout_s=config.liveness_timeout_s,
                )
            ]
        code = "raise SystemExit(3)" if config.exit_at_start else "import time; time.sleep(3600)"
        return [ProcessSpec(label="Sidecar", argv=[sys.executable, "-c", code], restart=True)]
