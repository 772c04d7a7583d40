"""Scale operations without a deployment: the phase table, the scaler's queue, where the latest
requested size wins over every one still queued, and what an operation does when a source fails
mid-pull, against scripted ranks (whole operations run in test_elastic and test_failover)."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from components.control import scaler as scaler_module
from components.control.journal import OpJournal, Tally
from components.control.operation import _NEXT, FINAL, Operation, Phase, ScaleError, by_source
from components.control.scaler import Scaler
from components.protocol import messages as m
from components.protocol.config import RouterConfig
from components.protocol.lifecycle import RankState
from components.protocol.placement import Placement, balanced_placement, changed_slots, shrink
from components.protocol.topology import Committed, OpRecord, PullLoss, ScaleMode, ScaleRequest
from components.protocol.transfer import PullStats, SourceLoss, TensorDesc, WeightManifest, expert_slot_name


def reachable(start: Phase) -> set[Phase]:
    seen, todo = {start}, [start]
    while todo:
        for nxt in _NEXT.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_every_phase_can_finish_and_the_paths_are_the_documented_ones():
    assert all(Phase.DONE in reachable(p) for p in Phase if p not in FINAL)
    assert not any(_NEXT.get(p) for p in FINAL)
    # Scale-up prepares (mode A pausing first), then commits; scale-down drains and migrates first.
    up = [
        Phase.QUEUED,
        Phase.STARTING,
        Phase.LOADING,
        Phase.WARMING,
        Phase.CONNECTING,
        Phase.COMMITTING,
        Phase.REBALANCING,
        Phase.MIGRATING,
        Phase.COMMITTING,
        Phase.DONE,
    ]
    down = [
        Phase.QUEUED,
        Phase.DRAINING,
        Phase.MIGRATING,
        Phase.COMMITTING,
        Phase.CLEANUP,
        Phase.REBALANCING,
        Phase.DONE,
    ]
    # Every serving rank failed: fenced, then a new group formed from the checkpoint.
    rebuild = [Phase.QUEUED, Phase.MASKING, Phase.STARTING, Phase.LOADING, Phase.CONNECTING, Phase.COMMITTING]
    # A scale-up whose joiner died starts a new one, from whichever phase of its preparation.
    retries = [[p, Phase.STARTING] for p in (Phase.STARTING, Phase.LOADING, Phase.WARMING, Phase.CONNECTING)]
    for path in (up, down, rebuild, *retries, [Phase.QUEUED, Phase.PAUSING, Phase.STARTING]):
        assert all(b in _NEXT[a] for a, b in zip(path, path[1:])), path


def operation(dp_size: int = 3) -> Operation:
    return Operation(
        ScaleRequest(dp_size=dp_size),
        Committed(epoch=1, active=[0, 1], placement=None),
        [],
        port=None,
        provider=None,
        cfg=RouterConfig(),
        max_ranks=4,
        num_experts=8,
    )


def test_an_illegal_phase_change_is_refused_with_the_operation_id():
    op = operation()
    assert (op.joiners, op.leaving, op.record.kind) == ([2], [], "up")
    op.transition(Phase.STARTING)
    with pytest.raises(RuntimeError, match=rf"^\[op {op.id}\] illegal phase change starting -> committing$"):
        op.transition(Phase.COMMITTING)
    op.transition(Phase.ABORTED, "a final phase is reachable from anywhere")
    assert op.record.phase == "aborted" and op.record.total_s is not None and "starting" in op.record.phases


class Owner:
    """The router's side of the scaler: the committed topology and where results go."""

    def __init__(self):
        self.committed = Committed(epoch=1, active=[0, 1], placement=None)
        self.num_experts = 8
        self.ended: list[OpRecord] = []

    def expert_load(self):
        return []

    def operation_ended(self, record, topology):
        self.ended.append(record)
        self.committed = topology


def test_the_latest_target_wins(monkeypatch):
    started: list[int] = []

    class Op:  # an operation that runs until the test lets it finish
        gate = asyncio.Event()
        preempted, gave_way_to = False, []  # no serving rank fails here

        def __init__(self, req, topology, *rest, **kw):
            self.req, self.topology = req, topology
            self.record = OpRecord(
                id=f"to-{req.dp_size}",
                kind="up",
                mode=req.mode,
                from_size=len(topology.active),
                to_size=req.dp_size,
                phase="queued",
                joiners=[],
                leaving=[],
                phases={},
            )

        async def execute(self, load_now):
            started.append(self.req.dp_size)
            await self.gate.wait()
            self.record.phase = "done"
            return Committed(epoch=self.topology.epoch + 1, active=list(range(self.req.dp_size)), placement=None)

    monkeypatch.setattr(scaler_module, "Operation", Op)

    async def run():
        owner, ready = Owner(), asyncio.Event()
        scaler = Scaler(owner, None, None, RouterConfig(), max_ranks=8)
        task = asyncio.create_task(scaler.run(ready))
        ready.set()
        scaler.request(ScaleRequest(dp_size=3))
        while not started:
            await asyncio.sleep(0)
        for n in (4, 2, 6, 5):  # queued behind the running one: each replaces the last
            scaler.request(ScaleRequest(dp_size=n, mode=ScaleMode.BLOCKING))
        assert scaler.busy and scaler.pending.dp_size == 5
        Op.gate.set()
        last = await scaler.wait_idle()
        task.cancel()
        return owner, last

    owner, last = asyncio.run(run())
    assert started == [3, 5]
    assert [r.id for r in owner.ended] == ["to-3", "to-5"] and last.id == "to-5"
    assert owner.committed.active == [0, 1, 2, 3, 4] and owner.committed.epoch == 3


