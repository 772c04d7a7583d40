"""What the router publishes and accepts about the deployment's shape: the committed topology, the
scale request and mode, an operation's record, and `/topology`, which the planner decodes with the
same types."""

from __future__ import annotations

import enum

import msgspec

from components.protocol.messages import RankStatus, RankSummary
from components.protocol.placement import Placement


class ScaleMode(enum.Enum):
    """How much of a scale operation runs while the deployment serves (the vLLM elastic EP post's
    modes A, B and C; the API accepts the letters too)."""

    BLOCKING = "blocking"  # A: serving pauses first; start, load, connect, warm up, commit
    PREPARE_ASYNC = "prepare_async"  # B: start, load, connect while serving; warm up inside the pause
    PREPARE_ASYNC_REUSE_GRAPHS = "prepare_async_reuse_graphs"  # C: only the in-place switch pauses

    @property
    def letter(self) -> str:
        return _LETTERS[self]

    @property
    def warms_inside_pause(self) -> bool:
        """Modes A and B warm joiners up (and re-capture graphs) inside the commit's pause."""
        return self is not ScaleMode.PREPARE_ASYNC_REUSE_GRAPHS

    @classmethod
    def parse(cls, text: str) -> ScaleMode:
        """A mode by name or letter; ValueError listing both otherwise."""
        for mode in cls:
            if text in (mode.value, mode.letter):
                return mode
        raise ValueError(f"mode must be one of {', '.join(f'{m.letter} ({m.value})' for m in cls)}, got {text!r}")


_LETTERS = {ScaleMode.BLOCKING: "A", ScaleMode.PREPARE_ASYNC: "B", ScaleMode.PREPARE_ASYNC_REUSE_GRAPHS: "C"}


class Committed(msgspec.Struct, frozen=True):
    """The topology the ranks serve: what the last commit installed."""

    epoch: int
    active: list[int]
    placement: Placement | None


class ScaleRequest(msgspec.Struct, frozen=True):
    dp_size: int
    # The ranks to retire, chosen (a node being drained); dp_size is then the size without them.
    # Empty: a scale-down retires the highest ranks.
    remove: list[int] = []
    mode: ScaleMode = ScaleMode.PREPARE_ASYNC_REUSE_GRAPHS
    drain_timeout_s: float = 30.0
    fault: str = ""  # injected into joiners; only honoured with Router.allow_fault_injection
    resumes: str = ""  # the id of an operation a router that stopped left unfinished, asked for again


class PullLoss(msgspec.Struct):
    """Reads a pull lost with its source mid-pull, and where the operation read them from instead."""

    rank: int  # the puller
    source: int  # the source lost
    reason: str
    items: list[str]  # the destinations (tensor names on `rank`) it was to fill
    repulled_from: dict[int, list[str]] = {}  # rank -> those of `items` read from it; {} when the operation gave way


class JoinerRetry(msgspec.Struct):
    """A joiner that died before the commit, and the new one its scale-up started instead."""

    rank: int
    phase: str  # the phase it died in
    error: str
    attempt: int  # the attempt this one starts (2 for the first retry)


class OpRecord(msgspec.Struct):
    """What /topology shows about an operation."""

    id: str
    # "up" | "down" | "failover" | "rebuild" (every serving rank failed: a new group from scratch)
    kind: str
    mode: ScaleMode
    from_size: int
    to_size: int
    phase: str
    joiners: list[int]
    leaving: list[int]
    phases: dict[str, float]  # seconds spent per phase
    downtime_s: float | None = None  # the scale's pauses: first pause request to last resume reply, summed
    started_at: float = 0.0  # wall-clock time (unix) it was taken up
    committed_at: float | None = None  # wall-clock time (unix) of the last resume reply
    rebalance_downtime_s: float | None = None  # the short commits of the follow-up EPLB
    total_s: float | None = None
    experts_from_disk: int = 0  # expert slots its masking loaded from the checkpoint: no survivor held them
    # Puller -> source -> tensors asked for (what a lost source was to send also under the source
    # it was re-pulled from; `pull_losses` says which); a rank's own slots copied count as it.
    pulled_from: dict[int, dict[int, int]] = {}
    handed_over: int = 0
    pull_bytes: int = 0
    joined_from: dict[int, str] = {}  # joiner -> "parked" | "snapshot" (restored from its image) | "cold"
    snapshot_refused: dict[int, str] = {}  # new joiner -> why no snapshot was restored for it
    parked: list[int] = []  # leaving ranks kept for the next scale-up
    error: str = ""  # why it aborted or rolled back, or what failed after its commit
    followup_error: str = ""  # the commit held but its cleanup or rebalance failed
    # Serving ranks found dead that it masked out: as a failover, in a rollback, or (a scale-up
    # whose pull source failed) in a failover of its own, whose commit the next two time (a
    # failover's are downtime_s and committed_at; a rollback's pause is not timed).
    masked: list[int] = []
    failover_downtime_s: float | None = None
    failover_committed_at: float | None = None
    pull_losses: list[PullLoss] = []  # sources lost mid-pull: what they were to send, and from whom it came
    joiner_retries: list[JoinerRetry] = []  # joiners that died before the commit and were started anew
    resumes: str = ""  # the operation, interrupted with the router that ran it, whose target this one takes up


class RankView(RankSummary, kw_only=True):
    """A rank as /topology shows it: its own summary plus the router's view of it."""

    kv_usage: float  # KV cache in use, 0..1 (kv_used / kv_total)
    experts_layer0: list[int]  # the experts its slots hold in MoE layer 0

    @classmethod
    def of(cls, st: RankStatus, placement: Placement | None) -> RankView:
        own = {f: getattr(st, f) for f in RankSummary.__struct_fields__}
        experts = placement.experts_on(st.rank, 0) if placement else []
        return cls(
            **own,
            kv_usage=st.kv_used / st.kv_total if st.kv_total else 0.0,
            experts_layer0=[e for e in experts if e >= 0],
        )


class SnapshotState(enum.StrEnum):
    CHOOSING = "choosing"  # checking the store (checksums of every image: seconds for a CUDA one)
    CHOSEN = "chosen"  # new ranks are restored from `path`
    NONE = "none"  # new ranks start cold: `why`


class SnapshotChoice(msgspec.Struct, frozen=True):
    """What the capacity provider restores new ranks from, as it last chose: when the router
    starts (before any scale-up, so a user knows what joiners will get) and at each scale-up."""

    state: SnapshotState
    decided_by: str  # "startup", or the operation's id
    path: str = ""
    snapshot_id: str = ""
    why: str = ""  # NONE: every refused snapshot's reason, or what this machine lacks
    standby: int = 0  # copies of it restored ahead, waiting to be joiners (Router.standby_copies)


class Topology(msgspec.Struct):
    epoch: int
    dp_size: int
    max_ranks: int
    active: list[int]
    ranks: list[RankView]
    scaling: bool
    target: int | None  # the size queued behind the running operation, if any
    operation: OpRecord | None  # the running operation, or the last one
    snapshot: SnapshotChoice | None = None  # None: no Worker.snapshot_root (or a provider that restores none)
