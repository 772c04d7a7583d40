"""Elastic scaling end to end: `dynamo serve graphs/elastic:Frontend`, streaming OpenAI clients,
scale 2 -> 4 -> 3 -> 2 through the router's API; a joiner that dies is replaced, other failures
injected into joiners abort cleanly.

Greedy outputs are judged token for token against the single-rank in-process engine."""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from components.graph.spawn import ROUTE_NOISE
from components.planner.service import parse_prometheus
from harness.server import Server, alive, engine_reference, freeze, scale, scale_under_traffic
from harness.server import Traffic as _Traffic

MAX_TOKENS = 24
LONG_TOKENS = 160  # a stream of these lasts seconds on CPU
PROMPTS = [[5 + i, 17, 42 + i, 99, 7 * i + 3, 250] for i in range(12)]


@pytest.fixture(scope="module")
def server():
    srv = Server(
        [
            "--Worker.max_ranks=4",
            "--Router.allow_fault_injection=true",
            "--Router.commit_timeout_s=4",
            "--Router.prepare_timeout_s=60",
            "--Router.drain_timeout_s=20",
        ]
    )
    try:
        yield srv
    finally:
        srv.stop()


def Traffic(srv: Server, clients: int = 4) -> _Traffic:
    return _Traffic(srv, PROMPTS, MAX_TOKENS, clients)


@pytest.fixture(scope="module")
def reference():
    return engine_reference(PROMPTS, MAX_TOKENS)


def test_scale_under_traffic_loses_nothing(server, reference):
    ops, kv_usage = scale_under_traffic(server, (4, 3, 2), traffic := Traffic(server), reference)
    assert len(traffic.results) > 20
    assert all(0 <= u <= 1 for u in kv_usage) and max(kv_usage) > 0  # the streams hold KV slots
    for op in ops:
        # The follow-up EPLB moved experts after every scale-up and scale-down, and nothing failed.
        assert op["followup_error"] == "" and op["rebalance_downtime_s"] is not None, op
        assert "migrating" in op["phases"] and op["pull_bytes"] > 0, op
        # Requests were in flight across every commit, and the commit is short.
        assert any(t0 < op["committed_at"] < t1 for _, _, t0, t1 in traffic.results), op
        assert op["downtime_s"] < 2.0, op
    up = ops[0]
    assert set(up["phases"]) >= {"starting", "loading", "connecting", "warming", "committing"}
    assert up["pull_bytes"] > 0
    assert [op["parked"] for op in ops[1:]] == [[3], [2]]  # leaving ranks wait for the next scale-up
    # The graph's output is what a person follows: every rank's lines about an operation carry its
    # id, and the runtime's line per routed call (the router's probes: one per rank per second) is out.
    for op in ops:
        for r in range(max(op["from_size"], op["to_size"])):
            assert f"[op {op['id']}] rank {r}: epoch" in server.output, (op["id"], r)
    assert ROUTE_NOISE not in server.output


