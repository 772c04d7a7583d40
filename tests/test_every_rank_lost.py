"""Capacity lost beyond what a failover can mask: every serving rank killed (the router says so,
and rebuilds the deployment at its size from scratch, weights from the checkpoint), parked ranks
killed (dropped at once, never chosen for a scale-up), and a scale-up's joiner killed (retried
with a new joiner until the target is reached; `?wait=true` answers non-2xx when an operation
aborted)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from harness.server import Server, Traffic, engine_reference, failure_reasons, scale

MAX_TOKENS = 24
PROMPTS = [[5 + i, 17, 42 + i, 99, 7 * i + 3, 250] for i in range(12)]


@pytest.fixture(scope="module")
def reference():
    return engine_reference(PROMPTS, MAX_TOKENS)


def pids(srv: Server) -> dict[int, int]:
    return {r["rank"]: r["pid"] for r in srv.topology()["ranks"]}


def test_every_serving_rank_killed_is_rebuilt_at_its_size(reference):
    """Both ranks of a 2-rank deployment SIGKILLed 0.5 s apart under streaming load: the router
    says there is no serving rank (/health 503 with the reason, /topology no active rank, a
    completion 503 naming it, never 404), then rebuilds the deployment at 2 ranks from new
    processes loading the checkpoint. Every completion is the reference's; a request that
    failed got a clear reason, none hung; no operation spins; the next scale works."""
    srv = Server(["--Worker.max_ranks=4", "--Worker.dp_size=2", "--Planner.enabled=false"])
    try:
        old = pids(srv)
        outage: dict[str, object] = {}
        with Traffic(srv, PROMPTS, MAX_TOKENS, clients=4, error_pause_s=0.25) as clients:
            time.sleep(2.0)
            t0 = time.monotonic()
            os.kill(old[0], signal.SIGKILL)
            time.sleep(0.5)
            os.kill(old[1], signal.SIGKILL)
            deadline = time.monotonic() + 120
            while True:
                assert time.monotonic() < deadline, srv.tail(80)
                health = srv.control("GET", "/health")
                topo = srv.topology()
                if health.status_code == 503 and "down" not in outage:
                    outage["down"] = (health.json(), topo)
                    body = {"model": srv.model, "prompt": PROMPTS[0], "max_tokens": 4}
                    outage["completion"] = srv.http.post("/v1/completions", json=body)
                if health.status_code == 200 and "down" in outage and len(topo["active"]) == 2:
                    if not topo["scaling"]:
                        break
                time.sleep(0.1)
            back_s = time.monotonic() - t0
            served_after = len(clients.results)
            time.sleep(3.0)  # serving again: streams complete at 2 ranks
        health, topo = outage["down"]
        assert health["status"] == "no serving rank", health
        assert "every serving rank failed" in health["reason"], health
        assert topo["active"] == [], topo
        assert all(r["state"] != "ACTIVE" or r["pid"] not in old.values() for r in topo["ranks"]), topo
        completion = outage["completion"]
        assert completion.status_code == 503, completion.text
        assert "no serving rank" in completion.json()["message"], completion.text
        after = srv.topology()
        assert after["active"] == [0, 1] and after["dp_size"] == 2, after
        assert not set(pids(srv).values()) & set(old.values())  # new processes
        ops = srv.control("GET", "/operations").json()
        rebuilds = [op for op in ops if op["kind"] == "rebuild"]
        assert rebuilds and rebuilds[-1]["phase"] == "done", ops
        # Rank 0's failover may have committed before rank 1 died: masked by it, or by the rebuild.
        assert sorted(r for op in ops for r in op["masked"]) == [0, 1], ops
        assert len(ops) <= 6, [(op["id"], op["phase"], op["error"]) for op in ops]  # no spinning
        assert len(clients.results) > served_after  # streams completed after the rebuild
        assert not any(t.is_alive() for t in clients.threads)  # no request hung
        wrong = [(p, text) for p, text, _, _ in clients.results if text != reference[p]]
        assert wrong == []
        print(
            f"\nserving again at 2 ranks {back_s:.1f} s after the first kill; {len(clients.results)} completed, "
            f"{len(clients.errors)} failed: {failure_reasons(clients.errors)}"
        )
        for _, why in clients.errors:  # a clear reason each, never a 404
            assert "HTTP 404" not in why, why
            assert "no serving rank" in why or "stream error" in why or "HTTP 5" in why, why
        assert scale(srv, 3)["phase"] == "done"
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def server():
    srv = Server(
        ["--Worker.max_ranks=4", "--Worker.dp_size=2", "--Planner.enabled=false", "--Router.allow_fault_injection=true"]
    )
    try:
        yield srv
    finally:
        srv.stop()


def test_a_killed_parked_rank_is_dropped_and_never_chosen(server, reference):
    """Ranks 2 and 3 park after a scale-down; rank 3's process is SIGKILLed: it is gone from
    the topology at the router's next look, and the scale-up to 4 starts a new process for it
    (the healthy parked rank 2 comes back from parked) and ends done."""
    assert scale(server, 4)["phase"] == "done"
    down = scale(server, 2)
    assert down["phase"] == "done" and down["parked"] == [2, 3], down
    parked = pids(server)
    os.kill(parked[3], signal.SIGKILL)
    deadline = time.monotonic() + 30
    # The topology shows each rank's last reported status: rank 2's report after it parked can
    # come after the scale-down's reply (a fresh-clone run showed it LEAVING here). One reading
    # of the topology per check, so both conditions hold in the same one.
    while 3 in (states := {r["rank"]: r["state"] for r in server.topology()["ranks"]}) or states[2] != "PARKED":
        assert time.monotonic() < deadline, states
        time.sleep(0.1)
    up = scale(server, 4)
    assert up["phase"] == "done", up
    assert up["joined_from"] == {"2": "parked", "3": "cold"}, up
    assert server.topology()["active"] == [0, 1, 2, 3]
    assert pids(server)[2] == parked[2]
    assert server.stream_text(PROMPTS[1], MAX_TOKENS) == reference[1]
    assert scale(server, 2)["phase"] == "done"


def test_a_scale_up_whose_joiner_dies_retries_with_a_new_one(server, reference):
    """The joiner of a scale-up 2 -> 3 exits while it pulls its weights (injected): the same
    operation starts a new joiner for rank 2 (logged with its id, recorded in `joiner_retries`)
    and ends done at 3 ranks."""
    before = pids(server)
    assert 2 in before  # parked by the test before, or not: either way a new process follows
    up = scale(server, 3, fault="exit_on=pull_weights")
    assert up["phase"] == "done", up
    assert [(r["rank"], r["phase"]) for r in up["joiner_retries"]] == [(2, "loading")], up
    assert "died" in up["joiner_retries"][0]["error"], up
    assert server.topology()["active"] == [0, 1, 2]
    assert f"[op {up['id']}] joiner 2 died during loading" in server.output
    assert server.stream_text(PROMPTS[2], MAX_TOKENS) == reference[2]
    assert scale(server, 2)["phase"] == "done"


def test_wait_true_answers_500_with_the_record_when_the_operation_aborted(server):
    """A scale-up whose joiner's pull fails its checksum (no death: nothing to retry) aborts;
    `POST /scale?wait=true` says so with a 500 and the record, not a 200."""
    r = server.control("POST", "/scale?wait=true", json={"dp_size": 3, "fault": "corrupt_pull"}, timeout=300)
    assert r.status_code == 500, r.text
    rec = r.json()
    assert rec["phase"] == "aborted" and "checksum mismatch" in rec["error"], rec
    assert server.topology()["active"] == [0, 1]
