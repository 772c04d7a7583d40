"""Scale operations without a deployment: the phase table, and the scaler's queue, where the
latest requested size wins over every one still queued (whole operations run in test_elastic)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from components.control import scaling
from components.control.scaling import _FINAL, _NEXT, Phase, Scaler, Tally
from components.protocol.config import RouterConfig
from components.protocol.messages import Configure, ControlReply, Disconnect, LoadExperts, Pause, Resume
from components.protocol.placement import balanced_placement, changed_slots, shrink
from components.protocol.topology import Committed, OpRecord, ScaleMode, ScaleRequest


def reachable(start: Phase) -> set[Phase]:
    seen, todo = {start}, [start]
    while todo:
        for nxt in _NEXT.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_every_phase_can_finish_and_the_paths_are_the_documented_ones():
    assert all(Phase.DONE in reachable(p) for p in Phase if p not in _FINAL)
    assert not any(_NEXT.get(p) for p in _FINAL)
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
    for path in (up, down, [Phase.QUEUED, Phase.PAUSING, Phase.STARTING]):
        assert all(b in _NEXT[a] for a, b in zip(path, path[1:])), path


def operation(dp_size: int = 3) -> scaling.Operation:
    return scaling.Operation(
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
        preempted = False  # no serving rank fails here

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

    monkeypatch.setattr(scaling, "Operation", Op)

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


def rec(n: int, phase: str, kind: str = "up", followup_error: str = "") -> OpRecord:
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
    )


def test_the_journal_gives_a_restarted_router_its_history_and_counters(tmp_path, monkeypatch):
    """The last line of each id wins, a line torn by the kill is skipped, the file keeps only the
    recent history and a tally of the rest; what was in flight is interrupted, with the adoption's
    outcome, and the next ids follow on. The counters go on from the last router's."""
    path = tmp_path / "router" / "operations.jsonl"
    path.parent.mkdir()
    journal = scaling.OpJournal(path)
    for n in range(1, 26):
        journal.save(rec(n, "starting"))
        journal.save(rec(n, "done" if n < 25 else "loading", followup_error="rebalance failed" if n == 3 else ""))
    with path.open("ab") as f:
        f.write(b'{"id": "op-26-up')  # the kill came mid-write
    monkeypatch.setattr(scaling.Operation, "_ids", scaling.Operation._ids)  # restored after the test
    scaler = Scaler(Owner(), None, None, RouterConfig(), max_ranks=8, journal=scaling.OpJournal(path))
    assert [r.id for r in scaler.history] == [f"op-{n}-up-2to3" for n in range(6, 26)]
    assert [r.phase for r in scaler.history] == ["done"] * 19 + ["loading"]
    assert scaler.tally == Tally(outcomes={"up": {"done": 24}}, followup_failures=1)
    scaler.settle("adopted epoch 4: ranks [0, 1] active, none parked, [2] stopped")
    cut = scaler.history[-1]
    assert cut.phase == "interrupted" and cut.error == (
        "the router running it stopped in loading; the next one adopted epoch 4: ranks [0, 1] active, "
        "none parked, [2] stopped"
    )
    assert scaler.tally == Tally(outcomes={"up": {"done": 24, "interrupted": 1}}, followup_failures=1)
    lines = path.read_text().splitlines()
    # The 5 operations dropped (one with a failed follow-up) are tallied on the first line.
    assert len(lines) == 22 and lines[0] == '{"outcomes":{"up":{"done":5}},"followup_failures":1}'
    records, tally = scaling.OpJournal(path).load()
    assert records[-1] == cut and tally == scaler.tally
    assert next(scaling.Operation._ids) == 26


def test_the_journal_is_compacted_while_the_router_runs(tmp_path):
    """It gains a line per phase change; past `compact_after` lines it is rewritten with the recent
    history alone, and loads as if it had never been compacted."""

    def run(path, compact_after: int) -> list[int]:
        journal, sizes = scaling.OpJournal(path, compact_after), []
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
    assert scaling.OpJournal(compacted).load() == scaling.OpJournal(plain).load()
    records, tally = scaling.OpJournal(compacted).load()
    assert [r.id for r in records] == [rec(n, "done", kind="up" if n % 3 else "down").id for n in range(21, 41)]
    assert tally == Tally(outcomes={"up": {"done": 20, "aborted": 7}, "down": {"done": 10, "aborted": 3}})