BAD = [
    (b'{"dp_size": ', 400, "not valid JSON"),
    (b'{"dp_size": 0}', 400, "must be at least 1"),
    (b'{"dp_size": -3}', 400, "must be at least 1"),
    (b'{"dp_size": 5}', 400, "exceeds max_ranks 4"),
    (b'{"dp_size": "3"}', 400, "Expected `int`, got `str` - at `$.dp_size`"),
    (b'{"dp_size": 2.5}', 400, "Expected `int`, got `float` - at `$.dp_size`"),
    (b'{"dp_size": true}', 400, "Expected `int`, got `bool` - at `$.dp_size`"),
    (b'{"size": 3}', 400, "Object contains unknown field `size`"),
    (b"{}", 400, "Object missing required field `dp_size`"),
    (b'{"dp_size": 3, "drain_timout": 0}', 400, "Object contains unknown field `drain_timout`"),
    (b'{"dp_size": 3, "drain_timeout": -1}', 400, "drain_timeout must be in 0..86400 seconds, got -1"),
    (b'{"dp_size": 3, "x": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400, "nests deeper than 8 levels"),
    (b'{"dp_size": 2}', 409, "dp_size is already 2"),
    (b'{"dp_size": 3, "mode": "Z"}', 400, "mode must be one of A (blocking), B (prepare_async), C ("),
]


@pytest.mark.parametrize("body,status,message", BAD)
def test_bad_scale_requests_are_refused(server, reference, body, status, message):
    before = server.topology()
    r = server.control("POST", "/scale", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status and message in r.json()["error"]["message"], r.text
    after = server.topology()
    assert (after["epoch"], after["active"]) == (before["epoch"], before["active"])
    assert server.stream_text(PROMPTS[0], MAX_TOKENS) == reference[0]


def test_vllm_compatible_api(server):
    r = server.control("POST", "/scale_elastic_ep", json={"new_data_parallel_size": "x"})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "Expected `int`, got `str` - at `$.new_data_parallel_size`"
    assert server.control("POST", "/is_scaling_elastic_ep").json() == {"is_scaling": False}


DEATHS = [
    ("exit_on=describe", "starting"),  # dies before it registered
    ("exit_on=pull_weights", "loading"),
    ("exit_on=connect", "connecting"),
    ("exit_on=warmup", "warming"),
]


@pytest.mark.parametrize("fault,phase", DEATHS)
def test_a_joiner_that_dies_before_the_commit_is_replaced_by_a_new_one(server, reference, fault, phase):
    """The joiner exits in this phase (injected into it alone): the scale-up starts a new one for
    its rank and reaches its target, the retry in its record."""
    with Traffic(server, clients=2) as traffic:
        op = scale(server, 3, fault=fault)
    assert op["phase"] == "done", op
    assert [(r["rank"], r["phase"], r["attempt"]) for r in op["joiner_retries"]] == [(2, phase, 2)], op
    assert server.topology()["active"] == [0, 1, 2]
    assert traffic.errors == []
    assert all(toks == reference[p] for p, toks, _, _ in traffic.results)
    assert scale(server, 2)["phase"] == "done"


def test_a_joiner_that_stalls_before_the_commit_is_fenced_and_replaced(server, reference):
    """SIGSTOPped while it holds its pull back (it answers nothing, its process lives): not held
    until Router.prepare_timeout_s (60 s here) but fenced after Router.joiner_timeout_s (10 s) of
    silence and replaced; the scale-up reaches its target, nothing lost."""
    fault, since = "stall_on=pull_weights,stall_s=30", len(server.output)

    def line(pattern: str) -> re.Match:
        deadline = time.monotonic() + 120
        while not (m := re.search(pattern, server.output[since:], re.M)):
            assert time.monotonic() < deadline, server.tail(60)
            time.sleep(0.05)
        return m

    with Traffic(server, clients=2) as traffic, ThreadPoolExecutor(1) as pool:
        scaled = pool.submit(scale, server, 3, fault=fault)
        m = line(rf"started Worker\.(\d+) \(pid (\d+), \w+\) with fault {re.escape(fault)}$")
        rank, pid = int(m.group(1)), int(m.group(2))
        line(rf"rank {rank}: injected fault: stalling pull_weights ")
        freeze(pid)
        op = scaled.result(timeout=240)
    assert op["phase"] == "done", op
    assert [(r["rank"], r["phase"], r["attempt"]) for r in op["joiner_retries"]] == [(2, "loading", 2)], op
    assert "ScaleError: rank 2 stalled during loading: no answer for " in op["joiner_retries"][0]["error"], op
    assert not alive(pid)  # fenced: it can never act on this operation again
    assert server.topology()["active"] == [0, 1, 2]
    assert traffic.errors == []
    assert all(toks == reference[p] for p, toks, _, _ in traffic.results)
    assert scale(server, 2)["phase"] == "done"


def test_a_failed_prepare_aborts_and_old_topology_serves(server, reference):
    """A pulled tensor fails its checksum (the joiner lives on: nothing to retry): aborted in
    loading, the old topology serves on."""
    before = server.topology()
    with Traffic(server, clients=2) as traffic:
        op = scale(server, 3, fault="corrupt_pull")
    assert op["phase"] == "aborted", op
    assert list(op["phases"])[-1] == "loading", op  # it failed, and was caught, in this phase
    after = server.topology()
    assert (after["dp_size"], after["active"]) == (before["dp_size"], before["active"])
    assert traffic.errors == []
    assert all(toks == reference[p] for p, toks, _, _ in traffic.results)


def test_a_joiner_dying_in_the_commit_rolls_back_then_a_later_scale_succeeds(server, reference):
    """The joiner exits on Configure: the serving ranks are paused, some maybe configured for the
    new epoch already. Everyone reachable goes back to the old set under a newer epoch."""
    before = server.topology()
    with Traffic(server, clients=2) as traffic:
        op = scale(server, 3, fault="exit_on=configure")
        assert op["phase"] == "rolled_back", op
        assert list(op["phases"])[-1] == "committing", op
        after = server.topology()
        assert after["active"] == before["active"] and after["epoch"] > before["epoch"]
        assert 2 not in [r["rank"] for r in after["ranks"]]  # the joiner is gone
        assert scale(server, 3)["phase"] == "done"
    assert traffic.errors == []
    assert all(toks == reference[p] for p, toks, _, _ in traffic.results)
    assert scale(server, 2)["phase"] == "done"


def test_commit_timeout_rolls_back_then_a_later_scale_succeeds(server, reference):
    before = server.topology()
    with Traffic(server, clients=2) as traffic:
        op = scale(server, 3, fault="stall_on=configure,stall_s=10")
        assert op["phase"] == "rolled_back", op
        after = server.topology()
        assert after["active"] == before["active"] and after["epoch"] > before["epoch"]
        op = scale(server, 3)
        assert op["phase"] == "done", op
    assert traffic.errors == []
    assert all(toks == reference[p] for p, toks, _, _ in traffic.results)
    assert server.topology()["active"] == [0, 1, 2]
    assert server.topology()["snapshot"] is None  # no Worker.snapshot_root: nothing to restore from
    assert scale(server, 2)["phase"] == "done"


def test_metrics_report_operations(server):
    metrics = parse_prometheus(server.control("GET", "/metrics").text)
    ops = {(labels["kind"], labels["result"]): n for labels, n in metrics["elastic_scale_operations_total"]}
    assert ops[("up", "done")] >= 1 and ops[("up", "aborted")] >= 1, ops
    assert metrics["elastic_scale_last_downtime_seconds"], metrics


@pytest.mark.parametrize("mode", ["A", "B"])
def test_comparison_modes_scale_correctly(server, reference, mode):
    with Traffic(server, clients=2) as traffic:
        up = scale(server, 3, mode=mode)
        down = scale(server, 2, mode=mode)
    assert (up["phase"], down["phase"]) == ("done", "done"), (up, down)
    # The API takes the letters; records name the mode. A and B warm up inside the pause.
    assert up["mode"] == {"A": "blocking", "B": "prepare_async"}[mode] and "warming" not in up["phases"]
    assert traffic.errors == []
    assert all(toks == reference[p] for p, toks, _, _ in traffic.results)


@pytest.fixture(scope="module")
def long_reference():
    return engine_reference(PROMPTS, LONG_TOKENS)


def test_leaving_rank_hands_its_requests_over(server, long_reference):
    assert scale(server, 3)["phase"] == "done"

    def served() -> int:
        return next(v["requests_total"] for v in server.topology()["ranks"] if v["rank"] == 2)

    before, deadline = served(), time.monotonic() + 30
    while served() == before:  # until the frontend routes to rank 2
        assert time.monotonic() < deadline, "the frontend sent rank 2 nothing in 30 s"
        server.stream_text(PROMPTS[0], 4)
        time.sleep(0.2)
    # Round robin gives each rank two of six requests sent at once, and every stream outlasts the
    # second before the drain: the leaving rank holds streams when it drains (drain_timeout=0).
    with _Traffic(server, PROMPTS, LONG_TOKENS, clients=6) as traffic:
        time.sleep(1.0)
        op = scale(server, 2, drain_timeout=0)
        time.sleep(1.0)
    assert op["phase"] == "done" and op["handed_over"] > 0, op
    # Remaining ranks carried the handed-over requests on, replaying their tokens so far.
    assert traffic.errors == []
    bad = [(p, toks, long_reference[p]) for p, toks, _, _ in traffic.results if toks != long_reference[p]]
    assert bad == []
    assert {v["replays_diverged"] for v in server.topology()["ranks"]} == {0}
