"""Snapshots in the elastic flow, with real CRIU: joiners are restored from a baked worker image,
two at once from one image, and serve exactly what the reference does; a tampered image is
refused with the reason and the joiner cold-starts (one damaged after the router chose it too,
until it is repaired); a leaving rank parks and the next scale-up
restores it instead of starting a process; restored processes die with the graph."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.reference import make_checkpoint
from harness.server import ROOT, Server, Traffic, engine_reference, scale
from harness.tamper import flip_byte, largest
from snapshot.bake import IMAGE_DIR, bake

MAX_TOKENS = 24
PROMPTS = [[5 + i, 17, 42 + i, 99, 7 * i + 3, 250] for i in range(8)]


@pytest.fixture(scope="module")
def snapshots(tmp_path_factory):
    """The store holds a tampered image and another model's; a good image waits beside it."""
    root = tmp_path_factory.mktemp("snapshots")
    good, _ = bake(tmp_path_factory.mktemp("later") / "good", tier="criu", progress=False)
    tampered, m = bake(root / "tampered", tier="criu", progress=False)
    pages = largest(tampered, m.files, f"{IMAGE_DIR}/pages-")
    flip_byte(tampered / pages, 4096)
    other = make_checkpoint("mixtral", tmp_path_factory.mktemp("other-model"))
    bake(root / "other", model_dir=other, max_len=256, tier="criu", progress=False)
    return root, good, tampered / pages


@pytest.fixture(scope="module")
def server(snapshots):
    root, _, _ = snapshots
    srv = Server(
        ["--Worker.max_ranks=4", "--Worker.dp_size=1", f"--Worker.snapshot_root={root}", "--Planner.enabled=false"]
    )
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def reference():
    return dict(enumerate(engine_reference(PROMPTS, MAX_TOKENS)))


def started(log: str, op: str) -> dict[int, tuple[int, str]]:
    """rank -> (pid as seen from the router, how) of the processes operation `op` started."""
    found = re.findall(rf"\[op {op}\] started Worker\.(\d+) \(pid (\d+), (\w+)\)", log)
    return {int(r): (int(pid), how) for r, pid, how in found}


def ns_pid(pid: int) -> int:
    """`pid`'s PID in its innermost namespace."""
    line = next(ln for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ln.startswith("NSpid:"))
    return int(line.split()[-1])


def chosen_snapshot(server: Server) -> dict:
    """/topology's `snapshot`, once the router's choice at its start is made."""
    deadline = time.monotonic() + 60
    while (snap := server.topology()["snapshot"])["state"] == "choosing" and time.monotonic() < deadline:
        time.sleep(0.1)
    return snap


def test_a_tampered_image_is_refused_and_the_joiner_cold_starts(server, snapshots, reference):
    _, _, pages = snapshots
    tampered = f"snapshot {pages.parents[1]}: {IMAGE_DIR}/{pages.name}: checksum mismatch (tampered or corrupt)"
    # Said before any scale-up, where a user looks: joiners will start cold, and why.
    before = chosen_snapshot(server)
    assert before["state"] == "none" and before["decided_by"] == "startup", before
    assert tampered in before["why"] and "model_identity" in before["why"]
    with Traffic(server, PROMPTS, MAX_TOKENS, clients=2) as traffic:
        op = scale(server, 2)
    assert op["phase"] == "done" and op["joined_from"] == {"1": "cold"}, op
    why = op["snapshot_refused"]["1"]
    assert tampered in why
    assert "model_identity" in why  # the other model's, refused by field
    assert server.topology()["snapshot"] == {**before, "decided_by": op["id"]}
    assert traffic.errors == []
    assert all(text == reference[p] for p, text, _, _ in traffic.results)