def rec(n: int, phase: str, kind: str = "up", followup_error: str = "", masked=()) -> OpRecord:
    return OpRecord(
        id=f"op-{n}-{kind}-2to3",
        kind=kind,
        mode=ScaleMode.PREPARE_ASYNC_REUSE_GRAPHS,
        from_size=2,
        to_size=3,
        phase=phase,
        joiners=[2],
        leaving=[],
        phases={},
        started_at=float(n),
        followup_error=followup_error,
        masked=list(masked),
    )


def test_the_journal_gives_a_restarted_router_its_history_and_counters(tmp_path, monkeypatch):
    """The last line of each id wins, a line torn by the kill is skipped, the file keeps only the
    recent history and a tally of the rest; what was in flight is interrupted, with the adoption's
    outcome, and the next ids follow on. The counters go on from the last router's, the ranks
    masked out included."""
    path = tmp_path / "router" / "operations.jsonl"
    path.parent.mkdir()
    journal = OpJournal(path)
    for n in range(1, 26):
        journal.save(rec(n, "starting"))
        failed = "rebalance failed" if n == 3 else ""
        journal.save(rec(n, "done" if n < 25 else "loading", followup_error=failed, masked=[1] if n in (4, 9) else []))
    with path.open("ab") as f:
        f.write(b'{"id": "op-26-up')  # the kill came mid-write
    monkeypatch.setattr(Operation, "_ids", Operation._ids)  # restored after the test
    scaler = Scaler(Owner(), None, None, RouterConfig(), max_ranks=8, journal=OpJournal(path))
    assert [r.id for r in scaler.history] == [f"op-{n}-up-2to3" for n in range(6, 26)]
    assert [r.phase for r in scaler.history] == ["done"] * 19 + ["loading"]
    assert scaler.tally == Tally(outcomes={"up": {"done": 24}}, followup_failures=1, masked_ranks=2)
    scaler.settle("adopted epoch 4: ranks [0, 1] active, none parked, [2] stopped")
    cut = scaler.history[-1]
    assert cut.phase == "interrupted" and cut.error == (
        "the router running it stopped in loading; the next one adopted epoch 4: ranks [0, 1] active, "
        "none parked, [2] stopped"
    )
    assert scaler.tally == Tally(outcomes={"up": {"done": 24, "interrupted": 1}}, followup_failures=1, masked_ranks=2)
    lines = path.read_text().splitlines()
    # The 5 operations dropped (one with a failed follow-up, one that masked a rank out) are tallied
    # on the first line.
    assert len(lines) == 22 and lines[0] == '{"outcomes":{"up":{"done":5}},"followup_failures":1,"masked_ranks":1}'
    records, tally = OpJournal(path).load()
    assert records[-1] == cut and tally == scaler.tally
    assert next(Operation._ids) == 26


def queued_in(path) -> ScaleRequest | None:
    """The request a router loading the journal at `path` finds queued."""
    journal = OpJournal(path)
    journal.load()
    return journal.queued.queued if journal.queued else None


@pytest.mark.parametrize(
    "cut, queued, adopted, asked",
    [
        (rec(7, "loading"), None, 2, ScaleRequest(dp_size=3, resumes="op-7-up-2to3")),
        (rec(7, "committing"), None, 3, None),  # the next router completed its commit
        (msgspec.structs.replace(rec(7, "loading"), resumes="op-6-up-2to3"), None, 2, None),  # cut twice
        (
            msgspec.structs.replace(rec(7, "draining", kind="down"), from_size=3, to_size=2, leaving=[1]),
            None,
            3,
            ScaleRequest(dp_size=2, remove=[1], resumes="op-7-down-2to3"),
        ),
        # Queued behind the operation cut: the latest target wins (its injected fault was the first try's).
        (rec(7, "loading"), ScaleRequest(dp_size=5, fault="exit_on=warmup"), 2, ScaleRequest(dp_size=5)),
        (rec(7, "loading"), ScaleRequest(dp_size=2), 2, None),  # back to the size it had: nothing to do
        (rec(7, "done"), ScaleRequest(dp_size=4), 3, ScaleRequest(dp_size=4)),
    ],
)
def test_a_restarted_router_asks_again_for_what_its_predecessor_was_asked(
    tmp_path, monkeypatch, cut, queued, adopted, asked
):
    """An accepted scale is not lost with the router running it: the one that adopts the group
    runs the request its predecessor had queued, else the operation it cut short again toward the
    same target (a removal: the same ranks), unless the adopted group is at that size already, or
    the operation was itself such a second try (it may be what stops the router)."""
    path = tmp_path / "operations.jsonl"
    journal = OpJournal(path)
    journal.save(rec(6, "done"))
    journal.save(cut)
    if queued is not None:
        journal.queue(queued, at=cut.started_at + 0.5)
    monkeypatch.setattr(Operation, "_ids", Operation._ids)
    scaler = Scaler(Owner(), None, None, RouterConfig(), max_ranks=8, journal=OpJournal(path))
    scaler.settle("adopted epoch 5", size=adopted)
    assert scaler.history[-1].phase == ("done" if cut.phase == "done" else "interrupted")
    assert scaler.pending == asked
    assert scaler.busy == (asked is not None)
    # What it asks for is journaled in turn, until an operation takes it up.
    assert queued_in(path) == asked


def test_a_queued_request_is_journaled_until_an_operation_takes_it_up(tmp_path):
    """Across compactions too; a group formed from scratch drops it."""
    path = tmp_path / "operations.jsonl"
    journal = OpJournal(path, compact_after=3)
    journal.load()
    journal.save(rec(1, "starting"))
    journal.queue(ScaleRequest(dp_size=4), at=1.5)
    for phase in ("loading", "warming", "done"):  # the third line compacts the file
        journal.save(rec(1, phase))
    assert queued_in(path) == ScaleRequest(dp_size=4)
    journal.save(rec(2, "starting"))  # started after it was queued: it took it up
    assert queued_in(path) is None
    journal.queue(ScaleRequest(dp_size=1), at=3.0)
    scaler = Scaler(Owner(), None, None, RouterConfig(), max_ranks=8, journal=OpJournal(path))
    scaler.settle("found no rank serving and formed epoch 1 of ranks [0, 1]")
    assert scaler.pending is None
    assert queued_in(path) is None


