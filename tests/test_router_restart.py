"""The router SIGKILLed under streaming load: `dynamo serve` restarts it, requests flow on (they
never pass through it), and the new router adopts what the ranks serve: the same epoch, active
set and processes, the joiners the old router started still serving, its parked rank parked
capacity again; the next scale-up takes that parked rank back. Killed in the middle of a commit,
the next router completes it under a new epoch. Its operation counters go on from the last
router's (reloaded from its journal), never back to 0."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import httpx
import pytest

from components.planner.service import parse_prometheus
from harness.server import Server, Traffic, alive, engine_reference, gone_within, scale, streamer_of

MAX_TOKENS = 24
PROMPTS = [[5 + i, 17, 42 + i, 99, 7 * i + 3, 250] for i in range(12)]


@pytest.fixture(scope="module")
def server():
    srv = Server(
        ["--Worker.max_ranks=4", "--Worker.dp_size=2", "--Planner.enabled=false", "--Router.allow_fault_injection=true"]
    )
    try:
        yield srv
    finally:
        srv.stop()


def router_pids(srv: Server) -> list[int]:
    return [int(p) for p in re.findall(r"started Router \(pid (\d+), restartable\)", srv.output)]


def wait_router_back(srv: Server, old: int, timeout: float = 120) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = router_pids(srv)
        if pids[-1] != old:
            try:
                if srv.control("GET", "/health").status_code == 200:
                    return pids[-1]
            except httpx.HTTPError:
                pass
        time.sleep(0.2)
    raise AssertionError(f"the router did not come back within {timeout} s:\n{srv.tail(80)}")


def wait_phase(srv: Server, phase: str, timeout: float = 120) -> None:
    """Until the scale operation in flight is in `phase`."""
    deadline = time.monotonic() + timeout
    while (srv.topology()["operation"] or {}).get("phase") != phase:
        assert time.monotonic() < deadline, srv.tail(60)
        time.sleep(0.05)


def counters(srv: Server) -> dict:
    """The router's operation counters: (kind, result) -> n, and the follow-up failures."""
    metrics = parse_prometheus(srv.control("GET", "/metrics").text)
    ops = {(labels["kind"], labels["result"]): n for labels, n in metrics["elastic_scale_operations_total"]}
    return {**ops, "followup failures": metrics["elastic_scale_followup_failures_total"][0][1]}


@pytest.fixture(scope="module")
def reference():
    return engine_reference(PROMPTS, MAX_TOKENS)


def assert_output_moved(pid: int) -> None:
    """The joiner `pid`'s output went through the killed router: it now writes where the graph
    does (a log file here, which it must not share: /dev/null), having seen that router go; so
    does its streaming process, told so by it."""
    streamer = streamer_of(pid)
    deadline = time.monotonic() + 10
    while os.readlink(f"/proc/{streamer}/fd/2") != "/dev/null" and time.monotonic() < deadline:
        time.sleep(0.1)
    for proc in (pid, streamer):
        assert os.readlink(f"/proc/{proc}/fd/1") == os.readlink(f"/proc/{proc}/fd/2") == "/dev/null", proc


def test_the_router_killed_under_load_is_restarted_and_adopts_the_topology(server, reference):
    up = scale(server, 4)
    assert up["phase"] == "done", up  # ranks 2 and 3: joiners this router started
    down = scale(server, 3)
    assert down["phase"] == "done", down  # rank 3 parked
    before = server.topology()
    assert before["active"] == [0, 1, 2]
    pids = {r["rank"]: r["pid"] for r in before["ranks"]}
    history = server.control("GET", "/operations").json()
    counted = counters(server)
    assert counted[("up", "done")] == 1 and counted[("down", "done")] == 1, counted
    old = router_pids(server)[-1]
    with Traffic(server, PROMPTS, MAX_TOKENS, clients=6) as traffic:
        time.sleep(2.0)
        served_before = len(traffic.results)
        os.kill(old, signal.SIGKILL)
        new = wait_router_back(server, old)
        time.sleep(2.0)
    assert new != old and not alive(old)
    assert f"adopted epoch {before['epoch']}: ranks [0, 1, 2] active, [3] parked, none stopped" in server.output
    after = server.topology()
    assert (after["epoch"], after["active"]) == (before["epoch"], before["active"])
    assert server.control("GET", "/operations").json() == history  # reloaded from its journal
    assert counters(server) == counted  # so are the counters
    ranks = {r["rank"]: r for r in after["ranks"]}
    assert {r: v["pid"] for r, v in ranks.items()} == pids  # no rank was replaced, none orphaned
    assert [ranks[r]["state"] for r in range(4)] == ["ACTIVE", "ACTIVE", "ACTIVE", "PARKED"]
    assert all(ranks[r]["routable"] for r in range(3))
    for r in (2, 3):
        assert_output_moved(pids[r])
    # Requests kept flowing while no router ran, and every one came back whole and exact.
    assert traffic.errors == []
    assert len(traffic.results) > served_before + 6
    assert [(p, text) for p, text, _, _ in traffic.results if text != reference[p]] == []
    # Not wedged: the next scale-up takes the adopted parked rank back.
    up = scale(server, 4)
    assert up["phase"] == "done" and up["error"] == "", up
    assert up["joined_from"] == {"3": "parked"}
    assert server.topology()["active"] == [0, 1, 2, 3]