def test_two_joiners_restored_from_one_image_serve_the_reference(server, snapshots, reference):
    root, good, _ = snapshots
    good.rename(root / "good")
    with Traffic(server, PROMPTS, MAX_TOKENS, clients=3) as traffic:
        up = scale(server, 4)
        assert up["phase"] == "done", up
        deadline = time.monotonic() + 120
        while not traffic.errors and time.monotonic() < deadline:  # until both restored ranks served
            served = {r["rank"]: r["requests_total"] for r in server.topology()["ranks"]}
            if min(served[2], served[3]) >= 2:
                break
            time.sleep(0.2)
        down = scale(server, 3)
        again = scale(server, 4)
    joiners = range(up["from_size"], 4)  # 2 and 3, after the test above
    assert up["joined_from"] == {str(r): "snapshot" for r in joiners} and up["snapshot_refused"] == {}, up
    # The good image, chosen at the scale-up that started processes (a parked rank's return starts none).
    snap = server.topology()["snapshot"]
    assert (snap["state"], snap["path"], snap["decided_by"]) == ("chosen", str(root / "good"), up["id"]), snap
    assert snap["snapshot_id"] and snap["why"] == ""
    assert down["phase"] == "done" and down["parked"] == [3]
    assert again["phase"] == "done" and again["joined_from"] == {"3": "parked"}
    ranks = {r["rank"]: r for r in server.topology()["ranks"]}
    assert min(ranks[2]["requests_total"], ranks[3]["requests_total"]) >= 2, ranks
    assert [ranks[r]["started_from"] for r in range(4)] == ["cold"] * (4 - len(joiners)) + ["snapshot"] * len(joiners)
    log = server.output
    assert "RESTORED (restored from snapshot" in log
    assert traffic.errors == []
    assert all(text == reference[p] for p, text, _, _ in traffic.results)
    # Each copy runs in its own PID namespace, with the PID the baked process had there; ranks
    # report their PID as the router sees it.
    copies = started(log, up["id"])
    assert {r: how for r, (_, how) in copies.items()} == {r: "snapshot" for r in joiners}
    assert all(ranks[r]["pid"] == copies[r][0] for r in joiners), (ranks, copies)
    inside = {ns_pid(pid) for pid, _ in copies.values()}
    assert len(inside) == 1 and inside != {pid for pid, _ in copies.values()}
    # Each restored in a network namespace of its own (abstract socket names cannot collide), then
    # back in ours before it opened anything: its peers and discovery are here.
    ours = os.stat("/proc/self/ns/net").st_ino
    for r in joiners:
        assert f"rank {r}: joined the restorer's network namespace" in log
        assert os.stat(f"/proc/{copies[r][0]}/ns/net").st_ino == ours
    # The graph gone, so are the restored processes, reaped (no zombie left).
    server.stop()
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() for pid, _ in copies.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(Path(f"/proc/{pid}").exists() for pid, _ in copies.values())


