"""Scale operations without a deployment: the phase table, and the scaler's queue, where the
latest requested size wins over every one still queued (whole operations run in test_elastic)."""

from __future__ import annotations

import asyncio

import pytest

from components.control import scaling
from components.control.scaling import _FINAL, _NEXT, Phase, Scaler
from components.protocol.config import RouterConfig
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


def test_the_journal_gives_a_restarted_router_its_history(tmp_path, monkeypatch):
    """The last line of each id wins, a line torn by the kill is skipped, the file keeps only the
    recent history; what was in flight is interrupted, with the adoption's outcome, and the next
    ids follow on."""

    def rec(n: int, phase: str) -> OpRecord:
        return OpRecord(
            id=f"op-{n}-up-2to3",
            kind="up",
            mode=ScaleMode.PREPARE_ASYNC_REUSE_GRAPHS,
            from_size=2,
            to_size=3,
            phase=phase,
            joiners=[2],
            leaving=[],
            phases={},
            started_at=float(n),
        )

    path = tmp_path / "router" / "operations.jsonl"
    path.parent.mkdir()
    journal = scaling.OpJournal(path)
    for n in range(1, 26):
        journal.save(rec(n, "starting"))
        journal.save(rec(n, "done" if n < 25 else "loading"))
    with path.open("ab") as f:
        f.write(b'{"id": "op-26-up')  # the kill came mid-write
    monkeypatch.setattr(scaling.Operation, "_ids", scaling.Operation._ids)  # restored after the test
    scaler = Scaler(Owner(), None, None, RouterConfig(), max_ranks=8, journal=scaling.OpJournal(path))
    assert [r.id for r in scaler.history] == [f"op-{n}-up-2to3" for n in range(6, 26)]
    assert [r.phase for r in scaler.history] == ["done"] * 19 + ["loading"]
    scaler.settle("adopted epoch 4: ranks [0, 1] active, none parked, [2] stopped")
    cut = scaler.history[-1]
    assert cut.phase == "interrupted" and cut.error == (
        "the router running it stopped in loading; the next one adopted epoch 4: ranks [0, 1] active, "
        "none parked, [2] stopped"
    )
    reloaded = scaling.OpJournal(path).load()
    assert len(path.read_text().splitlines()) == 20 and reloaded[-1] == cut
    assert next(scaling.Operation._ids) == 26
