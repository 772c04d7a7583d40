"""A serving rank that dies or stalls under load: the router finds it within seconds, fences it,
masks it out (its experts reloaded on the survivors), and asks for a replacement; every accepted
request completes with the tokens a static deployment gives, and the next scale works. A serving
rank that fails as the source of a pull: a scale-up masks it out itself and re-pulls its reads
from the survivors; other operations make the pullers drop it at once and give way."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from components.worker.component import FAULT_ENV
from harness.server import Server, Traffic, alive, engine_reference, scale, streamer_of

MAX_TOKENS = 24
PROMPTS = [[5 + i, 17, 42 + i, 99, 7 * i + 3, 250] for i in range(12)]


@pytest.fixture(scope="module")
def server():
    srv = Server(
        ["--Worker.max_ranks=4", "--Worker.dp_size=3", "--Planner.enabled=false", "--Router.allow_fault_injection=true"]
    )
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def reference():
    return engine_reference(PROMPTS, MAX_TOKENS)


def operation_ids(srv: Server) -> set[str]:
    return {op["id"] for op in srv.control("GET", "/operations").json()}


def wait_for_failover(srv: Server, rank: int, before: set[str], timeout: float = 120) -> tuple[dict, dict]:
    """The failover that masked `rank` out (not one of the operations `before`), and the topology
    once its replacement serves."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ops = [op for op in srv.control("GET", "/operations").json() if op["id"] not in before]
        failover = next((op for op in ops if op["kind"] == "failover" and op["leaving"] == [rank]), None)
        topo = srv.topology()
        if failover and failover["phase"] != "queued" and failover["total_s"] and not topo["scaling"]:
            return failover, topo
        time.sleep(0.2)
    raise AssertionError(f"no failover of rank {rank} within {timeout} s: {srv.control('GET', '/operations').text}")


def pid_of(srv: Server, rank: int) -> int:
    topo = srv.topology()
    pids = [r["pid"] for r in topo["ranks"] if r["rank"] == rank]
    if not pids:
        Path("/tmp/failover-debug.json").write_text(srv.control("GET", "/operations").text)
        Path("/tmp/failover-debug.log").write_text(srv.output)
    assert pids, (topo, srv.control("GET", "/operations").text)
    return pids[0]


# First in the module: its own graph runs and stops before the module's shared one starts.
@pytest.fixture
def slow_pulls():
    """Two expert slots per rank (min_ranks 2), so a leaving rank holds experts no other rank
    does and a scale-down pulls them from it; every rank the graph starts with holds each pull
    back 2 s (injected through the graph's environment): a window to stall its source in."""
    srv = Server(
        ["--Worker.max_ranks=4", "--Worker.dp_size=3", "--Worker.min_ranks=2", "--Planner.enabled=false"],
        env={FAULT_ENV: "stall_on=pull_weights,stall_s=2"},
    )
    try:
        yield srv
    finally:
        srv.stop()