def test_checkpointing_parked_cuda_ranks_needs_the_vmm_arena(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "components.graph.serve",
            "serve",
            "graphs/elastic:Frontend",
            "--discovery-dir",
            str(tmp_path),
            "--Worker.device=cuda",
            "--Router.checkpoint_parked=true",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Router.checkpoint_parked needs --Worker.vmm=true" in r.stderr
    assert "started" not in r.stdout + r.stderr


def test_a_standby_copy_restored_ahead_is_the_next_joiner(snapshots, reference):
    """With Router.standby_copies=1 a copy of the chosen snapshot is restored as the router starts,
    before any scale-up; the next scale-up makes it the joiner (no CRIU restore inside the
    operation) and restores another; a standby copy that died is dropped and the joiner restored
    as usual; the graph gone, so are the standby copies. (After the test above: the good image
    is in the store.)"""
    root, good, _ = snapshots
    srv = Server(
        [
            "--Worker.max_ranks=4",
            "--Worker.dp_size=1",
            f"--Worker.snapshot_root={root}",
            "--Planner.enabled=false",
            "--Router.standby_copies=1",
        ]
    )

    def standby(after: int = 0) -> int:
        """The pid of the standby copy ready, restored after the log's first `after` characters."""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            ready = re.findall(r"standby copy pid (\d+) of snapshot .* ready \(1 of 1\)", srv.output[after:])
            if ready and srv.topology()["snapshot"]["standby"] == 1:
                return int(ready[-1])
            time.sleep(0.1)
        raise AssertionError(f"no standby copy ready:\n{srv.tail(40)}")

    try:
        first = standby()
        snap = srv.topology()["snapshot"]
        assert (snap["state"], snap["path"], snap["standby"]) == ("chosen", str(root / "good"), 1), snap
        with Traffic(srv, PROMPTS, MAX_TOKENS, clients=2) as traffic:
            mark = len(srv.output)
            up = scale(srv, 2)
            second = standby(mark)
            os.kill(second, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while Path(f"/proc/{second}").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            again = scale(srv, 3)
        log = srv.output
        assert up["phase"] == "done" and up["joined_from"] == {"1": "snapshot"}, up
        assert f"[op {up['id']}] Worker.1: standby copy pid {first}, restored" in log
        assert f"[op {up['id']}] Worker.1: criu restore took" not in log
        assert {r["rank"]: r["pid"] for r in srv.topology()["ranks"]}[1] == first
        # The dead copy is dropped, by the scale-up that found it gone or, if the router's
        # once-a-second check saw it first, before; the joiner is restored the usual way (or from
        # the copy that check restored in its place, when that was ready first).
        assert again["phase"] == "done" and again["joined_from"] == {"2": "snapshot"}, again
        assert re.search(rf"standby copy pid {second} (died: )?dropped", log), log
        joined = re.search(rf"\[op {again['id']}\] Worker.2: (criu restore took|standby copy pid (\d+), restored)", log)
        assert joined and joined.group(2) != str(second), log
        assert traffic.errors == []
        assert all(text == reference[p] for p, text, _, _ in traffic.results)
        third = standby(joined.end())
    finally:
        srv.stop()
    deadline = time.monotonic() + 10
    while Path(f"/proc/{third}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{third}").exists()


def test_a_snapshot_damaged_after_it_was_chosen_is_refused_until_repaired(tmp_path, reference):
    """The router chose the image and hashed its files as it started (the checksums cached); a
    byte flipped afterwards is still found: the next joiner refuses it and cold-starts, and once the
    byte is back the one after is restored from it again, every completion the reference's."""
    snap, m = bake(tmp_path / "store" / "snap", tier="criu", progress=False)
    pages = largest(snap, m.files, f"{IMAGE_DIR}/pages-")
    srv = Server(
        [
            "--Worker.max_ranks=4",
            "--Worker.dp_size=1",
            f"--Worker.snapshot_root={snap.parent}",
            "--Planner.enabled=false",
        ]
    )
    try:
        assert (chosen := chosen_snapshot(srv))["state"] == "chosen", chosen
        with Traffic(srv, PROMPTS, MAX_TOKENS, clients=2) as traffic:
            restored = scale(srv, 2)
            flip_byte(snap / pages, 4096)
            damaged = scale(srv, 3)
            flip_byte(snap / pages, 4096)  # the same bit back: the image as baked
            repaired = scale(srv, 4)
    finally:
        srv.stop()
    assert restored["phase"] == "done" and restored["joined_from"] == {"1": "snapshot"}, restored
    assert damaged["phase"] == "done" and damaged["joined_from"] == {"2": "cold"}, damaged
    assert damaged["snapshot_refused"] == {"2": f"snapshot {snap}: {pages}: checksum mismatch (tampered or corrupt)"}
    assert repaired["phase"] == "done" and repaired["joined_from"] == {"3": "snapshot"}, repaired
    assert repaired["snapshot_refused"] == {}
    assert traffic.errors == []
    assert all(text == reference[p] for p, text, _, _ in traffic.results)