def test_the_journal_is_compacted_while_the_router_runs(tmp_path):
    """It gains a line per phase change; past `compact_after` lines it is rewritten with the recent
    history alone, and loads as if it had never been compacted."""

    def run(path, compact_after: int) -> list[int]:
        journal, sizes = OpJournal(path, compact_after), []
        journal.load()
        for n in range(1, 41):
            for phase in ("starting", "loading", "committing", "done" if n % 4 else "aborted"):
                journal.save(rec(n, phase, kind="up" if n % 3 else "down"))
                sizes.append(len(path.read_text().splitlines()))
        return sizes

    compacted, plain = tmp_path / "compacted.jsonl", tmp_path / "plain.jsonl"
    sizes = run(compacted, compact_after=30)
    assert max(sizes) == 30 and sizes[-1] < 30
    assert max(run(plain, compact_after=10_000)) == 160
    assert OpJournal(compacted).load() == OpJournal(plain).load()
    records, tally = OpJournal(compacted).load()
    assert [r.id for r in records] == [rec(n, "done", kind="up" if n % 3 else "down").id for n in range(21, 41)]
    assert tally == Tally(outcomes={"up": {"done": 20, "aborted": 7}, "down": {"done": 10, "aborted": 3}})


# ---- failures against scripted ranks: a source lost mid-pull, a rollback without a dead rank ----

DENSE = ["embed", "attn", "norm"]
S = 2  # slots per rank: 4 experts over ranks 0-2 are 0 3 | 1 0 | 2 1 (expert 2 only on rank 2)


class Ranks:
    """The router (RankPort) and the capacity provider for one operation, over scripted ranks:
    every command succeeds at once and is recorded; `pull` answers PullWeights; `dead`: serving
    ranks the router found dead."""

    def __init__(self, ranks=(0, 1, 2), pull=None, dead=()):
        self.statuses = {r: self.describe(r) for r in ranks}
        self.failing: set[int] = set(dead)
        self.sent: list[tuple[int, object]] = []
        self.fenced: list[tuple[int, int]] = []  # (rank, pid)
        self.unlisted: list[int] = []
        self.refused: dict[int, str] = {}
        self.checkpoints_parked = False
        self.pull = pull
        self.silent: dict[int, float] = {}  # rank -> seconds without an answer

    @staticmethod
    def describe(r: int) -> m.RankStatus:
        return m.RankStatus(
            rank=r,
            pid=100 + r,
            instance_id=r,
            state=RankState.ACTIVE,
            routable=True,
            paused=False,
            epoch=1,
            steps=0,
            running=0,
            waiting=0,
            requests_total=0,
            expert_rows=0,
            metadata=b"",
            model_identity="m",
            num_experts=4,
            num_moe_layers=1,
            slots_per_rank=S,
            active=[],
            connected=[],
            load=[],
        )

    def manifest(self, r: int, names: list[str] | None) -> WeightManifest:
        if names is None:
            names = DENSE + [expert_slot_name(0, s, p) for s in range(S) for p in ("gate", "up", "down")]
        return WeightManifest(r, f"agent-{r}", b"", "DRAM", 0, [TensorDesc(n, 0, 8, "float32", [2], 0) for n in names])

    async def send(self, rank: int, msg) -> m.ControlReply:
        self.sent.append((rank, msg))
        if isinstance(msg, m.ExportWeights):
            return m.ControlReply(ok=True, manifest=self.manifest(rank, msg.names))
        if isinstance(msg, m.PullWeights):
            return await self.pull(self, rank, msg)
        return m.ControlReply(ok=True)

    def messages(self, kind: type = object, rank: int | None = None) -> list:
        return [msg for r, msg in self.sent if isinstance(msg, kind) and rank in (None, r)]

    async def discover(self, ranks, provider, timeout) -> None:
        for r in ranks:
            self.statuses.setdefault(r, self.describe(r))

    def unlist(self, rank: int, op: str) -> None:
        self.unlisted.append(rank)

    def forget(self, rank: int) -> None:
        self.statuses.pop(rank, None)

    def status(self, rank: int) -> m.RankStatus:
        return self.statuses[rank]

    def failed(self, rank: int) -> bool:
        return rank in self.failing

    def silent_s(self, rank: int) -> float:
        return self.silent.get(rank, 0.0)

    async def acquire(self, ranks, op, fault=""):
        return {r: "cold" for r in ranks}

    def alive(self, rank: int):
        return None

    async def fence(self, rank: int, pid: int, op: str) -> None:
        self.fenced.append((rank, pid))

    async def release(self, rank: int, op: str, graceful: bool = True) -> None:
        pass

    def settled(self, op: str) -> None:
        pass


async def dies_mid_pull(ranks: Ranks, rank: int, msg: m.PullWeights) -> m.ControlReply:
    """The first pull: rank 2 dies as it starts; its reads end once the puller is told (as a
    stalled source's would), the rest is pulled. Later pulls bring everything."""
    lost = [it for it in msg.items if it.src_rank == 2]
    if lost:
        ranks.failing.add(2)  # the router's verdict
        while not any("agent-2" in d.agents for d in ranks.messages(m.DropSources, rank)):
            await asyncio.sleep(0.01)
    done = len(msg.items) - len(lost)
    gone = [SourceLoss(2, "rank 2: dropped mid-pull: rank 2 failed", lost)] if lost else []
    return m.ControlReply(ok=True, pull=PullStats(tensors=done, bytes=8 * done, seconds=0.1, per_source={}, lost=gone))