def test_a_serving_ranks_pull_drops_its_stalled_source_when_the_router_fails_it(slow_pulls, reference):
    """A scale-down 3 -> 2: ranks 0 and 1 pull what only leaving rank 2 holds, which stalls
    (SIGSTOP) as they start: a stalled source never fails a READ, so they would wait for it until
    their pull's timeout (60 s). Once the router finds rank 2 failed, they are told to drop it and
    their pulls end, the scale-down gives way, the failover masks rank 2 out. Nothing is lost,
    every token is right, no wedge."""
    srv = slow_pulls
    pid, before = pid_of(srv, 2), operation_ids(srv)
    with Traffic(srv, PROMPTS, MAX_TOKENS, clients=6) as traffic:
        time.sleep(1.0)
        r = srv.control("POST", "/scale", json={"dp_size": 2})
        assert r.status_code == 202, r.text
        deadline = time.monotonic() + 120
        while "injected fault: stalling pull_weights" not in srv.output:
            assert time.monotonic() < deadline, srv.tail(60)
            time.sleep(0.02)
        os.kill(pid, signal.SIGSTOP)
        while True:
            ops = [op for op in srv.control("GET", "/operations").json() if op["id"] not in before]
            if len(ops) == 2 and ops[-1]["total_s"] is not None and not srv.topology()["scaling"]:
                break
            assert time.monotonic() < deadline + 60, (ops, srv.tail(60))
            time.sleep(0.2)
        time.sleep(1.0)
    down, failover = ops
    assert (down["kind"], down["phase"]) == ("down", "aborted"), down
    assert down["error"] == "ScaleError: serving rank 2 failed during migrating: the failover goes first"
    losses = down["pull_losses"]
    assert losses and {loss["source"] for loss in losses} == {2} and {loss["rank"] for loss in losses} <= {0, 1}
    assert all(loss["reason"] == "rank 2 failed: its readers dropped it, and the operation gave way" for loss in losses)
    assert (failover["kind"], failover["leaving"], failover["phase"]) == ("failover", [2], "done"), failover
    assert srv.topology()["active"] == [0, 1]
    # Each puller gave up on rank 2 as it was told, not at its timeout.
    for loss in losses:
        said = f"rank {loss['rank']}: {len(loss['items'])} tensors not pulled, source rank 2 lost: rank 2: dropped"
        while said not in srv.output:
            assert time.monotonic() < deadline + 120, srv.tail(60)
            time.sleep(0.2)
    assert "did not finish within" not in srv.output
    assert traffic.errors == []
    assert [(p, text) for p, text, _, _ in traffic.results if text != reference[p]] == []
    assert scale(srv, 3)["phase"] == "done"


@pytest.fixture
def slotted(request):
    """3 ranks of 4 expert slots (min_ranks 2) and `request.param` redundant experts: with 4, six
    slots, and each of the 8 experts is on two ranks or three. No EPLB after a scale: the
    placement is the one to check."""
    srv = Server(
        [
            "--Worker.max_ranks=3",
            "--Worker.dp_size=3",
            "--Worker.min_ranks=2",
            f"--Worker.redundant_experts={request.param}",
            "--Planner.enabled=false",
            "--Router.rebalance=false",
        ]
    )
    try:
        yield srv
    finally:
        srv.stop()


def holders(topo: dict) -> dict[int, set[int]]:
    """Expert -> the active ranks that hold it (layer 0; every layer's row is the same)."""
    out: dict[int, set[int]] = {}
    for r in topo["ranks"]:
        if r["rank"] in topo["active"]:
            for e in r["experts_layer0"]:
                out.setdefault(e, set()).add(r["rank"])
    return out


@pytest.mark.parametrize("slotted, from_disk", [(4, 0), (0, 8)], indirect=["slotted"], ids=["replicas", "none"])
def test_a_failed_ranks_experts_are_served_by_their_replicas_and_rebuilt_from_peers(slotted, from_disk, reference):
    """SIGKILL of rank 1 under load. With replicas the survivors hold a copy of every expert it
    held, so the failover reads nothing from the checkpoint, and its replacement pulls the experts
    left on one rank from the survivors: every expert is on two ranks again. Without, the 2
    experts only rank 1 held are loaded from the checkpoint (in each of the 4 layers). Nothing
    lost, every token right."""
    srv = slotted
    copies = 2 if from_disk == 0 else 1  # each expert is on this many ranks before and after
    assert min(len(ranks) for ranks in holders(srv.topology()).values()) == copies
    pid, before = pid_of(srv, 1), operation_ids(srv)
    with Traffic(srv, PROMPTS, MAX_TOKENS, clients=6) as traffic:
        time.sleep(2.0)
        os.kill(pid, signal.SIGKILL)
        failover, topo = wait_for_failover(srv, 1, before)
        time.sleep(2.0)
    assert failover["phase"] == "done" and failover["error"] == "", (failover["error"], failover["phases"])
    assert failover["experts_from_disk"] == from_disk and failover["pulled_from"] == {}, failover
    assert ("experts loaded from the checkpoint where the map changed" in srv.output) == (from_disk > 0)
    up = next(op for op in srv.control("GET", "/operations").json() if op["id"] not in before | {failover["id"]})
    assert (up["kind"], up["joiners"], up["phase"], up["experts_from_disk"]) == ("up", [1], "done", 0), up
    assert set(up["pulled_from"]) == {"1"} and set(up["pulled_from"]["1"]) <= {"0", "2"}, up["pulled_from"]
    assert topo["active"] == [0, 1, 2]
    assert {e: len(ranks) >= copies for e, ranks in holders(topo).items()} == {e: True for e in range(8)}
    assert traffic.errors == []
    assert len(traffic.results) > 12
    assert [(p, text) for p, text, _, _ in traffic.results if text != reference[p]] == []


