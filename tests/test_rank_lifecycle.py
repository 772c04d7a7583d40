"""The rank lifecycle: its transition table, and which control message a rank accepts in which
state (the worker's handler rules), checked against the sequences the router sends."""

from __future__ import annotations

import asyncio
import logging
import re
import typing

import msgspec
import pytest

from components.protocol import messages as m
from components.protocol.lifecycle import Lifecycle, RankState
from components.worker.component import FAULT_ENV, Worker
from components.worker.rules import RULES, allowed, refusal
from components.worker.server import RankServer

S = RankState


def at(state: RankState, rank: int = 3) -> Lifecycle:
    life = Lifecycle(rank)
    life.state = state
    return life


# ---- the transition table ----------------------------------------------------------------------


def test_legal_transitions_are_logged(caplog):
    life = Lifecycle(3)
    caplog.set_level(logging.INFO, logger="components.protocol.lifecycle")
    for new, reason in [
        (S.LOADED, "weights pulled"),
        (S.WARMED, ""),
        (S.STAGED, ""),
        (S.ACTIVE, ""),
        (S.LEAVING, ""),
        (S.PARKED, ""),
        (S.RESTORED, "unparked"),
    ]:
        life.transition(new, reason, op="op-7")
    assert life.state is S.RESTORED
    assert [r.getMessage() for r in caplog.records] == [
        "[op op-7] rank 3: BOOTING -> LOADED (weights pulled)",
        "[op op-7] rank 3: LOADED -> WARMED",
        "[op op-7] rank 3: WARMED -> STAGED",
        "[op op-7] rank 3: STAGED -> ACTIVE",
        "[op op-7] rank 3: ACTIVE -> LEAVING",
        "[op op-7] rank 3: LEAVING -> PARKED",
        "[op op-7] rank 3: PARKED -> RESTORED (unparked)",
    ]


@pytest.mark.parametrize(
    "old,new",
    [
        (S.BOOTING, S.ACTIVE),  # no weights yet
        (S.LOADED, S.LEAVING),
        (S.ACTIVE, S.PARKED),  # out of routing first
        (S.ACTIVE, S.STAGED),
        (S.PARKED, S.LOADED),  # restored first
        (S.PARKED, S.ACTIVE),
        (S.EXITED, S.RESTORED),
        (S.FAILED, S.ACTIVE),
    ],
)
def test_illegal_transitions_raise_and_change_nothing(caplog, old, new):
    life = at(old)
    caplog.set_level(logging.INFO, logger="components.protocol.lifecycle")
    with pytest.raises(RuntimeError, match=re.escape(f"rank 3: illegal transition {old.name} -> {new.name}")):
        life.transition(new)
    assert life.state is old and caplog.records == []


@pytest.mark.parametrize("old", list(RankState))
def test_any_state_may_fail(caplog, old):
    life = at(old)
    caplog.set_level(logging.INFO, logger="components.protocol.lifecycle")
    life.transition(S.FAILED, "engine died")
    assert life.state is S.FAILED
    assert [r.getMessage() for r in caplog.records] == [f"[op -] rank 3: {old.name} -> FAILED (engine died)"]


def test_state_travels_by_name():
    status = m.RankStatus(
        rank=1,
        pid=7,
        instance_id=9,
        metadata=b"",
        model_identity="m",
        num_experts=4,
        num_moe_layers=2,
        slots_per_rank=2,
        epoch=1,
        active=[0, 1],
        connected=[0, 1],
        paused=False,
        routable=True,
        steps=0,
        state=S.PARKED,
        load=[],
        running=0,
        waiting=0,
        requests_total=0,
        expert_rows=0,
    )
    wire = m.encode(status)
    assert wire["state"] == "PARKED"
    back = m.decode_reply({"ok": True, "status": wire}).status
    assert back.state is S.PARKED and back.state == "PARKED" and f"{back.state}" == "PARKED"
    with pytest.raises(msgspec.ValidationError, match="Invalid enum value 'GONE'"):
        m.decode_reply({"ok": True, "status": {**wire, "state": "GONE"}})


# ---- the worker's handler rules ----------------------------------------------------------------


def test_every_control_message_has_a_handler():
    assert set(RULES) == set(typing.get_args(m.ControlRequest))
    for message, rule in RULES.items():
        assert rule.handler is getattr(RankServer, rule.handler.__name__), message


def test_declared_moves_are_legal_transitions_from_valid_states():
    for message, rule in RULES.items():
        for old, new in rule.moves.items():
            assert old in rule.valid, (message, old)
            at(old).transition(new)  # raises if the lifecycle forbids it