class Ranks:
    """The router's and the capacity provider's side of an operation, recording what it sends;
    `dead`: serving ranks the router found dead."""

    def __init__(self, ranks, dead=()):
        self.known, self.dead = set(ranks), set(dead)
        self.sent: dict[int, list] = {r: [] for r in ranks}
        self.fenced: list[tuple[int, int]] = []

    async def send(self, rank, msg):
        self.sent[rank].append(msg)
        return ControlReply(ok=True)

    def failed(self, rank):
        return rank in self.dead

    def status(self, rank):
        if rank not in self.known:
            raise KeyError(rank)
        return SimpleNamespace(pid=100 + rank)

    def forget(self, rank):
        self.known.discard(rank)

    def alive(self, rank):
        return None  # not started by this provider: only the router knows

    async def fence(self, rank, pid, op):
        self.fenced.append((rank, pid))


def rolled_back(dead):
    """A scale-up 3 -> 4 whose commit of epoch 6 failed, rolled back at epoch 7 with `dead` found
    dead: the rollback's messages to each rank, the operation, and the placement before."""
    placement = balanced_placement(2, 8, 4, 4, [0, 1, 2])
    ranks = Ranks([0, 1, 2, 3], dead)
    op = scaling.Operation(
        ScaleRequest(dp_size=4), Committed(epoch=5, active=[0, 1, 2], placement=placement), [], ranks, ranks,
        RouterConfig(), max_ranks=4, num_experts=8,
    )  # fmt: skip
    asyncio.run(op.rollback([0, 1, 2, 3], 7, "commit of epoch 6 failed"))
    return ranks, op, placement


def test_a_rollback_masks_out_a_serving_rank_found_dead_as_a_failover_would():
    """Never an epoch with a dead rank active: rank 1 is fenced, the survivors stop waiting for it,
    reload the experts it alone held, and go back to the old set without it."""
    ranks, op, before = rolled_back(dead=[1])
    target = shrink(before, [1], 8)
    assert op.topology == Committed(epoch=7, active=[0, 2], placement=target) and op.record.masked == [1]
    assert ranks.fenced == [(1, 101)] and 1 not in ranks.known and ranks.sent[1] == []
    reload = {slot // 4 for _, slot in changed_slots(before, target)}
    assert reload and reload <= {0, 2}
    for r in (0, 2):
        expected = [
            Pause(gone=[1]),
            *([LoadExperts(placement=target, since=before)] if r in reload else []),
            Configure(epoch=7, active=[0, 2], placement=target),
            Resume(),
            Disconnect(ranks=[1]),
        ]
        assert ranks.sent[r] == expected, r
    # The joiner is configured out.
    assert ranks.sent[3] == [Pause(gone=[1]), Configure(epoch=7, active=[], placement=target), Resume()]


def test_a_rollback_with_every_rank_alive_goes_back_to_the_old_set():
    ranks, op, before = rolled_back(dead=[])
    assert op.topology == Committed(epoch=7, active=[0, 1, 2], placement=before) and op.record.masked == []
    assert ranks.fenced == []
    for r in (0, 1, 2, 3):
        active = [0, 1, 2] if r < 3 else []
        assert ranks.sent[r] == [Pause(), Configure(epoch=7, active=active, placement=before), Resume()], r


def test_ranks_a_rollback_masked_out_are_replaced(monkeypatch):
    """A rolled-back operation that masked a dead rank out leaves the deployment a rank short: the
    scaler asks for the size before it, as after a failover."""
    started: list[tuple[list[int], int]] = []

    class Op:
        preempted = False

        def __init__(self, req, topology, *rest, **kw):
            self.req, self.topology = req, topology
            self.record = OpRecord(
                id=f"to-{req.dp_size}", kind="up", mode=req.mode, from_size=len(topology.active),
                to_size=req.dp_size, phase="queued", joiners=[], leaving=[], phases={},
            )  # fmt: skip

        async def execute(self, load_now):
            started.append((self.topology.active, self.req.dp_size))
            if len(started) == 1:  # rank 1 died in the commit
                self.record.phase, self.record.masked = "rolled_back", [1]
                return Committed(epoch=self.topology.epoch + 1, active=[0, 2], placement=None)
            self.record.phase = "done"
            return Committed(epoch=self.topology.epoch + 1, active=[0, 1, 2], placement=None)

    monkeypatch.setattr(scaling, "Operation", Op)

    async def run():
        owner, ready = Owner(), asyncio.Event()
        owner.committed = Committed(epoch=1, active=[0, 1, 2], placement=None)
        scaler = Scaler(owner, None, None, RouterConfig(), max_ranks=4)
        task = asyncio.create_task(scaler.run(ready))
        ready.set()
        scaler.request(ScaleRequest(dp_size=4))
        last = await scaler.wait_idle()
        task.cancel()
        return owner, last

    owner, last = asyncio.run(run())
    assert started == [([0, 1, 2], 4), ([0, 2], 3)]
    assert owner.committed.active == [0, 1, 2] and last.phase == "done"