@pytest.mark.parametrize("fault, lost", [("killed", 1), ("stopped", 1), ("killed", 0)])
def test_a_first_rank_lost_while_loading_is_replaced_while_the_others_serve(reference, fault, lost):
    """A rank of the first group is killed as it loads (the OOM killer, say), or hangs there
    (stopped), and never registers: epoch 1 forms of the other, which serves at once (a hung rank
    `bootstrap_timeout_s` after the other registered, and SIGKILLed then), and a scale-up brings a
    new rank of its number in; not a router waiting for a rank that will never come, restarted into
    the same wait. Every token right under load throughout."""
    kept = 1 - lost
    srv = Server(
        ["--Worker.max_ranks=4", "--Worker.dp_size=2", "--Planner.enabled=false", "--Router.bootstrap_timeout_s=3"],
        env={FAULT_ENV: f"{fault}_loading={lost}"},
    )
    try:
        with Traffic(srv, PROMPTS, MAX_TOKENS, clients=4) as traffic:
            deadline = time.monotonic() + 120
            while (topo := srv.topology())["active"] != [0, 1] or topo["scaling"]:
                assert time.monotonic() < deadline, (topo, srv.tail())
                time.sleep(0.2)
            time.sleep(1.0)
        ops = srv.control("GET", "/operations").json()
        output = srv.output
    finally:
        srv.stop()
    assert [(op["kind"], op["joiners"], op["phase"]) for op in ops] == [("up", [lost], "done")], ops
    assert re.search(rf"component Worker\.{lost} \(pid \d+\) was killed by signal SIGKILL", output), output
    hung = f"ranks [{lost}] did not register within 3 s of the first: stopping them (SIGKILL)" in output
    assert hung == (fault == "stopped"), output
    assert f"epoch 1: ranks [{kept}] active and routable" in output
    assert f"ranks [{lost}] lost before registering: scaling up to 2 ranks with new ones" in output
    assert traffic.errors == []
    assert len(traffic.results) >= len(PROMPTS)
    assert [(p, text) for p, text, _, _ in traffic.results if text != reference[p]] == []


def test_requests_that_reach_a_rank_after_it_left_routing_are_sent_on(reference):
    """A scale-down whose leaving rank stays listed 1.5 s after it stops taking requests (the
    frontend's list lagging the leave, which once left such a request waiting for the parked rank
    to be routable again until the client gave up): each goes on on the remaining rank, every
    completion the engine's own."""
    srv = Server(
        ["--Worker.max_ranks=2", "--Worker.dp_size=2", "--Planner.enabled=false"],
        env={FAULT_ENV: "leave_lag_s=1.5"},
    )
    try:
        with Traffic(srv, PROMPTS, MAX_TOKENS, clients=6) as traffic:
            time.sleep(1.0)
            assert scale(srv, 1)["phase"] == "done"
            time.sleep(1.0)
        output = srv.output
    finally:
        srv.stop()
    assert re.search(r"rank 1: out of routing: a request sent on to instance [0-9a-f]+", output), output
    assert traffic.errors == []
    assert len(traffic.results) >= len(PROMPTS)
    assert [(p, text) for p, text, _, _ in traffic.results if text != reference[p]] == []