def run(kind: str, pull) -> tuple[Operation, Ranks]:
    ranks = Ranks(pull=pull)
    current = balanced_placement(1, 4, 4, S, [0, 1, 2])
    op = Operation(
        ScaleRequest(dp_size=4 if kind == "up" else 2),
        Committed(epoch=1, active=[0, 1, 2], placement=current),
        [],
        ranks,
        ranks,
        RouterConfig(rebalance=False),
        max_ranks=4,
        num_experts=4,
    )
    asyncio.run(op.execute(lambda: []))
    return op, ranks


def test_a_scale_up_masks_a_source_that_failed_mid_pull_out_and_repulls_its_reads():
    """Joiner 3 reads the dense weights spread over ranks 0-2 and expert 2 (held by one rank, so
    the joiner's first) from rank 2, which dies mid-pull: the joiner is told to drop it, the
    scale-up masks rank 2 out itself (expert 2, which only rank 2 held, reloaded into rank 1's
    duplicate slot; the joiner, still loading, takes no part), re-pulls exactly what rank 2 was to
    send from ranks 0 and 1, and commits ranks 0, 1 and 3."""
    op, ranks = run("up", dies_mid_pull)
    assert (op.record.phase, op.record.error, op.record.masked) == ("done", "", [2]), op.record
    assert ranks.fenced == [(2, 102)] and ranks.unlisted == [2] and op.topology.active == [0, 1, 3]
    first, again = ranks.messages(m.PullWeights, 3)
    lost = [it.dst_name for it in first.items if it.src_rank == 2]
    assert sorted(lost) == ["experts.0.0.down", "experts.0.0.gate", "experts.0.0.up", "norm"]
    assert [it.dst_name for it in again.items] == lost and {it.src_rank for it in again.items} <= {0, 1}
    # Expert 2 from the copy rank 1 loaded from the checkpoint (slot 3, its local slot 1).
    assert {it.src_name for it in again.items if it.src_name.startswith("experts.")} == {
        expert_slot_name(0, 1, p) for p in ("gate", "up", "down")
    }
    assert set(again.sources) == {it.src_rank for it in again.items}
    assert op.record.pull_losses == [
        PullLoss(3, 2, "rank 2: dropped mid-pull: rank 2 failed", lost, by_source(again.items))
    ]
    assert [d.agents for d in ranks.messages(m.DropSources)] == [
        {"agent-2": "rank 2 failed (found dead or stalled by the router)"}
    ]
    # The failover inside: survivors only, expert 2 reloaded, then the commit of the three.
    assert ranks.messages(m.Pause, 0)[0].gone == [2]
    assert [x.placement.experts_on(1, 0) for x in ranks.messages(m.LoadExperts, 1)] == [[1, 2]]
    assert [c.active for c in ranks.messages(m.Configure, 0)] == [[0, 1], [0, 1, 3]]
    assert [c.active for c in ranks.messages(m.Configure, 3)] == [[0, 1, 3]]
    # The joiner serves the experts it pulled (2 and 3, then on one rank each), not the ones grow
    # would now give it (0 and 1: after the masking every expert is on one rank).
    assert [c.placement.experts_on(3, 0) for c in ranks.messages(m.Configure, 3)] == [[2, 3]]
    assert op.record.failover_downtime_s is not None and op.record.failover_committed_at is not None
    assert list(op.record.phases) == ["starting", "loading", "masking", "warming", "connecting", "committing"]


def test_a_scale_down_tells_the_pullers_first_then_gives_way():
    """Rank 1 pulls expert 2 from leaving rank 2, which fails mid-pull: rank 1 is told to drop it
    (its pull ends now, not at its timeout), the record says which reads were cut, and the
    operation gives way to the failover."""
    op, ranks = run("down", dies_mid_pull)
    assert op.record.phase == "aborted" and op.preempted, op.record
    assert op.record.error == "ScaleError: serving rank 2 failed during migrating: the failover goes first"
    cut = [expert_slot_name(0, 1, p) for p in ("gate", "up", "down")]
    assert op.record.pull_losses == [
        PullLoss(1, 2, "rank 2 failed: its readers dropped it, and the operation gave way", cut)
    ]
    assert [(r, d.agents) for r, d in ranks.sent if isinstance(d, m.DropSources)] == [
        (1, {"agent-2": "rank 2 failed (found dead or stalled by the router)"})
    ]


def test_a_lost_source_without_another_holder_fails_the_operation_naming_both():
    """Rank 2 fails its READs but the router never fails it (alive): what it held alone has no
    other live holder, and the scale-up aborts naming the items and the source."""

    async def errs(ranks: Ranks, rank: int, msg: m.PullWeights) -> m.ControlReply:
        lost = [it for it in msg.items if it.src_rank == 2]
        gone = [SourceLoss(2, "rank 2: READ of norm failed (source gone?)", lost)] if lost else []
        return m.ControlReply(ok=True, pull=PullStats(tensors=0, bytes=0, seconds=0.1, per_source={}, lost=gone))

    ranks = Ranks(pull=errs)
    current = balanced_placement(1, 4, 4, S, [0, 1, 2])
    # Expert 2 only on rank 2, and the joiner's first slot (its experts.0.0.*) wants it.
    target = Placement(S, [current.slots[0][:6] + [2, 1]])
    op = Operation(
        ScaleRequest(dp_size=4),
        Committed(epoch=1, active=[0, 1, 2], placement=current),
        [],
        ranks,
        ranks,
        RouterConfig(rebalance=False, rank_timeout_s=0.1, status_interval_s=0.05),
        max_ranks=4,
        num_experts=4,
    )

    async def loading():
        op.transition(Phase.STARTING)
        op.transition(Phase.LOADING)
        await ranks.discover([3], None, 0)
        await op.pull_experts(current, target, [0, 1, 2], dense_to=[3])

    with pytest.raises(ScaleError) as ei:
        asyncio.run(loading())
    assert str(ei.value) == (
        "rank 3 lost source rank 2 mid-pull (rank 2: READ of norm failed (source gone?)) and no live rank holds "
        "experts.0.0.gate, experts.0.0.up, experts.0.0.down (of ranks [0, 1])"
    ), ei.value


