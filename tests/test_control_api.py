"""The router's control API in process (aiohttp's test server), without ranks behind it: who may
call it, and what a bad request gets."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from components.control.capacity import LocalProvider
from components.control.journal import Tally
from components.control.router import ControlAccessLog, ElasticEPBody, RouterService, ScaleBody
from components.graph.component import GraphContext
from components.planner.service import parse_prometheus
from components.protocol.config import RouterConfig, WorkerConfig
from components.protocol.lifecycle import RankState
from components.protocol.messages import RankStatus
from components.protocol.topology import Committed, OpRecord, ScaleMode

AUTH = {"Authorization": "Bearer s3cret"}


def call(requests: list[tuple[str, str, dict]], token: str = "s3cret") -> list[tuple[int, str]]:
    """(status, body) of each request against a router with no ranks."""

    async def run():
        svc = RouterService(None, None, RouterConfig(token=token), WorkerConfig())
        async with TestClient(TestServer(svc.app())) as client:
            out = []
            for method, path, kw in requests:
                r = await client.request(method, path, **kw)
                out.append((r.status, await r.text()))
            return out

    return asyncio.run(run())


def test_probes_and_scrapers_need_no_token():
    (health, metrics) = call([("GET", "/health", {}), ("GET", "/metrics", {})])
    assert health == (503, '{"status": "starting", "epoch": 0}')  # not 401: the probe sends no token
    assert metrics[0] == 200 and parse_prometheus(metrics[1])["elastic_router_epoch"] == [({}, 0.0)]


def test_reads_are_logged_at_debug_and_changes_and_refusals_at_info(caplog):
    """The graph's liveness checks and the planner poll the router every second: their lines
    would bury the ones about scaling."""

    async def run():
        svc = RouterService(None, None, RouterConfig(token="s3cret"), WorkerConfig())
        server = TestServer(svc.app())
        await server.start_server(access_log_class=ControlAccessLog)  # as the router's runner has it
        async with TestClient(server) as client:
            for method, path, kw in [
                ("GET", "/health", {}),  # 503 while starting, and still a poll
                ("GET", "/metrics", {}),
                ("GET", "/topology", {"headers": AUTH}),
                ("GET", "/topology", {}),  # no token: refused
                ("POST", "/scale", {"headers": AUTH, "json": {"dp_size": 2}}),  # no ranks yet: refused
            ]:
                await client.request(method, path, **kw)

    with caplog.at_level(logging.DEBUG, logger="aiohttp.access"):
        asyncio.run(run())
    lines = [(r.levelno, r.getMessage().split(" ", 1)[1]) for r in caplog.records if r.name == "aiohttp.access"]
    assert [(level, re.sub(r" in [\d.]+ ms$", "", msg)) for level, msg in lines] == [
        (logging.DEBUG, "GET /health -> 503"),
        (logging.DEBUG, "GET /metrics -> 200"),
        (logging.DEBUG, "GET /topology -> 200"),
        (logging.INFO, "GET /topology -> 401"),
        (logging.INFO, "POST /scale -> 503"),
    ]


def rank_status(rank: int) -> RankStatus:
    return RankStatus(
        rank=rank,
        pid=100 + rank,
        instance_id=rank,
        metadata=b"",
        model_identity="m",
        num_experts=4,
        num_moe_layers=1,
        slots_per_rank=2,
        epoch=2,
        active=[0, 1],
        connected=[0, 1],
        paused=False,
        routable=True,
        state=RankState.ACTIVE,
        load=[],
        steps=10 + rank,
        running=rank,
        waiting=0,
        requests_total=20 + rank,
        expert_rows=30 + rank,
    )


def test_metrics_expose_the_router_state():
    """/metrics parses back to the state each family reports, with the exposition's content type;
    each router has a registry of its own."""
    rec = OpRecord(
        id="op-1-up-1to2",
        kind="up",
        mode=ScaleMode.PREPARE_ASYNC_REUSE_GRAPHS,
        from_size=1,
        to_size=2,
        phase="done",
        joiners=[1],
        leaving=[],
        phases={"starting": 1.5, "committing": 0.25},
        downtime_s=0.125,
        total_s=2.0,
        followup_error="rebalance failed",
    )

    async def run():
        svc = RouterService(None, None, RouterConfig(), WorkerConfig())
        other = RouterService(None, None, RouterConfig(), WorkerConfig())
        svc.statuses = {r: rank_status(r) for r in (0, 1)}
        tally = Tally()
        tally.count(rec)
        svc.scaler = SimpleNamespace(busy=True, history=[rec], current=None, pending=None, tally=tally)
        svc.operation_ended(rec, Committed(epoch=2, active=[0, 1], placement=None))
        async with TestClient(TestServer(svc.app())) as client:
            r = await client.get("/metrics")
            return r.status, r.headers["Content-Type"], await r.text(), generate_latest(other.registry).decode()

    status, content_type, text, other = asyncio.run(run())
    assert (status, content_type) == (200, CONTENT_TYPE_LATEST)
    ranks = [{"rank": "0"}, {"rank": "1"}]
    assert parse_prometheus(text) == {
        "elastic_router_epoch": [({}, 2.0)],
        "elastic_router_active_ranks": [({}, 2.0)],
        "elastic_router_scaling": [({}, 1.0)],
        "elastic_scale_operations_total": [({"kind": "up", "result": "done"}, 1.0)],
        "elastic_scale_followup_failures_total": [({}, 1.0)],
        "elastic_scale_masked_ranks_total": [({}, 0.0)],
        "elastic_scale_last_downtime_seconds": [({"op": rec.id}, 0.125)],
        "elastic_scale_last_total_seconds": [({"op": rec.id}, 2.0)],
        "elastic_scale_last_phase_seconds": [
            ({"op": rec.id, "phase": "starting"}, 1.5),
            ({"op": rec.id, "phase": "committing"}, 0.25),
        ],
        "elastic_rank_steps_total": list(zip(ranks, [10.0, 11.0])),
        "elastic_rank_running_requests": list(zip(ranks, [0.0, 1.0])),
        "elastic_rank_requests_total": list(zip(ranks, [20.0, 21.0])),
        "elastic_rank_expert_rows_total": list(zip(ranks, [30.0, 31.0])),
    }
    assert parse_prometheus(other)["elastic_router_epoch"] == [({}, 0.0)]


def test_everything_else_needs_the_token():
    denied = [
        ("GET", "/topology", {}),
        ("POST", "/scale", {}),
        ("POST", "/health", {}),
        ("POST", "/is_scaling_elastic_ep", {}),
        ("GET", "/topology", {"headers": {"Authorization": "Bearer wrong"}}),
        ("GET", "/topology", {"headers": {"Authorization": "Bearer s3crét"}}),  # not ASCII: refused, not a 500
        ("GET", "/topology", {"headers": {"Authorization": b"Bearer \xff\xfe".decode("latin-1")}}),
    ]
    replies = call([*denied, ("GET", "/topology", {"headers": AUTH})])
    assert replies[:-1] == [(401, '{"error": "missing or wrong bearer token"}')] * len(denied)
    assert replies[-1][0] == 200 and '"epoch":0' in replies[-1][1]


def test_a_token_that_cannot_be_sent_is_refused_at_start():
    with pytest.raises(ValueError, match="token must be printable ASCII"):
        RouterConfig(token="s3crét")
    with pytest.raises(ValueError, match="token must be printable ASCII"):
        RouterConfig(token="two words")


def test_browsers_cannot_drive_the_api():
    """CSRF from a page on this machine (a foreign Origin, a form's content type) and DNS
    rebinding (a foreign Host) are refused before anything is parsed."""
    replies = call(
        [
            ("POST", "/scale", {"json": {"dp_size": 3}, "headers": {"Origin": "http://evil.example"}}),
            ("POST", "/scale", {"data": '{"dp_size": 3}', "headers": {"Content-Type": "text/plain"}}),
            ("GET", "/topology", {"headers": {"Host": "evil.example:8001"}}),
            ("GET", "/topology", {"headers": {"Origin": "http://127.0.0.1:8001"}}),
        ],
        token="",
    )
    assert replies[0] == (
        403,
        '{"error": {"message": "cross-origin request from \'http://evil.example\' refused", "code": 403}}',
    )
    assert replies[1] == (
        415,
        '{"error": {"message": "expected content-type application/json, got \'text/plain\'", "code": 415}}',
    )
    assert replies[2] == (
        403,
        '{"error": {"message": "Host \'evil.example:8001\' is not this control API", "code": 403}}',
    )
    assert replies[3][0] == 200


@pytest.mark.parametrize(
    "body,message",
    [
        (b"", "request body is not valid JSON: Input data was truncated"),
        (b"[3]", 'expected a JSON object like {"dp_size": 4}'),
        (
            b'{"dp_size": 3, "mode": "D"}',
            "mode must be one of A (blocking), B (prepare_async), C (prepare_async_reuse_graphs), got 'D'",
        ),
        (b'{"dp_size": 3, "fault": "corrupt_pull"}', "fault injection is off (Router.allow_fault_injection)"),
        (b'{"dp_size": 3, "drain_timeout": 1e9}', "drain_timeout must be in 0..86400 seconds, got 1000000000.0"),
        (b"[" * 100000 + b"]" * 100000, "request body nests deeper than 8 levels"),
    ],
)
def test_scale_bodies_are_decoded_strictly(body, message):
    svc = RouterService(None, None, RouterConfig(), WorkerConfig())
    with pytest.raises(ValueError) as e:
        svc.parse_scale(body, ScaleBody)
    assert str(e.value) == message


def test_scale_modes_by_letter_or_name():
    svc = RouterService(None, None, RouterConfig(), WorkerConfig())
    for text, mode in [
        ("A", ScaleMode.BLOCKING),
        ("prepare_async", ScaleMode.PREPARE_ASYNC),
        ("C", ScaleMode.PREPARE_ASYNC_REUSE_GRAPHS),
    ]:
        assert svc.parse_scale(b'{"dp_size": 3, "mode": "%s"}' % text.encode(), ScaleBody).mode is mode
    req = svc.parse_scale(b'{"new_data_parallel_size": 3, "drain_timeout": 5}', ElasticEPBody)
    assert (req.dp_size, req.mode, req.drain_timeout_s) == (3, ScaleMode.PREPARE_ASYNC_REUSE_GRAPHS, 5.0)


def test_a_rank_that_does_not_answer_does_not_hold_up_finding_a_dead_one():
    """Rank 0 stalls (its status probe hangs until rank_timeout_s); rank 1's process dies. The
    router's next status round fails rank 1 over while rank 0's probe still waits."""

    class Provider:
        def alive(self, rank):
            return rank != 1

        def prune(self):
            pass

    class Scaler:
        failing: set[int] = set()
        current = None
        busy = False

        def __init__(self):
            self.failed = asyncio.get_running_loop().create_future()

        def fail(self, ranks):
            if not self.failed.done():
                self.failed.set_result((ranks, set(probes)))

    probes: set[int] = set()  # ranks whose probe is waiting for an answer

    async def send(rank, msg):
        probes.add(rank)
        if rank == 0:
            await asyncio.sleep(3600)  # stalled
        probes.discard(rank)

    async def run():
        svc = RouterService(None, None, RouterConfig(status_interval_s=0.05, rank_timeout_s=60), WorkerConfig())
        svc.instances = {0: 100, 1: 101}
        svc._committed = Committed(epoch=1, active=[0, 1], placement=None)
        svc.send = send
        svc.scaler = Scaler()
        svc.ready.set()
        refresh = asyncio.create_task(svc.refresh(Provider()))
        try:
            return await asyncio.wait_for(svc.scaler.failed, timeout=30)
        finally:
            refresh.cancel()

    ranks, waiting = asyncio.run(run())
    assert ranks == [1] and waiting == {0}


def test_the_local_provider_sees_a_rank_it_did_not_start_die():
    """Ranks `dynamo serve` started report their PID; once watched (a PID that is that rank's
    worker here), their death is seen at the provider's next look (a zombie counts), not a
    heartbeat timeout later."""
    provider = LocalProvider(GraphContext("ns", "file", "", "", {}))
    other = subprocess.Popen(["sleep", "60"])
    # What `ps` shows of a rank's worker: its argv.
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "components.worker", "--rank", "5"])
    try:
        for p, argv0 in ((proc, sys.executable), (other, "sleep")):  # exec'd: /proc shows its argv
            while not Path(f"/proc/{p.pid}/cmdline").read_bytes().startswith(argv0.encode() + b"\0"):
                time.sleep(0.01)
        provider.watch(5, other.pid)  # not rank 5's worker (another PID namespace's PID, say)
        assert provider.alive(5) is None
        provider.watch(5, proc.pid)
        assert provider.alive(5) is True
        proc.kill()
        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # exited, not yet reaped
        assert provider.alive(5) is False
    finally:
        for p in (proc, other):
            p.kill()
            p.wait()
    assert provider.alive(5) is False