@pytest.mark.parametrize("fault", ["SIGKILL", "SIGSTOP", "streamer SIGKILL"])
def test_a_failed_serving_rank_is_replaced_under_load_and_nothing_is_lost(server, reference, fault):
    """The rank's process killed or stalled, or its streaming process killed (the rank exits with
    it): either way neither process of the rank is left, and its requests complete elsewhere."""
    rank = 1
    pid, before = pid_of(server, rank), operation_ids(server)
    streamer = streamer_of(pid)
    with Traffic(server, PROMPTS, MAX_TOKENS, clients=6) as traffic:
        time.sleep(2.0)
        os.kill(streamer if fault.startswith("streamer") else pid, getattr(signal, fault.split()[-1]))
        failover, topo = wait_for_failover(server, rank, before)
        time.sleep(2.0)
    assert failover["phase"] == "done" and failover["error"] == "", (failover["error"], failover["phases"])
    assert topo["dp_size"] == 3, topo
    assert topo["active"] == [0, 1, 2], server.control("GET", "/operations").text
    assert pid_of(server, rank) != pid  # a new process took rank 1
    # The stalled one was fenced: it can never serve an old epoch again.
    assert not alive(pid) and not alive(streamer)
    if fault.startswith("streamer"):
        assert f"rank {rank}: its streaming process exited (-9); exiting" in server.output
    assert traffic.errors == []
    assert len(traffic.results) > 12
    bad = [(p, text, reference[p]) for p, text, _, _ in traffic.results if text != reference[p]]
    assert bad == []
    # Not wedged: the next scale works both ways.
    assert scale(server, 2)["phase"] == "done"
    assert scale(server, 3)["phase"] == "done"


def scale_up_with_rank_1_killed(
    server: Server, command: str, stall_s: float, operations: int
) -> tuple[list[dict], Traffic]:
    """Scale 3 -> 4 under load with the joiner holding `command` back `stall_s` (injected), SIGKILL
    rank 1 as it starts to; returns the operations from there until the deployment is idle again
    with `operations` of them (or more), and the traffic."""
    assert server.topology()["active"] == [0, 1, 2]
    pid, before = pid_of(server, 1), operation_ids(server)
    stalled = f"injected fault: stalling {command}"
    seen = server.output.count(stalled)
    with Traffic(server, PROMPTS, MAX_TOKENS, clients=6) as traffic:
        time.sleep(1.0)
        r = server.control("POST", "/scale", json={"dp_size": 4, "fault": f"stall_on={command},stall_s={stall_s}"})
        assert r.status_code == 202, r.text
        deadline = time.monotonic() + 120
        while server.output.count(stalled) == seen:
            assert time.monotonic() < deadline, server.tail(60)
            time.sleep(0.02)
        os.kill(pid, signal.SIGKILL)
        while True:
            ops = [op for op in server.control("GET", "/operations").json() if op["id"] not in before]
            finished = ops and ops[-1]["total_s"] is not None and not server.topology()["scaling"]
            if finished and len(ops) >= operations:
                break
            assert time.monotonic() < deadline + 120, (ops, server.tail(60))
            time.sleep(0.2)
        time.sleep(1.0)
    return ops, traffic


def test_a_killed_ranks_listing_in_discovery_goes_with_it():
    """A SIGKILLed rank leaves its instances in discovery (a file entry outlives its process by
    10 s), and the frontend, which drops an instance it cannot reach, lists it again at the next
    change to the listing: the replacement's. The failover takes them out, so with the frontend's
    migration off, not one request fails once the replacement serves."""
    srv = Server(["--Worker.max_ranks=4", "--Planner.enabled=false", "--Frontend.migration_limit=0"])
    try:
        dead = next(v for v in srv.topology()["ranks"] if v["rank"] == 1)
        before = operation_ids(srv)
        os.kill(dead["pid"], signal.SIGKILL)
        failover, _ = wait_for_failover(srv, 1, before)
        listed = [p.name for p in (srv.discovery_dir / "v1" / "instances").iterdir()]
        assert not [n for n in listed if n.endswith(f"%2F{dead['instance_id']:x}")], listed
        failed = []
        for i in range(40):
            try:
                srv.stream_text(PROMPTS[i % len(PROMPTS)], 4)
            except Exception as e:  # counted: none may fail
                failed.append(repr(e))
        line = f"[op {failover['id']}] rank 1's instances out of discovery: worker.control "
        assert line in srv.output and f"worker.generate {dead['instance_id']:x}" in srv.output
    finally:
        srv.stop()
    assert failed == []