# What the router sends one rank (components/control/router.py bootstrap, components/control/
# operation.py Operation), from a starting state: a message alone leaves the state as it is, and
# (message, state) moves the rank to that state.
SEQUENCES = {
    "bootstrap": (
        S.LOADED,
        [m.Describe, (m.Connect, S.STAGED), m.LoadExperts, m.Configure, (m.Resume, S.ACTIVE), m.SetRoutable],
    ),
    "mode C joiner, cold": (
        S.BOOTING,
        [
            m.Describe,
            (m.PullWeights, S.LOADED),
            (m.Warmup, S.WARMED),
            (m.Connect, S.STAGED),
            m.Pause,
            m.Configure,
            (m.Resume, S.ACTIVE),
            m.SetRoutable,
        ],
    ),
    "modes A/B joiner from a snapshot, warmed inside the pause": (
        S.RESTORED,
        [
            (m.PullWeights, S.LOADED),
            (m.Connect, S.STAGED),
            m.Pause,
            (m.Warmup, S.WARMED),
            m.Configure,
            (m.Resume, S.ACTIVE),
            m.SetRoutable,
        ],
    ),
    # Every serving rank failed: the deployment's new ranks load the checkpoint, then commit.
    "rank of a rebuilt deployment": (
        S.BOOTING,
        [m.Describe, (m.LoadWeights, S.LOADED), (m.Connect, S.STAGED), m.Pause, m.Configure, (m.Resume, S.ACTIVE)]
        + [m.SetRoutable],
    ),
    "parked rank in a rebuilt deployment": (S.PARKED, [(m.Restore, S.RESTORED), (m.LoadWeights, S.LOADED)]),
    # Its first pull lost a source (the rest pulled; DropSources may come before or during it):
    # loaded once the re-pull brought what that source was to send.
    "joiner whose source failed mid-pull": (
        S.BOOTING,
        [m.Describe, m.DropSources, m.PullWeights, (m.PullWeights, S.LOADED), (m.Warmup, S.WARMED)],
    ),
    # Configured out by the rollback, so its resume leaves it staged.
    "joiner rolled back": (S.STAGED, [m.Pause, m.Configure, m.Pause, m.Configure, m.Resume]),
    "serving rank through a scale-up in mode A, a rebalance and an abort": (
        S.ACTIVE,
        [m.Pause, m.ExportWeights, m.EndExport, m.Connect, m.Pause, m.Configure, m.Resume, m.PullWeights]
        + [m.Disconnect, m.Resume],
    ),
    "remaining rank of a mode B scale-down": (S.ACTIVE, [m.Pause, m.Warmup, m.Configure, m.Resume, m.Disconnect]),
    "leaving rank parked, in the rebalance after, then restored": (
        S.ACTIVE,
        [(m.SetRoutable, S.LEAVING), m.Drain]
        + [m.Pause, m.Configure, m.Resume, m.ExportWeights, m.EndExport]  # the interim commit, the pulls
        + [m.Pause, m.Configure, m.Resume, (m.Park, S.PARKED)]
        + [m.Pause, m.Configure, m.Resume, m.Describe, (m.Restore, S.RESTORED), (m.PullWeights, S.LOADED)],
    ),
    "leaving rank exits": (S.LEAVING, [(m.Exit, S.EXITED), m.Describe]),
    "leaving rank of an aborted scale-down": (S.LEAVING, [(m.SetRoutable, S.ACTIVE)]),
}


@pytest.mark.parametrize("name", list(SEQUENCES))
def test_router_sequences_are_allowed(name):
    state, steps = SEQUENCES[name]
    for step in steps:
        message, after = step if isinstance(step, tuple) else (step, state)
        assert allowed(message, state), (message.__name__, state)
        if after is not state:
            assert RULES[message].moves.get(state) is after, (message.__name__, state, after)
        state = after


@pytest.mark.parametrize("message", [m.Describe, m.ExportWeights, m.EndExport, m.DropSources])
def test_describe_and_exports_are_allowed_in_any_state(message):
    assert all(allowed(message, s) for s in RankState)


WEIGHTS = "LOADED, WARMED, STAGED, ACTIVE, LEAVING"


@pytest.mark.parametrize(
    "message,state,valid",
    [
        (m.Connect, S.BOOTING, WEIGHTS),
        (m.Pause, S.RESTORED, f"{WEIGHTS}, PARKED"),
        (m.SetRoutable, S.STAGED, "ACTIVE, LEAVING"),
        (m.LoadExperts, S.PARKED, WEIGHTS),
        (m.PullWeights, S.PARKED, f"BOOTING, RESTORED, {WEIGHTS}"),
        (m.Warmup, S.LEAVING, "LOADED, WARMED, STAGED, ACTIVE"),
        (m.Drain, S.ACTIVE, "LEAVING"),
        (m.Park, S.ACTIVE, "LEAVING"),
        (m.Restore, S.ACTIVE, "PARKED"),
        (m.Exit, S.PARKED, "STAGED, LEAVING"),
        (m.Disconnect, S.EXITED, WEIGHTS),
    ],
)
def test_messages_out_of_state_are_refused(message, state, valid):
    assert not allowed(message, state)
    assert str(refusal(message, state)) == f"{message.__name__} is not valid in state {state.name} (only in {valid})"


def test_the_router_gets_the_refusal_and_the_rank_stays(monkeypatch):
    monkeypatch.delenv(FAULT_ENV, raising=False)
    server = RankServer(2, Worker.Config(), ctx=None, join=True)
    for state in (S.LOADED, S.STAGED, S.ACTIVE, S.LEAVING, S.PARKED):
        server.life.transition(state)

    async def send(msg):
        return [m.decode_reply(r) async for r in server.control(m.encode(msg))]

    # No engine here: a message that got past the check would fail on it instead.
    (reply,) = asyncio.run(send(m.Connect(peers={0: b"m"})))
    assert (reply.ok, reply.error) == (False, f"StateError: Connect is not valid in state PARKED (only in {WEIGHTS})")
    assert server.life.state is S.PARKED
