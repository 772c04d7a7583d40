"""Dynamo's planner drives the DP size (`--Planner.kind=dynamo`): the graph served with etcd
discovery, a real etcd, and the runtime's own `VirtualConnectorCoordinator` (what Dynamo's planner
publishes its decisions through) growing and shrinking it. Each decision is acknowledged only
after its commit, with the registered generate instances (what Dynamo's planner counts) at the
new size and parked ranks not among them; one that cannot be met, or that someone else's scale
request overtakes, is failed, not acknowledged; a decision that arrives while another is being
met wins."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from components.planner.service import Bounds
from components.planner.virtual import DecisionRecord, Phase, advance, unmet
from harness.etcd import kv, running_etcd
from harness.server import Server, engine_reference, free_ports

NAMESPACE = "elastic"  # the graph's (dynamo serve's default)
PROMPT, MAX_TOKENS = [5, 17, 42, 99, 7, 250], 12
ACK_TIMEOUT_S = 240


@pytest.fixture
def etcd():
    with running_etcd() as url:
        yield url


def decisions(port: int) -> dict[int, dict]:
    return {d["decision_id"]: d for d in httpx.get(f"http://127.0.0.1:{port}/decisions", timeout=10).json()}


async def acknowledged(coord, srv: Server, decision_id: int) -> dict:
    """Poll the coordinator until the client acknowledged `decision_id`; the router's topology
    read right then."""
    deadline = time.monotonic() + ACK_TIMEOUT_S
    while not await coord.is_scaling_ready():
        assert time.monotonic() < deadline, f"decision {decision_id} not acknowledged\n{srv.tail(40)}"
        await asyncio.sleep(0.05)
    return srv.topology()


async def generate_instances(gen, n: int) -> list[int]:
    """The generate instances discovery lists, once they are `n` (Dynamo's planner counts these;
    another watcher of etcd may see a change a little after the rank's own client did)."""
    deadline = time.monotonic() + 5
    while len(gen.instance_ids()) != n and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    return gen.instance_ids()


def test_dynamo_planner_grows_and_shrinks_the_graph(etcd, monkeypatch):
    reference = engine_reference([PROMPT], MAX_TOKENS)[0]
    port = free_ports(1)[0]
    srv = Server(
        [
            "--discovery",
            "etcd",
            "--etcd-endpoints",
            etcd,
            "--Planner.kind=dynamo",
            "--Worker.dp_size=1",
            "--Worker.max_ranks=3",
            "--Planner.min_dp=1",
            "--Planner.max_dp=3",
            f"--Planner.port={port}",
            "--Router.prepare_timeout_s=150",
            "--Router.drain_timeout_s=20",
        ]
    )
    monkeypatch.setenv("ETCD_ENDPOINTS", etcd)

    async def go():
        from dynamo._core import VirtualConnectorCoordinator
        from dynamo.runtime import DistributedRuntime

        rt = DistributedRuntime(asyncio.get_running_loop(), "etcd", "tcp")
        # max_wait 0: a decision is published even while the last is unacknowledged (below: one
        # after a failure, and one while another is being met); 1 s checks, 1 retry.
        coord = VirtualConnectorCoordinator(rt, NAMESPACE, 1, 0, 1)
        await coord.async_init()
        gen = await rt.endpoint(f"{NAMESPACE}.worker.generate").client()
        assert len(await generate_instances(gen, 1)) == 1
        seen = []
        try:
            # Grow 1 -> 2 -> 3, shrink 3 -> 1: each acknowledged once committed, not before.
            for n in (2, 3, 1):
                await coord.update_scaling_decision(None, n)
                did = coord.read_state().decision_id
                topo = await acknowledged(coord, srv, did)
                assert (topo["dp_size"], topo["scaling"], topo["target"]) == (n, False, None), topo
                assert topo["operation"]["phase"] == "done" and topo["operation"]["to_size"] == n, topo
                assert len(await generate_instances(gen, n)) == n, (n, gen.instance_ids())
                seen.append((did, n, topo["operation"]["id"]))
            parked = [r["rank"] for r in topo["ranks"] if r["state"] == "PARKED"]
            assert len(parked) == 2, topo["ranks"]  # processes kept, and not counted as workers
            assert kv(etcd)[f"v1/{NAMESPACE}/planner/scaled_decision_id"] == str(seen[-1][0])

            # Above max_dp: failed with the reason, not acknowledged, the size unchanged.
            await coord.update_scaling_decision(None, 4)
            bad = coord.read_state().decision_id
            deadline = time.monotonic() + 30
            while decisions(port).get(bad, {}).get("phase") != "failed":
                assert time.monotonic() < deadline, (decisions(port), srv.tail(30))
                await asyncio.sleep(0.1)
            assert "outside the planner's bounds 1..3" in decisions(port)[bad]["reason"]
            await asyncio.sleep(1.5)  # a later look must not acknowledge it either
            assert not await coord.is_scaling_ready()
            assert kv(etcd)[f"v1/{NAMESPACE}/planner/scaled_decision_id"] == str(seen[-1][0])
            topo = srv.topology()
            assert (topo["dp_size"], topo["scaling"], topo["operation"]["id"]) == (1, False, seen[-1][2])
            metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
            assert "elastic_planner_dynamo_decision_failed 1.0" in metrics, metrics
            assert 'elastic_planner_dynamo_decisions_total{result="failed"} 1.0' in metrics, metrics

            # A decision arriving while the one before is being met: the latest target wins and
            # only it is acknowledged.
            await coord.update_scaling_decision(None, 3)
            first = coord.read_state().decision_id
            deadline = time.monotonic() + 30
            while not srv.topology()["scaling"]:
                assert time.monotonic() < deadline, srv.tail(30)
                await asyncio.sleep(0.02)
            await coord.update_scaling_decision(None, 2)
            latest = coord.read_state().decision_id
            topo = await acknowledged(coord, srv, latest)
            assert (topo["dp_size"], topo["scaling"], topo["target"]) == (2, False, None), topo
            assert len(await generate_instances(gen, 2)) == 2, gen.instance_ids()
            assert kv(etcd)[f"v1/{NAMESPACE}/planner/scaled_decision_id"] == str(latest)
            ds = decisions(port)
            assert ds[first]["phase"] == "superseded" and ds[latest]["phase"] == "completed", ds

            # Someone else's POST /scale wins over a decision being met: the router settles at
            # their size, and the decision is failed, not acknowledged.
            await coord.update_scaling_decision(None, 3)
            lost = coord.read_state().decision_id
            deadline = time.monotonic() + 30
            while not srv.topology()["scaling"]:
                assert time.monotonic() < deadline, srv.tail(30)
                await asyncio.sleep(0.02)
            r = srv.control("POST", "/scale", json={"dp_size": 2})
            assert r.status_code == 202, r.text
            deadline = time.monotonic() + ACK_TIMEOUT_S
            while decisions(port)[lost]["phase"] != "failed":
                assert time.monotonic() < deadline, (decisions(port), srv.tail(30))
                await asyncio.sleep(0.1)
            assert "the router settled at dp_size 2, not 3" in decisions(port)[lost]["reason"]
            assert not await coord.is_scaling_ready()
            assert kv(etcd)[f"v1/{NAMESPACE}/planner/scaled_decision_id"] == str(latest)
            assert srv.topology()["dp_size"] == 2
        finally:
            rt.shutdown()
        return seen

    try:
        seen = asyncio.run(go())
        assert srv.stream_text(PROMPT, MAX_TOKENS) == reference
        log = srv.output
        for did, n, op in seen:
            assert f"[decision {did}] applying -> completed: dp_size {n} committed" in log and f"[op {op}]" in log
        assert "[decision 3] received -> failed: cannot be met" in log
        assert "acknowledged" not in "".join(ln for ln in log.splitlines() if "[decision 4]" in ln)
    finally:
        assert srv.stop() == 0


def test_what_a_decision_must_ask_for_to_be_met():
    b = Bounds(min_dp=1, max_dp=3, up=4.0, down=1.0)
    assert unmet(b, -1, 2) == "" and unmet(b, 0, 3) == ""
    assert "asks for 1 prefill workers, and this deployment is aggregated" in unmet(b, 1, 2)
    assert unmet(b, -1, -1) == "it sets no decode worker count"
    assert "0 decode workers is outside the planner's bounds 1..3" in unmet(b, -1, 0)
    rec = DecisionRecord(decision_id=7, num_prefill_workers=-1, num_decode_workers=2, received=0.0)
    advance(rec, Phase.APPLYING, "router: accepted")
    with pytest.raises(RuntimeError, match="decision 7: no transition applying -> received"):
        advance(rec, Phase.RECEIVED, "")
    advance(rec, Phase.COMPLETED, "done")
    with pytest.raises(RuntimeError, match="no transition completed -> failed"):
        advance(rec, Phase.FAILED, "")