def test_a_serving_rank_killed_during_a_scale_up_is_failed_over_first(server, reference):
    """Rank 1 dies while a scale-up 3 -> 4's joiner warms up: the scale-up gives way at once
    (aborted, its joiner gone), the failover masks rank 1 out, and then the scale-up runs again,
    which also replaces rank 1. Nothing is lost, every token is right, no wedge."""
    ops, traffic = scale_up_with_rank_1_killed(server, "warmup", 5, operations=3)
    assert len(ops) == 3, server.story(ops)
    up, failover, again = ops
    assert (up["kind"], up["phase"], up["to_size"], up["masked"]) == ("up", "aborted", 4, []), up
    assert "rank 1 " in up["error"], up["error"]
    assert (failover["kind"], failover["leaving"], failover["phase"]) == ("failover", [1], "done"), failover
    assert failover["masked"] == [1], failover
    assert (again["kind"], again["from_size"], again["to_size"], again["phase"]) == ("up", 2, 4, "done"), again
    assert sorted(again["joiners"]) == [1, 3]
    assert server.topology()["active"] == [0, 1, 2, 3]
    assert traffic.errors == []
    assert [(p, text) for p, text, _, _ in traffic.results if text != reference[p]] == []
    assert scale(server, 3)["phase"] == "done"


def test_a_source_killed_mid_pull_is_masked_out_by_the_scale_up_which_repulls_its_reads(server, reference):
    """Rank 1 dies while a scale-up 3 -> 4's joiner holds its pull back (5 s, injected), rank 1
    among the ranks it reads from: the joiner is told to drop rank 1, and the same scale-up masks
    rank 1 out itself (the survivors serve on meanwhile), reads what rank 1 was to send from ranks
    0 and 2 instead (checksummed like the rest), and ends done with ranks 0, 2 and 3. A scale-up
    then replaces rank 1. Nothing is lost, every token is right, no wedge."""
    ops, traffic = scale_up_with_rank_1_killed(server, "pull_weights", 5, operations=2)
    up, again = ops
    assert (up["kind"], up["phase"], up["error"], up["joiners"]) == ("up", "done", "", [3]), up
    assert up["masked"] == [1] and up["failover_committed_at"] is not None, up
    losses = up["pull_losses"]
    assert losses and {(loss["rank"], loss["source"]) for loss in losses} == {(3, 1)}, losses
    for loss in losses:
        assert "rank 1" in loss["reason"], loss
        assert {int(r) for r in loss["repulled_from"]} <= {0, 2} and loss["repulled_from"], loss
        assert sorted(n for names in loss["repulled_from"].values() for n in names) == sorted(loss["items"]), loss
    assert (again["kind"], again["from_size"], again["to_size"], again["phase"]) == ("up", 3, 4, "done"), again
    assert again["joiners"] == [1]
    assert server.topology()["active"] == [0, 1, 2, 3]
    assert traffic.errors == []
    assert [(p, text) for p, text, _, _ in traffic.results if text != reference[p]] == []
    assert scale(server, 3)["phase"] == "done"