def listening(pid: int) -> list[str]:
    """The local addresses (hex ip:port, as /proc/net/tcp writes them) the process listens on."""
    fds = Path(f"/proc/{pid}/fd")
    inodes = set()
    for fd in fds.iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # LISTEN
                found.append(f[1])
    return found


LOOPBACK = ("0100007F", "00000000000000000000000001000000")  # 127.0.0.1, ::1


def test_the_ranks_data_plane_listens_on_loopback_only(server):
    """UCX's TCP transport listens on every network device it may use; Worker.net_devices ("lo"
    by default) keeps those listeners, the ranks' NIXL data plane, off other interfaces."""
    for r in server.topology()["ranks"]:
        addrs = listening(r["pid"])
        assert addrs, r["rank"]
        assert [a for a in addrs if a.split(":")[0] not in LOOPBACK] == [], (r["rank"], addrs)


def test_a_commit_the_killed_router_left_half_done_is_completed_by_the_next(server, reference):
    """The joiner stalls in Configure (injected) while the serving ranks are paused and already
    configured for the new epoch: the router dies there. The next one finds the ranks on two
    epochs, paused, the joiner staged, and commits the newest topology again under a new epoch."""
    down = scale(server, 3)
    assert down["phase"] == "done", down  # rank 3 parks
    epoch = server.topology()["epoch"]
    counted = counters(server)
    r = server.control("POST", "/scale", json={"dp_size": 4, "fault": "stall_on=configure,stall_s=6"})
    assert r.status_code == 202, r.text
    with Traffic(server, PROMPTS, MAX_TOKENS, clients=6) as traffic:
        wait_phase(server, "committing")
        time.sleep(1.0)  # Configure reached the serving ranks; the joiner stalls in its own
        old = router_pids(server)[-1]
        os.kill(old, signal.SIGKILL)
        wait_router_back(server, old)
        time.sleep(2.0)
    assert f"committing it again as epoch {epoch + 2}" in server.output, server.tail(80)
    after = server.topology()
    assert (after["epoch"], after["active"]) == (epoch + 2, [0, 1, 2, 3])
    # The operation the killed router ran outlives it in the history, as interrupted, with what
    # the next router made of it; the ones before it are there too, and ids go on from there.
    ops = server.control("GET", "/operations").json()
    cut = ops[-1]
    assert (cut["kind"], cut["to_size"], cut["phase"]) == ("up", 4, "interrupted"), cut
    assert cut["error"] == (
        f"the router running it stopped in committing; the next one adopted epoch {epoch + 2}: "
        "ranks [0, 1, 2, 3] active, none parked, none stopped"
    ), cut
    assert [op["phase"] for op in ops[:-1]] == ["done"] * (len(ops) - 1) and len(ops) >= 4, ops
    assert counters(server) == {**counted, ("up", "interrupted"): 1}  # one more, the one cut short
    ranks = {r["rank"]: r for r in after["ranks"]}
    assert all(ranks[r]["state"] == "ACTIVE" and ranks[r]["routable"] and not ranks[r]["paused"] for r in range(4))
    assert traffic.errors == []
    assert [(p, text) for p, text, _, _ in traffic.results if text != reference[p]] == []
    down = scale(server, 3)
    assert down["phase"] == "done"
    assert int(down["id"].split("-")[1]) == int(cut["id"].split("-")[1]) + 1, (down["id"], cut["id"])


def test_a_stalled_router_is_found_hung_restarted_and_adopts_the_topology(server, reference):
    """SIGSTOP past its liveness deadline: `dynamo serve` finds its /health silent, kills it and
    starts another, which adopts; the ranks serve throughout, and the SIGCONT comes too late."""
    before = server.topology()
    pids = {r["rank"]: r["pid"] for r in before["ranks"]}
    old = router_pids(server)[-1]
    with Traffic(server, PROMPTS, MAX_TOKENS, clients=6) as traffic:
        time.sleep(2.0)
        served_before = len(traffic.results)
        os.kill(old, signal.SIGSTOP)
        wait_router_back(server, old)
        with pytest.raises(ProcessLookupError):
            os.kill(old, signal.SIGCONT)
        time.sleep(2.0)
    assert re.search(
        rf"Router \(pid {old}\) did not answer http://127\.0\.0\.1:\d+/health for \d+\.\d s: hung", server.output
    )
    after = server.topology()
    assert (after["epoch"], after["active"]) == (before["epoch"], before["active"])
    assert {r["rank"]: r["pid"] for r in after["ranks"]} == pids
    assert traffic.errors == []
    assert len(traffic.results) > served_before + 6
    assert [(p, text) for p, text, _, _ in traffic.results if text != reference[p]] == []
    assert scale(server, 3 if before["dp_size"] == 2 else 2)["phase"] == "done"


