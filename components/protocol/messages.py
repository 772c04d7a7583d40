"""Router -> worker control messages (msgspec, tagged union) and the worker's replies.

They travel as plain JSON-able dicts over a Dynamo endpoint (`<ns>.worker.control`), addressed
to one worker instance; `bytes` fields become base64 on the way, which msgspec restores.
"""

from __future__ import annotations

import msgspec

from components.protocol.lifecycle import RankState
from components.protocol.placement import Placement
from components.protocol.transfer import PullItem, PullStats, WeightManifest


class Command(msgspec.Struct, kw_only=True):
    """What the router asks of a rank. `op`: the id of the scale operation asking ("-" for none),
    which the rank's log lines about it carry."""

    op: str = "-"


class Describe(Command, tag="describe"):
    pass


class Connect(Command, tag="connect"):
    peers: dict[int, bytes]  # rank -> communicator metadata
    activate: bool = False


class Disconnect(Command, tag="disconnect"):
    ranks: list[int]


class Pause(Command, tag="pause"):
    """Stop at a step boundary. `gone`: peers found dead, whom a collective in flight stops waiting for."""

    gone: list[int] = []


class Configure(Command, tag="configure"):
    """Install an active set and expert placement; only valid while paused (or not active)."""

    epoch: int
    active: list[int]
    placement: Placement


class Resume(Command, tag="resume"):
    pass


class SetRoutable(Command, tag="set_routable"):
    routable: bool


class LoadExperts(Command, tag="load_experts"):
    """Fill this rank's slots from the checkpoint (a cold start of the first group)."""

    placement: Placement
    since: Placement | None = None  # load only the slots whose expert differs from this placement


class LoadWeights(Command, tag="load_weights"):
    """Load every weight from the checkpoint: the dense ones and this rank's slots as `placement`
    says. For the ranks of a deployment rebuilt from scratch (every serving rank failed: no peer
    holds weights to pull), whether cold-started, restored from a snapshot or parked."""

    placement: Placement


class ExportWeights(Command, tag="export_weights"):
    """Reply with a manifest (addresses + checksums) of these weights; all when `names` is None."""

    names: list[str] | None = None


class EndExport(Command, tag="end_export"):
    """The pulls from this rank are over: stop driving NIXL progress for readers."""


class PullWeights(Command, tag="pull_weights"):
    """Pull these items. A source lost on the way costs only its items: the reply lists them
    (PullStats.lost), and the router reads them from other holders next."""

    sources: dict[int, WeightManifest]
    items: list[PullItem]


class DropSources(Command, tag="drop_sources"):
    """These sources failed (the router found them dead or stalled): a pull reading from them
    gives up on them now, not at its timeout, and a later one does not start to."""

    agents: dict[str, str]  # source agent name (WeightManifest.agent) -> why


class Warmup(Command, tag="warmup"):
    """Run alone with remote peers masked under `placement`; `recapture` re-captures graphs
    (what a design without graph reuse must do)."""

    placement: Placement
    recapture: bool = False


class Drain(Command, tag="drain"):
    """Let this rank's requests finish for up to `timeout_s`, then hand the rest over: each goes on
    (prompt plus tokens so far, the latter replayed) on one of `targets`, the generate instances
    of the remaining ranks, its stream relayed through this rank."""

    timeout_s: float
    targets: list[int] = []


class Exit(Command, tag="exit"):
    pass


class Park(Command, tag="park"):
    """Leave the group but stay alive and registered, holding no weights: the next scale-up
    restores this process instead of starting one (the parked snapshot tier). `checkpoint`: its
    CUDA state is checkpointed next, so it drops its NIXL agents too (Restore brings new ones)."""

    checkpoint: bool = False


class Restore(Command, tag="restore"):
    """A parked rank comes back: map its weight memory again (contents come from peers next)."""


ControlRequest = (
    Describe
    | Connect
    | Disconnect
    | Pause
    | Configure
    | Resume
    | SetRoutable
    | LoadExperts
    | LoadWeights
    | ExportWeights
    | EndExport
    | PullWeights
    | DropSources
    | Warmup
    | Drain
    | Exit
    | Park
    | Restore
)


class RankSummary(msgspec.Struct, kw_only=True):
    """What a rank reports about itself that /topology shows (RankView adds the router's view)."""

    rank: int
    pid: int
    instance_id: int
    state: RankState
    routable: bool
    paused: bool
    epoch: int
    steps: int
    running: int
    waiting: int
    requests_total: int
    expert_rows: int  # (token, expert) pairs computed here, for any rank
    graph_captures: int = 0  # decode graph sets captured since start (retained ranks never recapture)
    replays_diverged: int = 0  # handed-over requests whose replay here did not reproduce their tokens
    # KV cache in use: the cache is allocated per sequence (a slot of max_len tokens, this engine's
    # block), so in use / total is slots held by running sequences / max_seqs.
    kv_used: int = 0
    kv_total: int = 0
    started_from: str = "cold"  # "snapshot" when restored from a baked snapshot's CRIU image


class RankStatus(RankSummary, kw_only=True):
    """A rank's reply to every control message: its summary plus what the router needs to act."""

    metadata: bytes  # the EP communicator's, for peers to connect
    model_identity: str
    num_experts: int
    num_moe_layers: int
    slots_per_rank: int
    active: list[int]
    connected: list[int]
    load: list[list[int]]  # tokens routed to each expert, per MoE layer, since the last rebalance
    ep_failed_peers: list[int] = []  # peers an EP collective failed on since the last Configure
    # What a restarted router rebuilds the topology from: the placement configured with `epoch`,
    # and whether a router started this process (a joiner) or `dynamo serve` did.
    placement: Placement | None = None
    joiner: bool = False


class ControlReply(msgspec.Struct):
    ok: bool
    error: str = ""
    status: RankStatus | None = None
    manifest: WeightManifest | None = None
    pull: PullStats | None = None
    seconds: float = 0.0  # how long the command's work took on the rank
    handed_over: int = 0  # requests a drain handed over


def encode(msg: msgspec.Struct) -> dict:
    return msgspec.to_builtins(msg)


def decode_request(raw: dict) -> ControlRequest:
    return msgspec.convert(raw, ControlRequest)


def decode_reply(raw: dict) -> ControlReply:
    return msgspec.convert(raw, ControlReply)