def test_a_serving_rank_killed_inside_a_commit_is_masked_out_by_the_rollback(server, reference):
    """Rank 1 dies inside the commit of a scale-up 3 -> 4: ranks 0-2 resumed at the new epoch and
    wait in a collective for the joiner, which holds its own Resume back (injected). The commit
    gives way, and its rollback, told rank 1 is gone, lets the survivors give up on it at once
    and installs the old set without it (fenced, its experts reloaded on the survivors): no epoch
    after the kill lists rank 1. The scale-up then runs again and also replaces rank 1. Nothing is
    lost, every token is right, no wedge."""
    timed_out, abandoned = "timed out after", "ranks [1] declared gone"
    seen_timeouts, seen_abandoned = (server.output.count(s) for s in (timed_out, abandoned))
    ops, traffic = scale_up_with_rank_1_killed(server, "resume", 8, operations=2)
    assert len(ops) == 2, server.story(ops)
    up, again = ops
    assert (up["kind"], up["phase"], up["masked"]) == ("up", "rolled_back", [1]), up
    # Whichever sees it first (its provider's process watch or the router's status round), the
    # commit gives way to it, and the scale-up's target stands.
    assert re.fullmatch(
        r"ScaleError: serving rank 1 failed during committing: rolled back without it at epoch \d+", up["error"]
    ), up["error"]
    assert (again["kind"], again["from_size"], again["to_size"], again["phase"]) == ("up", 2, 4, "done"), again
    assert sorted(again["joiners"]) == [1, 3]
    output = server.output
    rolled = rf"\[op {up['id']}\] rolling back to ranks \[0, 2\] at epoch (\d+): .*; masking out ranks \[1\]"
    rollback = re.search(rolled, output)
    assert rollback, server.tail(80)
    for r in (0, 2):  # the survivors installed the rollback's epoch without rank 1
        assert re.search(rf"\[op {up['id']}\] rank {r}: epoch {rollback.group(1)}, active \[0, 2\]", output), r
    assert output.count(abandoned) > seen_abandoned  # the survivors gave up on it at once
    assert output.count(timed_out) == seen_timeouts  # and never waited for it
    assert server.topology()["active"] == [0, 1, 2, 3]
    assert traffic.errors == []
    assert [(p, text) for p, text, _, _ in traffic.results if text != reference[p]] == []
    assert scale(server, 3)["phase"] == "done"


def wait_until_idle_at(server: Server, active: list[int], before: set[str], deadline: float) -> list[dict]:
    """The operations since `before`, once the deployment is idle with `active` serving."""
    while True:
        ops = [op for op in server.control("GET", "/operations").json() if op["id"] not in before]
        topo = server.topology()
        if ops and ops[-1]["total_s"] is not None and not topo["scaling"] and topo["active"] == active:
            return ops
        assert time.monotonic() < deadline, server.story(ops)
        time.sleep(0.2)


def test_two_serving_ranks_killed_at_once_are_both_failed_over_and_replaced(server, reference):
    """Ranks 1 and 2 of four SIGKILLed in the same instant under load: both are masked out (by
    one failover, or by a failover that gives way to the second and the one after it), the
    survivors serve on, and the deployment is back at four ranks. Every stream ends with the
    tokens the same request gets alone (those on the dead ranks re-run by the frontend), nothing
    is lost, and the next scale works."""
    assert scale(server, 4)["phase"] == "done"
    pids, before = [pid_of(server, r) for r in (1, 2)], operation_ids(server)
    with Traffic(server, PROMPTS, MAX_TOKENS, clients=6) as traffic:
        time.sleep(2.0)
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        ops = wait_until_idle_at(server, [0, 1, 2, 3], before, time.monotonic() + 180)
        time.sleep(1.0)
    failovers = [op for op in ops if op["kind"] == "failover"]
    assert failovers and failovers[-1]["phase"] == "done", server.story(ops)
    masked = {r for op in ops for r in op["masked"]}
    assert masked == {1, 2}, server.story(ops)
    assert ops[-1]["kind"] == "up" and ops[-1]["phase"] == "done" and ops[-1]["to_size"] == 4, server.story(ops)
    assert all(pid_of(server, r) != pid for r, pid in zip((1, 2), pids))  # new processes took 1 and 2
    assert not any(map(alive, pids))
    assert traffic.errors == []
    assert any(t0 < failovers[-1]["committed_at"] < t1 for _, _, t0, t1 in traffic.results)  # streams ran across it
    assert [(p, text) for p, text, _, _ in traffic.results if text != reference[p]] == []
    assert scale(server, 3)["phase"] == "done"


