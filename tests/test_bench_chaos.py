"""bench.chaos's bookkeeping: a fault is drawn only where the deployment can take it and a seed
draws the same ones; each fault is charged the requests that ended from it to the next fault; a
corrupt snapshot is damaged for its scale-up alone and the row says what the joiner did."""

from __future__ import annotations

import random
import re
from types import SimpleNamespace

import pytest

from bench import chaos
from snapshot.manifest import SnapshotCorrupt, SnapshotManifest, now_iso, verify, write_snapshot


def soak(seed: int, size: int, planner_alive: bool = True) -> SimpleNamespace:
    args = SimpleNamespace(min_size=2, max_size=4, faults=list(chaos.MATRIX))
    return SimpleNamespace(rng=random.Random(seed), target=size, args=args, planner_alive=planner_alive)


def draws(s: SimpleNamespace, n: int = 400) -> list[str]:
    return [chaos.pick(s) for _ in range(n)]


def test_a_fault_is_drawn_only_where_the_deployment_can_take_it():
    at_min, mid, at_max = set(draws(soak(1, 2))), set(draws(soak(1, 3))), set(draws(soak(1, 4)))
    joiners = {f"joiner killed in {p}" for p in chaos.JOINER_PHASES}
    joiners |= {"joiner stalled in pull", "pull source killed", "corrupt snapshot"}
    # Two ranks killed leaves one rank at least; no scale-up past the largest size, no scale-down
    # below the smallest.
    assert "two ranks killed" not in at_min and "leaving rank killed" not in at_min and joiners <= at_min
    assert mid == set(chaos.MATRIX)
    assert not joiners & at_max and {"two ranks killed", "leaving rank killed"} <= at_max
    # The planner is not restarted: killed once, it is not drawn again.
    assert "planner killed" not in set(draws(soak(1, 3, planner_alive=False)))


def test_a_seed_draws_the_same_faults():
    assert draws(soak(7, 3), 50) == draws(soak(7, 3), 50)
    assert draws(soak(7, 3), 50) != draws(soak(8, 3), 50)


def test_each_fault_is_charged_what_ended_from_it_to_the_next():
    reference = ["a", "b"]
    traffic = SimpleNamespace(
        results=[(0, "a", 0, 1), (1, "b", 0, 1), (1, "x", 0, 1), (0, "a", 0, 1)],
        errors=[(0, "RuntimeError('HTTP 503: no serving rank (operation op-3)')")],
    )
    rows = [{"kind": "serving rank killed", "window": (0, 0)}, {"kind": "router killed", "window": (2, 1)}]
    chaos.settle_windows(rows, traffic, reference)
    assert [(r["sent"], r["lost"], r["wrong_tokens"], r["wrong_requests"]) for r in rows] == [
        (3, 1, 0, []),
        (2, 0, 1, [1]),
    ]
    assert rows[0]["failure_reasons"] == {"RuntimeError('HTTP 503: no serving rank')": 1}
    assert all("window" not in r for r in rows)
    ok = {"recovered_s": 1.0, "next_scale": "3 -> 2: done", "next_scale_whole": True}
    assert chaos.bad(rows[0] | ok) and chaos.bad(rows[1] | ok)  # one lost, one wrong
    clean = rows[0] | ok | {"lost": 0}
    assert not chaos.bad(clean)
    assert chaos.bad(clean | {"recovered_s": None}) and chaos.bad(clean | {"next_scale": "3 -> 2: aborted"})


def test_without_a_snapshot_the_corrupt_snapshot_is_not_drawn():
    assert chaos.fault_kinds([], snapshots=True) == list(chaos.MATRIX)
    assert chaos.fault_kinds([], snapshots=False) == [k for k in chaos.MATRIX if k != "corrupt snapshot"]
    assert chaos.fault_kinds(["router killed"], snapshots=False) == ["router killed"]
    with pytest.raises(ValueError, match=r"^corrupt snapshot needs a snapshot$"):
        chaos.fault_kinds(["router killed", "corrupt snapshot"], snapshots=False)