class FenceFails(Ranks):
    async def fence(self, rank: int, pid: int, op: str) -> None:
        await super().fence(rank, pid, op)
        raise PermissionError(f"[Errno 1] Operation not permitted: kill({pid})")


def rolled_back(dead, ranks_cls=Ranks):
    """A scale-up 3 -> 4 whose commit of epoch 6 failed, rolled back at epoch 7 with `dead` found
    dead: the rollback's messages to each rank, the operation, and the placement before."""
    placement = balanced_placement(2, 8, 4, 4, [0, 1, 2])
    ranks = ranks_cls([0, 1, 2, 3], dead=dead)
    op = Operation(
        ScaleRequest(dp_size=4), Committed(epoch=5, active=[0, 1, 2], placement=placement), [], ranks, ranks,
        RouterConfig(), max_ranks=4, num_experts=8,
    )  # fmt: skip
    asyncio.run(op.rollback([0, 1, 2, 3], 7, "commit of epoch 6 failed"))
    return ranks, op, placement


@pytest.mark.parametrize("ranks_cls", [Ranks, FenceFails], ids=["fenced", "fencing fails"])
def test_a_rollback_masks_out_a_serving_rank_found_dead_as_a_failover_would(ranks_cls, caplog):
    """Never an epoch with a dead rank active: rank 1 is fenced, the survivors stop waiting for it,
    reload the experts it alone held, and go back to the old set without it. A fence that fails
    does not stop the rollback half-way (survivors left paused): it goes on and says so."""
    ranks, op, before = rolled_back(dead=[1], ranks_cls=ranks_cls)
    fence_errors = [r.getMessage() for r in caplog.records if "fencing rank" in r.getMessage()]
    if ranks_cls is FenceFails:
        assert fence_errors == [
            f"[op {op.id}] fencing rank 1 failed, it may still run: [Errno 1] Operation not permitted: kill(101)"
        ]
    else:
        assert fence_errors == []
    target = shrink(before, [1], 8)
    assert op.topology == Committed(epoch=7, active=[0, 2], placement=target) and op.record.masked == [1]
    assert ranks.fenced == [(1, 101)] and 1 not in ranks.statuses and ranks.messages(rank=1) == []
    assert ranks.unlisted == [1]  # out of discovery, even where it may still run
    reload = {slot // 4 for _, slot in changed_slots(before, target)}
    assert reload and reload <= {0, 2}
    for r in (0, 2):
        expected = [
            m.Pause(gone=[1], op=op.id),
            *([m.LoadExperts(placement=target, since=before, op=op.id)] if r in reload else []),
            m.Configure(epoch=7, active=[0, 2], placement=target, op=op.id),
            m.Resume(op=op.id),
            m.Disconnect(ranks=[1], op=op.id),
        ]
        assert ranks.messages(rank=r) == expected, r
    # The joiner is configured out.
    assert ranks.messages(rank=3) == [
        m.Pause(gone=[1], op=op.id),
        m.Configure(epoch=7, active=[], placement=target, op=op.id),
        m.Resume(op=op.id),
    ]


def test_a_rollback_with_every_rank_alive_goes_back_to_the_old_set():
    ranks, op, before = rolled_back(dead=[])
    assert op.topology == Committed(epoch=7, active=[0, 1, 2], placement=before) and op.record.masked == []
    assert ranks.fenced == []
    for r in (0, 1, 2, 3):
        active = [0, 1, 2] if r < 3 else []
        assert ranks.messages(rank=r) == [
            m.Pause(op=op.id),
            m.Configure(epoch=7, active=active, placement=before, op=op.id),
            m.Resume(op=op.id),
        ], r


class DiesInCommit(Ranks):
    """Rank 1's process dies while joiner 3 holds its Resume back; only the capacity provider
    knows it yet (the router has not looked since)."""

    died = False

    async def send(self, rank: int, msg) -> m.ControlReply:
        if isinstance(msg, m.Resume) and rank == 3 and not self.died:
            self.died = True
            await asyncio.Event().wait()  # until the operation stops waiting
        return await super().send(rank, msg)

    def alive(self, rank: int):
        return False if rank == 1 and self.died else None


def test_a_serving_rank_its_provider_finds_dead_in_a_commit_is_rolled_out_and_the_target_kept():
    """However the death is found first (the provider's process watch or the router's status
    round), the commit gives way to it: its rollback masks rank 1 out, the error says so, and the
    scaler learns that rank 1 failed and that the target still stands."""
    before = balanced_placement(2, 8, 4, 4, [0, 1, 2])
    target = balanced_placement(2, 8, 4, 4, [0, 1, 2, 3])
    ranks = DiesInCommit([0, 1, 2, 3])
    op = Operation(
        ScaleRequest(dp_size=4), Committed(epoch=5, active=[0, 1, 2], placement=before), [], ranks, ranks,
        RouterConfig(), max_ranks=4, num_experts=8,
    )  # fmt: skip
    op.phase = Phase.COMMITTING
    with pytest.raises(ScaleError) as ei:
        asyncio.run(op.commit([0, 1, 2, 3], target, involved=[0, 1, 2, 3]))
    assert str(ei.value) == "serving rank 1 failed during committing: rolled back without it at epoch 7"
    assert op.preempted and op.gave_way_to == [1] and op.record.masked == [1]
    assert op.topology == Committed(epoch=7, active=[0, 2], placement=shrink(before, [1], 8))
    assert ranks.fenced == [(1, 101)]


def test_an_operation_that_gave_way_is_followed_by_the_failover_then_its_target(monkeypatch):
    """A scale-up cut short by rank 1, found dead by its provider before the router looked: the
    failover of rank 1 runs next (the router would otherwise find it a status round later, after
    a retry that fails on it again), then the scale-up again."""
    started: list[tuple[list[int], int, bool]] = []

    class Op:
        def __init__(self, req, topology, load, port, provider, cfg, max_ranks, num_experts, failed=(), **kw):
            self.req, self.topology, self.failed = req, topology, list(failed)
            self.preempted, self.gave_way_to = False, []
            kind = "failover" if failed else "up"
            self.id = f"{kind}-{req.dp_size}"
            self.record = OpRecord(
                id=self.id, kind=kind, mode=req.mode, from_size=len(topology.active),
                to_size=req.dp_size, phase="queued", joiners=[], leaving=list(failed), phases={},
            )  # fmt: skip

        async def execute(self, load_now):
            started.append((self.topology.active, self.req.dp_size, bool(self.failed)))
            if len(started) == 1:
                self.preempted, self.gave_way_to, self.record.phase = True, [1], "aborted"
                return self.topology
            if self.failed:
                self.record.phase, self.record.masked = "done", self.failed
                return Committed(epoch=2, active=[0, 2], placement=None)
            self.record.phase = "done"
            return Committed(epoch=3, active=list(range(self.req.dp_size)), placement=None)

    monkeypatch.setattr(scaler_module, "Operation", Op)

    async def run():
        owner, ready = Owner(), asyncio.Event()
        owner.committed = Committed(epoch=1, active=[0, 1, 2], placement=None)
        scaler = Scaler(owner, None, None, RouterConfig(), max_ranks=4)
        task = asyncio.create_task(scaler.run(ready))
        ready.set()
        scaler.request(ScaleRequest(dp_size=4))
        await scaler.wait_idle()
        task.cancel()
        return owner, scaler

    owner, scaler = asyncio.run(run())
    assert started == [([0, 1, 2], 4, False), ([0, 1, 2], 2, True), ([0, 2], 4, False)]
    assert owner.committed.active == [0, 1, 2, 3] and not scaler.failing


@pytest.mark.parametrize(
    "end, then",
    [
        # Rolled back without rank 1: the size before, as after a failover.
        ("rolled_back", ([0, 2], 3)),
        # Done less rank 1 (a source lost mid-pull, masked out in a failover of its own): the target again.
        ("done", ([0, 2, 3], 4)),
    ],
)
def test_ranks_an_operation_masked_out_are_replaced(monkeypatch, end, then):
    """A scale-up 3 -> 4 that masked out rank 1, which the router found dead meanwhile, leaves the
    deployment a rank short: the scaler replaces it (no failover runs for it), and counts it."""
    started: list[tuple[list[int], int]] = []
    scalers: list[Scaler] = []

    class Op:
        preempted, gave_way_to = False, []

        def __init__(self, req, topology, *rest, **kw):
            self.req, self.topology, self.id = req, topology, f"to-{req.dp_size}"
            self.record = OpRecord(
                id=self.id, kind="up", mode=req.mode, from_size=len(topology.active),
                to_size=req.dp_size, phase="queued", joiners=[], leaving=[], phases={},
            )  # fmt: skip

        async def execute(self, load_now):
            started.append((self.topology.active, self.req.dp_size))
            if len(started) == 1:  # rank 1 died in the commit, or as a source mid-pull
                scalers[0].fail([1])
                self.record.phase, self.record.masked = end, [1]
                return Committed(epoch=2, active=then[0], placement=None)
            self.record.phase = "done"
            return Committed(epoch=3, active=sorted([*self.topology.active, 1]), placement=None)

    monkeypatch.setattr(scaler_module, "Operation", Op)

    async def run():
        owner, ready = Owner(), asyncio.Event()
        owner.committed = Committed(epoch=1, active=[0, 1, 2], placement=None)
        scalers.append(Scaler(owner, None, None, RouterConfig(), max_ranks=4))
        task = asyncio.create_task(scalers[0].run(ready))
        ready.set()
        scalers[0].request(ScaleRequest(dp_size=4))
        last = await scalers[0].wait_idle()
        task.cancel()
        return owner, last

    owner, last = asyncio.run(run())
    assert started == [([0, 1, 2], 4), then]
    assert owner.committed.active == sorted([*then[0], 1]) and last.phase == "done"
    outcomes = {"done": 2} if end == "done" else {end: 1, "done": 1}
    assert scalers[0].tally == Tally(outcomes={"up": outcomes}, masked_ranks=1) and not scalers[0].failing


def test_every_serving_rank_failed_is_a_rebuild_from_the_checkpoint():
    """Ranks 0 and 1, the whole active set, failed: nothing to fail over to. The operation fences
    both, starts two ranks (a parked one first, here rank 3), which load every weight from the
    checkpoint, connect each other and are committed under the next epoch, then made routable.
    None is told that the dead ranks are gone: rank 0's number is a new rank's."""

    class WithParked(Ranks):
        async def acquire(self, ranks, op, fault=""):
            return {r: "parked" if r == 3 else "cold" for r in ranks}

    ranks = WithParked([0, 1, 3])
    ranks.statuses[3] = msgspec.structs.replace(ranks.statuses[3], state=RankState.PARKED)
    before = balanced_placement(1, 4, 4, S, [0, 1])
    op = Operation(
        ScaleRequest(dp_size=2), Committed(epoch=3, active=[0, 1], placement=before), [], ranks, ranks,
        RouterConfig(), max_ranks=4, num_experts=4, failed=[0, 1],
    )  # fmt: skip
    assert (op.record.kind, op.joiners, op.topology.active, op.id.split("-", 2)[2]) == (
        "rebuild",
        [0, 3],
        [],
        "rebuild-2to2",
    )
    asyncio.run(op.execute(lambda: []))
    assert (op.record.phase, op.record.error, op.record.masked) == ("done", "", [0, 1]), op.record
    assert ranks.fenced == [(0, 100), (1, 101)]
    assert list(op.record.phases) == ["masking", "starting", "loading", "connecting", "committing"]
    placement = balanced_placement(1, 4, 4, S, [0, 3])
    loads = [(r, x.placement) for r, x in ranks.sent if isinstance(x, m.LoadWeights)]
    assert loads == [(0, placement), (3, placement)]
    assert [(r, sorted(c.peers)) for r, c in ranks.sent if isinstance(c, m.Connect)] == [(0, [3]), (3, [0])]
    assert [(r, c.epoch, c.active) for r, c in ranks.sent if isinstance(c, m.Configure)] == [
        (0, 4, [0, 3]),
        (3, 4, [0, 3]),
    ]
    assert all(p.gone == [] for p in ranks.messages(m.Pause))
    assert [r for r, x in ranks.sent if isinstance(x, m.Restore)] == [3]  # the parked one came back
    assert [r for r, x in ranks.sent if isinstance(x, m.SetRoutable) and x.routable] == [0, 3]
    assert op.topology == Committed(epoch=4, active=[0, 3], placement=placement)


def test_a_deployment_that_cannot_be_rebuilt_backs_off_and_never_spins(monkeypatch, caplog):
    """Both serving ranks failed and every rebuild fails (no process can be started): the
    attempts are spaced 1, 2, 4, ... s apart up to Router.retry_backoff_max_s, each logged, and
    a request for another size is taken as the size to rebuild at."""

    class NoProcesses(Ranks):
        async def acquire(self, ranks, op, fault=""):
            raise RuntimeError("no process can be started")

    waits: list[float] = []
    ranks = NoProcesses([0, 1])

    async def sleep(s):
        waits.append(s)
        if len(waits) == 3:
            scaler.request(ScaleRequest(dp_size=3))
        if len(waits) == 6:
            raise asyncio.CancelledError

    monkeypatch.setattr(scaler_module.asyncio, "sleep", sleep)
    owner = Owner()
    owner.committed = Committed(epoch=1, active=[0, 1], placement=balanced_placement(1, 4, 4, S, [0, 1]))
    scaler = Scaler(owner, ranks, ranks, RouterConfig(retry_backoff_max_s=5), max_ranks=4)
    scaler.fail([0, 1])
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(scaler._work())
    assert waits == [1, 2, 4, 5, 5, 5]
    assert [(r.kind, r.to_size, r.phase) for r in scaler.history] == [("rebuild", 2, "aborted")] * 3 + [
        ("rebuild", 3, "aborted")
    ] * 3
    assert scaler.history[0].masked == [0, 1] and scaler.history[1].masked == []
    assert ranks.fenced == [(0, 100), (1, 101)]  # once
    assert "the next attempt in 4.0 s" in caplog.text and scaler.lost and scaler.busy


THREE = balanced_placement(1, 4, 4, S, [0, 1, 2])


async def pulls_all(ranks: Ranks, rank: int, msg: m.PullWeights) -> m.ControlReply:
    n = len(msg.items)
    return m.ControlReply(ok=True, pull=PullStats(tensors=n, bytes=8 * n, seconds=0.1, per_source={}, lost=[]))


class JoinerDiesOnce(Ranks):
    """Joiner 3's first process exits on its first PullWeights; the one started after it is fine."""

    def __init__(self):
        super().__init__(pull=pulls_all)
        self.started = 0
        self.dead = False

    async def acquire(self, ranks, op, fault=""):
        self.started += 1
        self.dead = False
        return {r: "cold" for r in ranks}

    async def send(self, rank, msg):
        if isinstance(msg, m.PullWeights) and rank == 3 and self.started == 1:
            self.dead = True
            await asyncio.Event().wait()  # its stream never answers: the process is gone
        return await super().send(rank, msg)

    def alive(self, rank):
        return False if rank == 3 and self.dead else None


class JoinerStallsOnce(JoinerDiesOnce):
    """Joiner 3's first process stops answering anything on its first PullWeights (SIGSTOP: the
    provider still sees it alive); the one started after it is fine."""

    async def acquire(self, ranks, op, fault=""):
        self.silent.pop(3, None)
        return await super().acquire(ranks, op, fault)

    async def send(self, rank, msg):
        if isinstance(msg, m.PullWeights) and rank == 3 and self.started == 1:
            self.silent[3] = 10.5
            await asyncio.Event().wait()
        return await super().send(rank, msg)

    def alive(self, rank):
        return None if rank == 3 else super().alive(rank)


@pytest.mark.parametrize(
    "ranks,error,fenced",
    [
        (JoinerDiesOnce, "ScaleError: rank 3 died during loading", []),
        # Not held until Router.prepare_timeout_s (120 s): silent past joiner_timeout_s, it is
        # SIGKILLed (fenced) before its rank gets a new joiner.
        (JoinerStallsOnce, "ScaleError: rank 3 stalled during loading: no answer for 10.5 s", [(3, 103)]),
    ],
    ids=["dies", "stalls"],
)
def test_a_scale_up_whose_joiner_fails_starts_a_new_one_and_reaches_its_target(ranks, error, fenced):
    ranks = ranks()
    op = Operation(
        ScaleRequest(dp_size=4), Committed(epoch=1, active=[0, 1, 2], placement=THREE),
        [], ranks, ranks, RouterConfig(rebalance=False), max_ranks=4, num_experts=4,
    )  # fmt: skip
    asyncio.run(op.execute(lambda: []))
    assert (op.record.phase, op.record.error, op.topology.active) == ("done", "", [0, 1, 2, 3]), op.record
    assert [(r.rank, r.phase, r.attempt) for r in op.record.joiner_retries] == [(3, "loading", 2)]
    assert op.record.joiner_retries[0].error == error
    assert ranks.started == 2 and ranks.fenced == fenced
    assert [r for r, x in ranks.sent if isinstance(x, m.Disconnect)] == [0, 1, 2]  # the failed one forgotten
    assert list(op.record.phases) == ["starting", "loading", "warming", "connecting", "committing"]


def test_a_joiner_that_dies_every_time_aborts_the_scale_up_saying_so():
    class AlwaysDies(JoinerDiesOnce):
        async def acquire(self, ranks, op, fault=""):
            self.started, self.dead = 1, False
            return {r: "cold" for r in ranks}

    ranks = AlwaysDies()
    op = Operation(
        ScaleRequest(dp_size=4), Committed(epoch=1, active=[0, 1, 2], placement=THREE),
        [], ranks, ranks, RouterConfig(joiner_retries=2), max_ranks=4, num_experts=4,
    )  # fmt: skip
    asyncio.run(op.execute(lambda: []))
    assert op.record.phase == "aborted" and len(op.record.joiner_retries) == 2, op.record
    assert op.record.error == (
        "ScaleError: joiners [3] died during loading, after 2 retries (Router.joiner_retries): "
        "ScaleError: rank 3 died during loading"
    )


def test_a_removal_retires_exactly_the_ranks_it_names():
    """remove=[0] of ranks 0-2: rank 0 alone leaves by the scale-down's path (out of routing,
    drained to the others, expert 3 that only it holds pulled from it into rank 2's duplicate
    slot, a commit, its exit); ranks 1 and 2 keep their numbers and hold every expert."""

    async def pulls(ranks: Ranks, rank: int, msg: m.PullWeights) -> m.ControlReply:
        n = len(msg.items)
        return m.ControlReply(ok=True, pull=PullStats(tensors=n, bytes=8 * n, seconds=0.1, per_source={}))

    ranks = Ranks(pull=pulls)
    op = Operation(
        ScaleRequest(dp_size=2, remove=[0]),
        Committed(epoch=1, active=[0, 1, 2], placement=balanced_placement(1, 4, 4, S, [0, 1, 2])),
        [],
        ranks,
        ranks,
        RouterConfig(rebalance=False, park_leaving=False),
        max_ranks=4,
        num_experts=4,
    )
    asyncio.run(op.execute(lambda: []))
    assert (op.record.kind, op.record.phase, op.record.leaving, op.record.to_size) == ("down", "done", [0], 2)
    assert op.topology.active == [1, 2]
    assert op.topology.placement.slots == [[-1, -1, 1, 0, 2, 3, -1, -1]]
    assert [(r, type(msg)) for r, msg in ranks.sent if isinstance(msg, (m.SetRoutable, m.Drain, m.Exit))] == [
        (0, m.SetRoutable),
        (0, m.Drain),
        (0, m.Exit),
    ]
    assert ranks.messages(m.Drain, 0)[0].targets == [1, 2]  # its requests go to the ranks that stay
    assert [(r, it.src_rank, it.src_name) for r, p in ranks.sent if isinstance(p, m.PullWeights) for it in p.items] == [
        (2, 0, expert_slot_name(0, 1, part)) for part in ("gate", "up", "down")
    ]


def test_a_queued_removal_applies_to_the_ranks_that_still_serve():
    """The API checked a removal of ranks 1 and 3 of 0-3 (to 2 ranks) against the active set it
    saw; a failover may have changed that set since."""
    req = ScaleRequest(dp_size=2, remove=[1, 3])
    scaler = Scaler(None, None, None, RouterConfig(), max_ranks=4)
    assert scaler._removal_now(req, [0, 1, 2, 3]) == (req, "") and scaler.resume is None
    # Rank 3 failed over: what is left is rank 1's removal.
    assert scaler._removal_now(req, [0, 1, 2]) == (
        msgspec.structs.replace(req, remove=[1], dp_size=2),
        "removal of ranks [1, 3]: ranks [3] no longer serve",
    )
    # Both failed over: nothing is left to remove, and the deployment is at its size.
    assert scaler._removal_now(req, [0, 2])[0] == msgspec.structs.replace(req, remove=[])
    assert scaler.resume is None
    # Rank 2 failed over: it is replaced first (rank 2 is the lowest free number while 1 and 3
    # serve), then the removal runs.
    assert scaler._removal_now(req, [0, 1, 3]) == (
        ScaleRequest(dp_size=4),
        "removal of ranks [1, 3] waits: ranks that failed since it was asked are replaced first (1)",
    )
    assert scaler.resume == req


def test_a_joiner_is_never_held_to_less_than_the_rank_timeout():
    """A deployment that raised Router.rank_timeout_s past joiner_timeout_s (a slow network, say)
    keeps its joiners too: silent for 10.5 s, under its rank timeout of 30 s, the joiner is waited
    for, and the scale-up ends done without a retry."""

    class Slow(JoinerStallsOnce):
        async def send(self, rank, msg):
            if isinstance(msg, m.PullWeights) and rank == 3 and self.started == 1:
                self.silent[3] = 10.5
                await asyncio.sleep(0.3)  # then it answers
                self.silent[3] = 0.0
            return await Ranks.send(self, rank, msg)

    ranks = Slow()
    op = Operation(
        ScaleRequest(dp_size=4), Committed(epoch=1, active=[0, 1, 2], placement=THREE),
        [], ranks, ranks, RouterConfig(rebalance=False, rank_timeout_s=30), max_ranks=4, num_experts=4,
    )  # fmt: skip
    asyncio.run(op.execute(lambda: []))
    assert (op.record.phase, op.record.joiner_retries, ranks.started) == ("done", [], 1), op.record