def test_a_source_killed_mid_transfer_is_masked_out_and_its_reads_come_from_the_others(server, reference):
    """A scale-up 3 -> 4 whose joiner, its pull under way (its first READ posted), holds the
    READs from its other sources back (injected): one of those sources is SIGKILLed then. The
    joiner's READs from it fail (or it was told to drop it first), the scale-up masks it out
    itself and reads what it was to send from the survivors, and ends done at three; a scale-up
    then replaces the dead rank. Nothing is lost, every token is right, no wedge."""
    assert server.topology()["active"] == [0, 1, 2]
    before = operation_ids(server)
    stalled = re.compile(
        r"injected fault: stalling mid-pull [\d.]+ s: READ from rank (\d+) posted, from ranks \[([\d, ]+)\] not yet"
    )
    seen = len(stalled.findall(server.output))
    with Traffic(server, PROMPTS, MAX_TOKENS, clients=6) as traffic:
        time.sleep(1.0)
        r = server.control("POST", "/scale", json={"dp_size": 4, "fault": "stall_mid_pull=5"})
        assert r.status_code == 202, r.text
        deadline = time.monotonic() + 120
        while len(found := stalled.findall(server.output)) == seen:
            assert time.monotonic() < deadline, server.tail(60)
            time.sleep(0.02)
        first, waiting = int(found[-1][0]), [int(w) for w in found[-1][1].split(", ")]
        victim = waiting[0]
        os.kill(pid_of(server, victim), signal.SIGKILL)
        ops = wait_until_idle_at(server, [0, 1, 2, 3], before, deadline + 120)
        time.sleep(1.0)
    assert len(ops) == 2, server.story(ops)
    up, again = ops
    survivors = sorted({0, 1, 2} - {victim})
    assert (up["kind"], up["phase"], up["error"], up["joiners"]) == ("up", "done", "", [3]), server.story(ops)
    assert up["masked"] == [victim] and up["failover_committed_at"] is not None, up
    losses = up["pull_losses"]
    assert losses and {(loss["rank"], loss["source"]) for loss in losses} == {(3, victim)}, losses
    for loss in losses:
        assert f"rank {victim}" in loss["reason"], loss
        assert loss["repulled_from"] and {int(r) for r in loss["repulled_from"]} <= set(survivors), loss
        assert sorted(n for names in loss["repulled_from"].values() for n in names) == sorted(loss["items"]), loss
    assert first in survivors
    assert (again["kind"], again["from_size"], again["to_size"], again["phase"]) == ("up", 3, 4, "done"), again
    assert again["joiners"] == [victim]
    assert traffic.errors == []
    assert [(p, text) for p, text, _, _ in traffic.results if text != reference[p]] == []
    assert scale(server, 3)["phase"] == "done"


def test_a_rank_that_dies_after_a_streams_last_token_leaves_the_client_one_complete_stream(server, reference):
    """A rank that exits once a stream's last chunk is out, before the stream closes (injected
    into a joiner): Dynamo's frontend migrates the request with max_tokens reduced by the tokens it
    got, to 0, which the worker once refused ("max_tokens must be at least 1", CI's failure in
    test_a_failed_ranks_experts_are_served_by_their_replicas_and_rebuilt_from_peers). Every
    stream ends with the reference tokens and one finish_reason; the rank is failed over."""
    assert server.topology()["active"] == [0, 1, 2]
    before = operation_ids(server)
    assert scale(server, 4, fault="exit_after_finish")["phase"] == "done"
    with Traffic(server, PROMPTS, MAX_TOKENS, clients=6) as traffic:
        failover, topo = wait_for_failover(server, 3, before)
        time.sleep(1.0)
    assert "rank 3: injected fault: exiting after finishing" in server.output
    assert failover["phase"] == "done", (failover["error"], failover["phases"])
    assert traffic.errors == []
    assert [(p, text) for p, text, _, _ in traffic.results if text != reference[p]] == []
    assert scale(server, 3)["phase"] == "done"
