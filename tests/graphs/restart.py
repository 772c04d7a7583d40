"""Test graph: one restartable process, which sleeps, (`exit_at_start`) exits at once, or
(`health_port`) serves HTTP there, declared as its health URL; with `hang_at_start` it hangs
before serving instead: every time, or (`hang_marker`) only while that file does not exist,
which its first start creates."""

from __future__ import annotations

import sys
from typing import Any, ClassVar

import msgspec

from components.graph.component import Component, GraphContext, ProcessSpec

SERVE = """
import os, runpy, sys, time
port, hang, marker = sys.argv[1:]
if hang == "1" and not (marker and os.path.exists(marker)):
    if marker:
        open(marker, "w").close()
    time.sleep(3600)
sys.argv = ["http.server", port, "--bind", "127.0.0.1"]
runpy.run_module("http.server", run_name="__main__")
"""


class Sidecar(Component):
    class Config(msgspec.Struct, forbid_unknown_fields=True):
        exit_at_start: bool = False
        health_port: int = 0
        liveness_timeout_s: float = 2.0
        startup_timeout_s: float = 60.0
        hang_at_start: bool = False
        hang_marker: str = ""

    module: ClassVar[str] = "unused"

    @classmethod
    def processes(cls, config: Any, ctx: GraphContext) -> list[ProcessSpec]:
        if config.health_port:
            argv = [sys.executable, "-c", SERVE, str(config.health_port), str(int(config.hang_at_start))]
            return [
                ProcessSpec(
                    label="Sidecar",
                    argv=[*argv, config.hang_marker],
                    restart=True,
                    health_url=f"http://127.0.0.1:{config.health_port}/",
                    liveness_timeout_s=config.liveness_timeout_s,
                    startup_timeout_s=config.startup_timeout_s,
                )
            ]
        code = "raise SystemExit(3)" if config.exit_at_start else "import time; time.sleep(3600)"
        return [ProcessSpec(label="Sidecar", argv=[sys.executable, "-c", code], restart=True)]