def test_a_scale_the_killed_router_left_unfinished_is_run_again_by_the_next(server, reference):
    """Killed while its joiner warms up (stalled there, injected): the next router stops that
    joiner with the rest of the operation, as an abort would, and runs the scale again toward the
    same target, once, with a new joiner; requests flow throughout."""
    size = server.topology()["dp_size"]
    r = server.control("POST", "/scale", json={"dp_size": size + 1, "fault": "stall_on=warmup,stall_s=30"})
    assert r.status_code == 202, r.text
    with Traffic(server, PROMPTS, MAX_TOKENS, clients=6) as traffic:
        wait_phase(server, "warming")
        old = router_pids(server)[-1]
        os.kill(old, signal.SIGKILL)
        wait_router_back(server, old)
        deadline = time.monotonic() + 120
        while (topo := server.topology())["scaling"] or topo["dp_size"] != size + 1:
            assert time.monotonic() < deadline, server.tail(80)
            time.sleep(0.2)
        time.sleep(1.0)
    ops = server.control("GET", "/operations").json()
    cut, again = ops[-2:]
    assert (cut["kind"], cut["to_size"], cut["phase"]) == ("up", size + 1, "interrupted"), cut
    assert (again["kind"], again["to_size"], again["phase"], again["resumes"]) == ("up", size + 1, "done", cut["id"])
    assert f"[op {again['id']}] takes up the target of op {cut['id']}, interrupted with its router" in server.output
    assert topo["active"] == list(range(size + 1))
    assert traffic.errors == []
    assert [(p, text) for p, text, _, _ in traffic.results if text != reference[p]] == []


@pytest.fixture
def restoring(server, tmp_path_factory):
    """A deployment whose joiners are restored from a criu-tier snapshot (the module's server
    stopped first: one graph at a time on this machine)."""
    from snapshot.bake import bake

    server.stop()
    root = tmp_path_factory.mktemp("snapshots")
    bake(root / "worker", tier="criu", max_ranks=2, progress=False)
    srv = Server(
        [
            "--Worker.max_ranks=2",
            "--Worker.dp_size=1",
            f"--Worker.snapshot_root={root}",
            "--Planner.enabled=false",
            "--Router.standby_copies=1",
        ]
    )
    try:
        yield srv
    finally:
        srv.stop()


def standby_copies(srv: Server) -> list[int]:
    """Pids of the standby copies the routers restored, in order."""
    return [int(p) for p in re.findall(r"standby copy pid (\d+) of snapshot .* ready", srv.output)]


def test_a_restored_joiner_outlives_the_router_and_is_adopted(restoring, reference):
    """A joiner restored from a snapshot image is tied to the graph, not to the router that
    restored it (as a cold joiner): the next router adopts it serving, and it ends with the graph.
    A standby copy (no rank yet) is the router's: it exits with it, and the next router restores
    its own."""
    srv = restoring
    up = scale(srv, 2)
    assert up["phase"] == "done" and up["joined_from"] == {"1": "snapshot"}, up["snapshot_refused"]
    before = srv.topology()
    pid = {r["rank"]: r["pid"] for r in before["ranks"]}[1]
    old = router_pids(srv)[-1]
    deadline = time.monotonic() + 60
    while len(standby_copies(srv)) < 2 and time.monotonic() < deadline:  # the one after the scale-up's
        time.sleep(0.1)
    copy = standby_copies(srv)[-1]
    assert alive(copy) and copy != pid
    with Traffic(srv, PROMPTS, MAX_TOKENS, clients=4) as traffic:
        time.sleep(1.0)
        os.kill(old, signal.SIGKILL)
        wait_router_back(srv, old)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # until the restored rank served under the new router
            ranks = {r["rank"]: r for r in srv.topology()["ranks"]}
            if ranks[1]["requests_total"] >= {r["rank"]: r for r in before["ranks"]}[1]["requests_total"] + 2:
                break
            time.sleep(0.2)
    assert f"adopted epoch {before['epoch']}: ranks [0, 1] active, none parked, none stopped" in srv.output
    after = {r["rank"]: r for r in srv.topology()["ranks"]}
    assert after[1]["pid"] == pid and after[1]["started_from"] == "snapshot" and after[1]["state"] == "ACTIVE"
    assert alive(pid)
    assert_output_moved(pid)
    assert traffic.errors == []
    assert [(p, text) for p, text, _, _ in traffic.results if text != reference[p]] == []
    assert gone_within(copy, 30)
    deadline = time.monotonic() + 60
    while standby_copies(srv)[-1] == copy and time.monotonic() < deadline:
        time.sleep(0.1)
    again = standby_copies(srv)[-1]
    assert again != copy and alive(again)
    srv.stop()
    assert gone_within(pid, 30) and gone_within(again, 30)
