"""The worker as a graph component: its configuration and process, the engine configuration and
model it implies, and the faults a test injects into it."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, ClassVar

import msgspec

from components.graph.component import (
    Component,
    GraphContext,
    ProcessSpec,
)
from components.protocol.config import WorkerConfig


class Worker(Component):
    Config = WorkerConfig

    module: ClassVar[str] = "components.worker"

    @classmethod
    def check(cls, c: Worker.Config) -> None:
        if not 1 <= c.min_ranks <= c.max_ranks:
            raise ValueError(f"Worker.min_ranks ({c.min_ranks}) must be in 1..max_ranks ({c.max_ranks})")
        if not c.min_ranks <= c.dp_size <= c.max_ranks:
            raise ValueError(
                f"Worker.dp_size ({c.dp_size}) must be in min_ranks..max_ranks ({c.min_ranks}..{c.max_ranks})"
            )
        if c.redundant_experts < 0:
            raise ValueError(f"Worker.redundant_experts ({c.redundant_experts}) must be at least 0")

    @classmethod
    def rank_process(cls, rank: int, join: bool = False) -> ProcessSpec:
        argv = [sys.executable, "-m", cls.module, "--rank", str(rank)] + (["--join"] if join else [])
        return ProcessSpec(label=f"Worker.{rank}", argv=argv, critical=False)

    @classmethod
    def processes(cls, config: Any, ctx: GraphContext) -> list[ProcessSpec]:
        cls.check(config)
        return [cls.rank_process(r) for r in range(config.dp_size)]


FAULT_ENV = "ELASTIC_EP_FAULT"
OP_ENV = "ELASTIC_EP_OP"  # the scale operation a joiner was started for


def started_for() -> str:
    """The id of the scale operation that started this joiner, for its log lines ("-": none)."""
    return os.environ.get(OP_ENV, "-")


class Faults(msgspec.Struct, frozen=True):
    """Failures a joiner injects into itself, to test that a scale operation aborts cleanly.
    Set only by a router whose `allow_fault_injection` is on (or by a test, in the environment of
    the ranks a graph starts with), through ELASTIC_EP_FAULT:
    `exit_on=<command tag>`, `corrupt_pull`, `stall_on=<command tag>,stall_s=<seconds>` (the
    command is answered that much later: a window for a fault elsewhere, or a missed deadline),
    `stall_mid_pull=<seconds>` (the first pull with READs from several sources holds the later
    ones back that long once the first is posted: a window to kill a source mid-transfer),
    `exit_after_finish` (the rank exits once its first stream's last chunk is out, before the
    stream closes: the frontend migrates a request that has nothing left to generate),
    `killed_loading=<rank>` (that rank of the first group, not a joiner for it, is killed as it
    starts loading, as the OOM killer would: it never registers), `stopped_loading=<rank>` (it
    stops itself there, SIGSTOP: a load that hangs), `leave_lag_s=<seconds>` (a rank leaving
    routing stays listed that long after it stops taking requests: the frontend's list lagging
    the leave, so requests still reach it and are sent on)."""

    exit_on: str = ""
    corrupt_pull: bool = False
    stall_on: str = ""
    stall_s: float = 0.0
    stall_mid_pull: float = 0.0
    exit_after_finish: bool = False
    killed_loading: int = -1
    stopped_loading: int = -1
    leave_lag_s: float = 0.0

    @classmethod
    def from_env(cls) -> Faults:
        spec = os.environ.get(FAULT_ENV, "")
        fields: dict[str, Any] = {}
        for part in filter(None, spec.split(",")):
            key, _, val = part.partition("=")
            fields[key] = val or True
        return msgspec.convert(fields, cls, strict=False)


def rank_config(c: Worker.Config, rank: int):
    """The engine configuration of rank `rank` under this worker configuration."""
    from components.engine.rank import RankConfig, batched_tokens, rank_device

    device = rank_device(c.device, rank)
    return RankConfig(
        rank=rank,
        max_ranks=c.max_ranks,
        device=device,
        dtype=c.dtype,
        max_seqs=c.max_seqs,
        max_len=c.max_len,
        max_batched_tokens=batched_tokens(c.max_batched_tokens, device),
        batch_invariant=c.batch_invariant,
        min_ranks=c.min_ranks,
        redundant_experts=c.redundant_experts,
        vmm=c.vmm,
        ep_transport=c.ep_transport,
    )


def model_source(cfg: Worker.Config) -> tuple[str, str]:
    """(checkpoint directory, served model name)."""
    if cfg.model:
        return cfg.model, cfg.served_model_name or Path(cfg.model).resolve().name
    from components.engine.models.builtin import BUILTIN_MODEL_NAME, builtin_model_dir

    return str(builtin_model_dir()), cfg.served_model_name or BUILTIN_MODEL_NAME
