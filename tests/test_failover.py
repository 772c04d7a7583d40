"""A serving rank that dies or stalls under load: the router finds it within seconds, fences it,
masks it out (its experts reloaded on the survivors), and asks for a replacement; every accepted
request completes with the tokens a static deployment gives, and the next scale works."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from harness.server import Server, Traffic, engine_reference, scale

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


@pytest.mark.parametrize("fault", ["SIGKILL", "SIGSTOP"])
def test_a_failed_serving_rank_is_replaced_under_load_and_nothing_is_lost(server, reference, fault):
    rank = 1
    pid, before = pid_of(server, rank), operation_ids(server)
    with Traffic(server, PROMPTS, MAX_TOKENS, clients=6) as traffic:
        time.sleep(2.0)
        os.kill(pid, getattr(signal, fault))
        failover, topo = wait_for_failover(server, rank, before)
        time.sleep(2.0)
    assert failover["phase"] == "done" and failover["error"] == "", (failover["error"], failover["phases"])
    assert topo["dp_size"] == 3, topo
    assert topo["active"] == [0, 1, 2], server.control("GET", "/operations").text
    assert pid_of(server, rank) != pid  # a new process took rank 1
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # the stalled one was fenced: it can never serve an old epoch again
    assert traffic.errors == []
    assert len(traffic.results) > 12
    bad = [(p, text, reference[p]) for p, text, _, _ in traffic.results if text != reference[p]]
    assert bad == []
    # Not wedged: the next scale works both ways.
    assert scale(server, 2)["phase"] == "done"
    assert scale(server, 3)["phase"] == "done"


@pytest.mark.parametrize("command", ["warmup", "pull_weights"])
def test_a_serving_rank_killed_during_a_scale_up_is_failed_over_first(server, reference, command):
    """Rank 1 dies while a scale-up 3 -> 4's joiner warms up, or pulls its weights from ranks
    0-2 (rank 1 among them; the joiner holds its reads back, injected): the scale-up gives way at
    once (aborted, its joiner gone), the failover masks rank 1 out, and then the scale-up runs
    again, which also replaces rank 1. Nothing is lost, every token is right, no wedge."""
    assert server.topology()["active"] == [0, 1, 2]
    pid, before = pid_of(server, 1), operation_ids(server)
    stalled = f"injected fault: stalling {command}"
    seen = server.output.count(stalled)
    with Traffic(server, PROMPTS, MAX_TOKENS, clients=6) as traffic:
        time.sleep(1.0)
        r = server.control("POST", "/scale", json={"dp_size": 4, "fault": f"stall_on={command},stall_s=5"})
        assert r.status_code == 202, r.text
        deadline = time.monotonic() + 120
        while server.output.count(stalled) == seen:
            assert time.monotonic() < deadline, server.tail(60)
            time.sleep(0.02)
        os.kill(pid, signal.SIGKILL)
        while True:
            ops = [op for op in server.control("GET", "/operations").json() if op["id"] not in before]
            if len(ops) == 3 and ops[-1]["total_s"] is not None and not server.topology()["scaling"]:
                break
            assert time.monotonic() < deadline, (ops, server.tail(60))
            time.sleep(0.2)
        time.sleep(1.0)
    up, failover, again = ops
    assert (up["kind"], up["phase"], up["to_size"]) == ("up", "aborted", 4), up
    assert "rank 1 " in up["error"], up["error"]
    assert (failover["kind"], failover["leaving"], failover["phase"]) == ("failover", [1], "done"), failover
    assert (again["kind"], again["from_size"], again["to_size"], again["phase"]) == ("up", 2, 4, "done"), again
    assert sorted(again["joiners"]) == [1, 3]
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
    assert server.topology()["active"] == [0, 1, 2]
    pid, before = pid_of(server, 1), operation_ids(server)
    stalled, timed_out, abandoned = "injected fault: stalling resume", "timed out after", "rank 1 declared gone"
    seen, seen_timeouts, seen_abandoned = (server.output.count(s) for s in (stalled, timed_out, abandoned))
    with Traffic(server, PROMPTS, MAX_TOKENS, clients=6) as traffic:
        time.sleep(1.0)
        r = server.control("POST", "/scale", json={"dp_size": 4, "fault": "stall_on=resume,stall_s=8"})
        assert r.status_code == 202, r.text
        deadline = time.monotonic() + 120
        while server.output.count(stalled) == seen:
            assert time.monotonic() < deadline, server.tail(60)
            time.sleep(0.02)
        os.kill(pid, signal.SIGKILL)
        while True:
            ops = [op for op in server.control("GET", "/operations").json() if op["id"] not in before]
            if len(ops) == 2 and ops[-1]["total_s"] is not None and not server.topology()["scaling"]:
                break
            assert time.monotonic() < deadline, (ops, server.tail(60))
            time.sleep(0.2)
        time.sleep(1.0)
    up, again = ops
    assert (up["kind"], up["phase"], up["masked"]) == ("up", "rolled_back", [1]), up
    assert "serving rank 1 failed during committing" in up["error"], up["error"]
    assert (again["kind"], again["from_size"], again["to_size"], again["phase"]) == ("up", 2, 4, "done"), again
    assert sorted(again["joiners"]) == [1, 3]
    output = server.output
    rolled = rf"\[op {up['id']}\] rolling back to ranks \[0, 2\] at epoch (\d+): .*; masking out ranks \[1\]"
    rollback = re.search(rolled, output)
    assert rollback, server.tail(80)
    for r in (0, 2):  # the survivors installed the rollback's epoch without rank 1
        assert re.search(rf"ep-{r}-\d+: epoch {rollback.group(1)} active \(0, 2\)", output), r
    assert output.count(abandoned) > seen_abandoned  # the survivors gave up on it at once
    assert output.count(timed_out) == seen_timeouts  # and never waited for it
    assert server.topology()["active"] == [0, 1, 2, 3]
    assert traffic.errors == []
    assert [(p, text) for p, text, _, _ in traffic.results if text != reference[p]] == []
    assert scale(server, 3)["phase"] == "done"
