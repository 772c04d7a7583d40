"""Test graph: one restartable process, which sleeps or (`exit_at_start`) exits at once."""

from __future__ import annotations

import sys
from typing import Any, ClassVar

import msgspec

from components.graph.component import Component, GraphContext, ProcessSpec


class Sidecar(Component):
    class Config(msgspec.Struct, forbid_unknown_fields=True):
        exit_at_start: bool = False

    module: ClassVar[str] = "unused"

    @classmethod
    def processes(cls, config: Any, ctx: GraphContext) -> list[ProcessSpec]:
        code = "raise SystemExit(3)" if config.exit_at_start else "import time; time.sleep(3600)"
        return [ProcessSpec(label="Sidecar", argv=[sys.executable, "-c", code], restart=True)]
