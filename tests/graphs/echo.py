"""Test graph: the real Frontend in front of EchoWorker ranks (real Dynamo processes)."""

from __future__ import annotations

import sys
from typing import Any, ClassVar

import msgspec

from components.frontend import Frontend
from components.graph.component import Component, GraphContext, ProcessSpec


class EchoWorker(Component):
    class Config(msgspec.Struct, forbid_unknown_fields=True):
        replicas: int = 1
        model_name: str = "echo"
        # "" -> the builtin tiny model dir, or a generated tokenizer-only dir when absent.
        model_dir: str = ""
        # Delay between streamed tokens, so tests can catch requests in flight.
        token_delay_s: float = 0.0

    module: ClassVar[str] = "tests.graphs.echo_worker"

    @classmethod
    def processes(cls, config: Any, ctx: GraphContext) -> list[ProcessSpec]:
        return [
            ProcessSpec(
                label=f"EchoWorker.{rank}",
                argv=[sys.executable, "-m", cls.module],
                env={"ECHO_RANK": str(rank)},
                critical=False,
            )
            for rank in range(config.replicas)
        ]


Frontend.link(EchoWorker)
