"""The component contract shared by `dynamo serve` and every process of a graph.

A graph is a set of `Component` subclasses joined with `link`; `dynamo serve` resolves each
component's `Config`, asks it for the processes to start (`processes`) and tells every process
what it needs through two environment variables, read back with `load_context` and
`component_config`.
"""

from __future__ import annotations

import os
import sys
from typing import Any, ClassVar, TypeVar

import msgspec

GRAPH_ENV = "ELASTIC_EP_GRAPH"
COMPONENT_ENV = "ELASTIC_EP_COMPONENT"
# The pid of `dynamo serve`: a process that outlives the component that started it (a joiner
# the router started, adopted by the router's next incarnation) still dies with the graph.
GRAPH_PID_ENV = "ELASTIC_EP_GRAPH_PID"
# A process that exits with this code cannot start as configured (a bad model, a length the model
# does not have): retrying or carrying on without it cannot help, so `dynamo serve` stops the
# graph at once with the process's last log line, critical or not.
EXIT_CANNOT_START = 78  # EX_CONFIG of sysexits.h
# Every process's log lines; `dynamo serve` prefixes each with the process's label.
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

C = TypeVar("C", bound=msgspec.Struct)


class ProcessSpec(msgspec.Struct):
    label: str
    argv: list[str]
    env: dict[str, str] = {}
    # A critical process dying takes the whole graph down; a non-critical one (a worker rank)
    # is only reported, because the router copes with lost ranks.
    critical: bool = True
    # Started again when it dies (before the graph stops for it): a process that holds no state
    # the graph cannot rebuild, such as the router (it adopts the topology the ranks serve). One
    # that keeps dying soon after its start still stops the graph, with its reason.
    restart: bool = False
    # Liveness: `dynamo serve` GETs this URL while the process runs, and one that has not answered
    # (any HTTP status) for `liveness_timeout_s` is hung (stopped, deadlocked): it is SIGKILLed,
    # and then restarted or reported like any other death. Until its first answer it has
    # `startup_timeout_s` instead, so that a long start is not taken for a hang, but one that
    # hangs before it ever answers is; that counts as a death soon after its start.
    health_url: str = ""
    liveness_timeout_s: float = 5.0
    startup_timeout_s: float = 60.0


class GraphContext(msgspec.Struct):
    namespace: str
    discovery: str
    discovery_dir: str
    etcd_endpoints: str
    configs: dict[str, dict[str, Any]]
    # Private to this run of the graph and removed when it stops: state a component keeps across
    # its own restarts (the router's operation history).
    run_dir: str = ""


class Component:
    Config: ClassVar[type[msgspec.Struct]] = msgspec.defstruct("EmptyConfig", [])
    module: ClassVar[str]
    # Per-class edge list; `link` creates it on first use so subclasses never share the base's.
    _links: ClassVar[list[type[Component]]]

    @classmethod
    def name(cls) -> str:
        return cls.__name__

    @classmethod
    def link(cls, other: type[Component]) -> type[Component]:
        if "_links" not in cls.__dict__:
            cls._links = []
        if other not in cls._links:
            cls._links.append(other)
        return other

    @classmethod
    def links(cls) -> list[type[Component]]:
        return list(cls.__dict__.get("_links", []))

    @classmethod
    def urls(cls, config: Any) -> dict[str, str]:
        """What `dynamo serve` shows in its banner, e.g. {"OpenAI API": "http://..."}."""
        return {}

    @classmethod
    def processes(cls, config: Any, ctx: GraphContext) -> list[ProcessSpec]:
        return [ProcessSpec(label=cls.name(), argv=[sys.executable, "-m", cls.module])]


def graph_components(root: type[Component]) -> list[type[Component]]:
    """Every component reachable from `root` through links, root first (breadth-first)."""
    seen: list[type[Component]] = [root]
    i = 0
    while i < len(seen):
        for nxt in seen[i].links():
            if nxt not in seen:
                seen.append(nxt)
        i += 1
    return seen


def encode_context(ctx: GraphContext) -> str:
    return msgspec.json.encode(ctx).decode()


def load_context() -> tuple[GraphContext, str]:
    """The graph context and this process's component name, as set by `dynamo serve`."""
    raw = os.environ.get(GRAPH_ENV)
    name = os.environ.get(COMPONENT_ENV, "")
    if not raw:
        raise RuntimeError(
            f"{GRAPH_ENV} is not set: this module is a graph component, start it with `dynamo serve <graph>:<Root>`"
        )
    try:
        ctx = msgspec.json.decode(raw, type=GraphContext)
    except msgspec.ValidationError as e:
        raise RuntimeError(f"{GRAPH_ENV} is not a valid graph context: {e}") from e
    if not name:
        raise RuntimeError(f"{COMPONENT_ENV} is not set")
    return ctx, name


def component_config(config_type: type[C]) -> C:
    """This process's resolved config, converted to `config_type`."""
    ctx, name = load_context()
    if name not in ctx.configs:
        raise RuntimeError(f"graph context has no config for component {name!r}")
    try:
        return msgspec.convert(ctx.configs[name], config_type)
    except msgspec.ValidationError as e:
        raise RuntimeError(f"bad config for component {name!r}: {e}") from e