@pytest.fixture
def snap(tmp_path):
    m = SnapshotManifest(
        model_identity="m",
        dtype="float32",
        max_ranks=4,
        num_experts=8,
        slots_per_rank=2,
        max_seqs=16,
        max_len=64,
        max_batched_tokens=256,
        device_type="cpu",
        snapshot_id="snap-1",
        created=now_iso(),
        tier="criu",
        model_name="m",
        architecture="a",
    )
    # An empty file cannot have a byte flipped: never drawn.
    write_snapshot(tmp_path / "snap", m, {"engine.json": b"{}" * 8, "criu/pages-1.img": bytes(64), "criu/empty": b""})
    return tmp_path / "snap"


def contents(snap) -> dict:
    return {p: p.read_bytes() for p in snap.rglob("*") if p.is_file()}


def corrupt(snap, monkeypatch, record) -> tuple[chaos.Injected, list]:
    """Soak.corrupt_snapshot at size 3, the scale's record `record(why)`, `why` what verifying
    the snapshot said while the scale-up ran; returns the injection and the scales asked for."""
    pristine, calls = contents(snap), []

    def scale(srv, n, **extra):
        with pytest.raises(SnapshotCorrupt) as e:
            verify(snap)
        calls.append((n, extra))
        return record(str(e.value))

    monkeypatch.setattr(chaos, "scale", scale)
    try:
        return chaos.Soak.corrupt_snapshot(
            SimpleNamespace(snapshot=snap, target=3, rng=random.Random(2), srv=None)
        ), calls
    finally:  # whatever the joiner did, the snapshot is as baked for the faults after this one
        assert contents(snap) == pristine
        verify(snap)


def test_a_corrupt_snapshot_is_refused_by_a_new_joiner_that_cold_starts(snap, monkeypatch):
    def refused(why):
        return {"id": "op-7", "joiners": [3], "joined_from": {"3": "cold"}, "snapshot_refused": {"3": why}}

    inj, calls = corrupt(snap, monkeypatch, refused)
    member, offset = inj.params["member"], inj.params["offset"]
    why = f"snapshot {snap}: {member}: checksum mismatch (tampered or corrupt)"
    # A new process for the joiner, one rank more; a member the manifest checksums, never empty.
    assert calls == [(4, {"fault": chaos.NEW_JOINER})]
    assert member in ("engine.json", "criu/pages-1.img") and 0 <= offset < (snap / member).stat().st_size
    assert inj.target == 4
    assert inj.params == {"member": member, "offset": offset, "joiner": 3, "joined_from": "cold", "refused": why}
    line = f"[op op-7] {why}"  # the router's warning (components.control.capacity)
    assert re.search(inj.detect, line) and not re.search(inj.detect, line.replace("op-7", "op-8"))


@pytest.mark.parametrize("how", ["snapshot", "cold"])
def test_a_joiner_that_did_not_refuse_the_corrupt_snapshot_fails_the_fault(snap, monkeypatch, how):
    def restored(why):
        return {"id": "op-7", "joiners": [3], "joined_from": {"3": how}, "snapshot_refused": {}}

    with pytest.raises(AssertionError) as e:
        corrupt(snap, monkeypatch, restored)
    assert str(e.value).startswith("the joiner did not refuse the damaged snapshot: {'member': ")
    assert str(e.value).endswith(f"'joiner': 3, 'joined_from': '{how}', 'refused': ''}}")


def test_joiners_are_counted_by_how_they_joined():
    joined = {"op-1": {"3": "cold"}, "op-2": {"2": "snapshot", "3": "snapshot"}, "op-3": {}, "op-4": {"2": "parked"}}
    assert chaos.joined_from(joined) == {"cold": 1, "parked": 1, "snapshot": 2}
