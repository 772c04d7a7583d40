"""The planner: DP size follows a load ramp against `dynamo serve` (CPU), without flapping;
a dead planner leaves the deployment serving at its size; bad bounds are refused at start;
the decision rule, the metrics parsing and the Kubernetes capacity provider (against a fake API
server) on their own. Dynamo's planner driving the size: tests/test_planner_dynamo.py."""

from __future__ import annotations

import asyncio
import logging
import math
import os
import re
import signal
import subprocess
import threading
import time

import httpx
import pytest
from prometheus_client import generate_latest

from components.planner.router_client import RouterClient
from components.planner.service import (
    Bounds,
    Decision,
    Inputs,
    Planner,
    PlannerService,
    Policy,
    histogram,
    parse_prometheus,
    quantile,
    resolve,
)
from components.protocol.config import WorkerConfig
from harness.server import ROOT, Server, engine_reference, env_tool, free_ports

MAX_TOKENS = 16
PROMPTS = [[5 + i, 17, 42 + i, 99, 7 * i + 3, 250] for i in range(8)]


# ---------------------------------------------------------------------------------------------
# the decision rule on its own


def inputs(dp: int, load: float, scaling: bool = False, **kw) -> Inputs:
    base = dict(
        dp=dp,
        scaling=scaling,
        inflight=load,
        running=int(load),
        waiting=0,
        rate=None,
        duration_s=None,
        ttft_p50_s=None,
        ttft_p95_s=None,
        itl_p50_s=None,
        itl_p95_s=None,
        kv_use=None,
        load_ewma=load,
        rate_ewma=None,
        predicted=load,
    )
    base.update(kw)
    return Inputs(**base)


def policy(**kw) -> Policy:
    cfg = Planner.Config(**{"cooldown_s": 10, "up_intervals": 2, "down_intervals": 3, **kw})
    return Policy(cfg, Bounds(min_dp=1, max_dp=4, up=4.0, down=1.0))


def test_policy_hysteresis_step_cooldown_and_bounds():
    p = policy()
    assert p.decide(inputs(1, 2), 0)[0] == "keep"  # within band
    a, t, why = p.decide(inputs(1, 13), 1)
    assert (a, t) == ("keep", 1) and "hysteresis 1/2" in why
    a, t, why = p.decide(inputs(1, 13), 2)
    assert (a, t) == ("up", 2), why  # wants ceil(13/4) = 4, moves by one step
    p.last_op_end = 2
    a, t, why = p.decide(inputs(2, 13), 3)
    assert a == "keep" and "cooldown" in why
    assert p.decide(inputs(2, 13, scaling=True), 20)[0] == "keep"  # never while the router scales
    p.decide(inputs(2, 13), 21)
    assert p.decide(inputs(2, 13), 22)[:2] == ("up", 3)
    # Steady load inside the band: nothing, however long.
    p = policy()
    assert {p.decide(inputs(3, 9 + (i % 2)), 100 + i)[0] for i in range(50)} == {"keep"}
    # Down needs down_intervals in a row; one sample above resets it.
    p = policy()
    assert [p.decide(inputs(3, 1), i)[0] for i in range(2)] == ["keep", "keep"]
    p.decide(inputs(3, 5), 2)
    assert [p.decide(inputs(3, 1), 3 + i)[:2] for i in range(3)][-1] == ("down", 2)
    # At the bounds.
    p = policy()
    p.decide(inputs(4, 40), 0)
    a, t, why = p.decide(inputs(4, 40), 1)
    assert (a, t) == ("keep", 4) and "max_dp 4" in why
    assert p.decide(inputs(1, 0), 2)[0] == "keep"
    # Step 2.
    p = policy(step=2)
    p.decide(inputs(1, 16), 0)
    assert p.decide(inputs(1, 16), 1)[:2] == ("up", 3)
    # An SLO miss asks for one more rank, unless the deployment is idle.
    p = policy(ttft_p95_slo_s=0.5, up_intervals=1)
    assert p.decide(inputs(2, 4, ttft_p95_s=2.0), 0)[:2] == ("up", 3)
    assert p.decide(inputs(2, 1, ttft_p95_s=2.0), 20)[0] == "keep"
    # A rank whose KV cache is nearly full asks for one more rank too.
    p = policy(up_intervals=1)
    a, t, why = p.decide(inputs(2, 4, kv_use=0.95), 0)
    assert (a, t) == ("up", 3) and "kv use 0.95 > 0.9" in why


def test_prometheus_parsing_and_quantiles():
    text = """# TYPE x histogram
dynamo_frontend_inflight_requests{model="m"} 3
dynamo_frontend_inflight_requests{model="n"} 2
h_bucket{model="m",le="0.1"} 10
h_bucket{model="m",le="1"} 20
h_bucket{model="m",le="+Inf"} 20
# TYPE dynamo_frontend_requests_total counter
dynamo_frontend_requests_total{model="m"} 7
"""
    s = parse_prometheus(text)
    assert sum(v for _, v in s["dynamo_frontend_inflight_requests"]) == 5
    assert s["dynamo_frontend_requests_total"] == [({"model": "m"}, 7.0)]
    h = histogram(s, "h")
    assert h == {0.1: 10, 1.0: 20, math.inf: 20}
    assert quantile(h, {}, 0.5) == pytest.approx(0.1)
    assert quantile(h, {}, 0.75) == pytest.approx(0.55)
    assert quantile(h, h, 0.5) is None
    # A malformed exposition fails whole, as a Prometheus scrape of it does: the planner then
    # decides from the router's view.
    with pytest.raises(ValueError):
        parse_prometheus(text + "weird line\n")


def test_planner_metrics_expose_its_last_decision():
    svc = PlannerService(
        Planner.Config(), Bounds(min_dp=1, max_dp=4, up=4.0, down=1.0), "http://fe", RouterClient("http://rt")
    )
    empty = parse_prometheus(generate_latest(svc.registry).decode())
    assert empty["elastic_planner_target_dp"] == [({}, 0.0)] and "elastic_planner_load" not in empty
    svc.last_inputs = inputs(2, 9.5, rate_ewma=1.25)
    svc._record(Decision(time=0.0, action="up", current=2, target=3, reason="load", inputs={}))
    svc.requests["accepted"] += 1
    assert parse_prometheus(generate_latest(svc.registry).decode()) == {
        "elastic_planner_target_dp": [({}, 3.0)],
        "elastic_planner_current_dp": [({}, 2.0)],
        "elastic_planner_min_dp": [({}, 1.0)],
        "elastic_planner_max_dp": [({}, 4.0)],
        "elastic_planner_decisions_total": [
            ({"action": "keep"}, 0.0),
            ({"action": "up"}, 1.0),
            ({"action": "down"}, 0.0),
        ],
        "elastic_planner_scale_requests_total": [
            ({"result": "accepted"}, 1.0),
            ({"result": "refused"}, 0.0),
            ({"result": "failed"}, 0.0),
        ],
        "elastic_planner_load": [({}, 9.5)],
        "elastic_planner_inflight_requests": [({}, 9.5)],
        "elastic_planner_request_rate": [({}, 1.25)],
    }


def test_a_keep_for_the_same_reason_as_the_last_is_logged_at_debug(caplog):
    """A decision every interval: the keeps that say nothing new must not bury the ones that act."""
    svc = PlannerService(
        Planner.Config(), Bounds(min_dp=1, max_dp=4, up=4.0, down=1.0), "http://fe", RouterClient("http://rt")
    )
    decisions = [
        ("keep", 2, "load/rank 0.00 within band (4, 16] (at min_dp)"),
        ("keep", 2, "load/rank 0.50 within band (4, 16] (at min_dp)"),  # same kind: debug
        ("up", 3, "load/rank 20.00 above 16 for 2 intervals"),
        ("keep", 3, "cooldown: 25 s left"),
        ("keep", 3, "cooldown: 20 s left"),  # debug
        ("keep", 3, "load/rank 5.00 within band (4, 16]"),
    ]
    with caplog.at_level(logging.DEBUG, logger="components.planner.service"):
        for action, target, reason in decisions:
            svc._record(Decision(time=0.0, action=action, current=2, target=target, reason=reason, inputs={}))
    levels = [r.levelno for r in caplog.records if "planner: decision" in r.getMessage()]
    assert levels == [logging.INFO, logging.DEBUG, logging.INFO, logging.INFO, logging.DEBUG, logging.INFO]
    assert svc.counts["keep"] == 5 and len(svc.decisions) == 6  # every one still counted and kept


# ---------------------------------------------------------------------------------------------
# bad config is refused at start


@pytest.mark.parametrize(
    "args,message",
    [
        (["--Planner.min_dp=3", "--Planner.max_dp=2"], "min_dp (3) is greater than max_dp (2)"),
        (["--Planner.max_dp=9"], "Planner.max_dp (9) is over capacity: Worker.max_ranks is 4"),
        (["--Planner.step=0"], "step must be >= 1"),
        (["--Planner.min_dp=3"], "Worker.dp_size (2) is outside the planner's bounds 3..4"),
        (["--Planner.scale_up_threshold=2", "--Planner.scale_down_threshold=3"], "must be below scale_up_threshold"),
        (["--Planner.kind=dynamic"], "kind must be one of embedded, dynamo (got 'dynamic')"),
        (["--Planner.kind=dynamo"], "Planner.kind=dynamo needs --discovery etcd"),
    ],
)
def test_bad_planner_config_is_refused_at_start(args, message, tmp_path):
    disc = tmp_path / "discovery"
    r = subprocess.run(
        [env_tool("dynamo"), "serve", "graphs/elastic:Frontend", "--discovery-dir", str(disc), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2, r.stdout + r.stderr
    assert message in r.stderr, r.stderr
    assert "started" not in r.stdout + r.stderr  # nothing was started


def test_bounds_default_to_the_start_size():
    b = resolve(Planner.Config(), WorkerConfig(dp_size=2, max_ranks=4, min_ranks=1, max_seqs=16))
    assert (b.min_dp, b.max_dp, b.up, b.down) == (2, 4, 16.0, 4.0)


def test_more_ranks_than_gpus_share_them_with_a_warning(monkeypatch, caplog):
    """Ranks past the visible GPUs share them (rank r on GPU r % n): the planner may grow there,
    and says that it adds no compute."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with caplog.at_level(logging.WARNING, logger="components.planner.service"):
        b = resolve(Planner.Config(), WorkerConfig(device="cuda", dp_size=1, max_ranks=3, min_ranks=1, max_seqs=16))
    assert (b.min_dp, b.max_dp) == (1, 3)
    assert [r.getMessage() for r in caplog.records] == [
        "Planner.max_dp (3) is over this host's 1 visible GPUs: ranks past 1 share GPUs (rank r on GPU r % 1), "
        "so growing past 1 adds no compute"
    ]


# ---------------------------------------------------------------------------------------------
# the load ramp against `dynamo serve`


class Load:
    """Closed-loop streaming clients; the number of clients can change while it runs."""

    def __init__(self, srv: Server):
        self.srv, self.results, self.errors = srv, [], []
        self.clients: list[tuple[threading.Thread, threading.Event]] = []
        self.lock = threading.Lock()

    def _run(self, i: int, stop: threading.Event) -> None:
        k = i
        while not stop.is_set():
            p = k % len(PROMPTS)
            k += 7
            t0 = time.time()
            try:
                text = self.srv.stream_text(PROMPTS[p], MAX_TOKENS)
                with self.lock:
                    self.results.append((p, text, t0, time.time()))
            except Exception as e:  # recorded: the test asserts there are none
                with self.lock:
                    self.errors.append((p, repr(e)))

    def set_clients(self, n: int) -> None:
        while len(self.clients) < n:
            stop = threading.Event()
            t = threading.Thread(target=self._run, args=(len(self.clients), stop), daemon=True)
            t.start()
            self.clients.append((t, stop))
        while len(self.clients) > n:
            t, stop = self.clients.pop()
            stop.set()
            t.join(timeout=120)


@pytest.fixture(scope="module")
def reference():
    return engine_reference(PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def planner_port():
    return free_ports(1)[0]


@pytest.fixture(scope="module")
def server(planner_port):
    srv = Server(
        [
            "--Worker.dp_size=1",
            "--Worker.max_ranks=3",
            "--Planner.min_dp=1",
            "--Planner.max_dp=3",
            "--Planner.interval_s=1",
            "--Planner.cooldown_s=3",
            "--Planner.up_intervals=2",
            "--Planner.down_intervals=3",
            "--Planner.scale_up_threshold=2.5",
            "--Planner.scale_down_threshold=1.5",
            f"--Planner.port={planner_port}",
            "--Router.prepare_timeout_s=150",
            "--Router.drain_timeout_s=20",
        ]
    )
    try:
        yield srv
    finally:
        srv.stop()


def decisions(port: int) -> list[dict]:
    return httpx.get(f"http://127.0.0.1:{port}/decisions", timeout=10).json()


def wait_dp(srv: Server, n: int, timeout: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        topo = srv.topology()
        if topo["dp_size"] == n and not topo["scaling"]:
            return time.monotonic() - t0
        time.sleep(0.5)
    raise AssertionError(f"dp_size did not reach {n} in {timeout:.0f} s: {srv.topology()}\n{srv.tail(40)}")


def test_dp_follows_a_load_ramp(server, reference, planner_port):
    load = Load(server)
    sizes: list[int] = []
    try:
        # Low: one client. The planner stays at min_dp.
        load.set_clients(1)
        for _ in range(8):
            time.sleep(1)
            sizes.append(server.topology()["dp_size"])
        assert set(sizes) == {1}, sizes
        # Ramp up: six clients. DP grows one step at a time to max_dp and no further.
        load.set_clients(6)
        up_s = wait_dp(server, 3, 240)
        # Hold: steady load, no operation at all.
        ops_before = server.topology()["operation"]["id"]
        n_dec = len(decisions(planner_port))
        hold = []
        for _ in range(15):
            time.sleep(1)
            topo = server.topology()
            hold.append((topo["dp_size"], topo["operation"]["id"], topo["scaling"]))
        assert {h[0] for h in hold} == {3} and {h[1] for h in hold} == {ops_before}, hold
        held = decisions(planner_port)[n_dec:]
        assert held and {d["action"] for d in held} == {"keep"}, held
        # Ramp down: one client. DP falls back to min_dp.
        load.set_clients(1)
        down_s = wait_dp(server, 1, 180)
        time.sleep(3)
    finally:
        load.set_clients(0)
    assert server.topology()["dp_size"] == 1
    assert load.errors == []
    assert len(load.results) > 30
    for p, text, _, _ in load.results:
        assert text == reference[p], f"prompt {p}"
    acted = [(d["action"], d["current"], d["target"]) for d in decisions(planner_port) if d["action"] != "keep"]
    # One step at a time, within the bounds, and one change of direction: up during the ramp,
    # down after it (an aborted operation on a slow machine may be retried: same direction).
    assert all(abs(t - c) == 1 and 1 <= t <= 3 for _, c, t in acted), acted
    assert re.fullmatch(r"(up,)+(down,)+", "".join(a + "," for a, _, _ in acted)), acted
    assert [(c, t) for a, c, t in acted if a == "up"][-1] == (2, 3) and acted[-1][1:] == (2, 1), acted
    n_up, n_down = (sum(a == x for a, _, _ in acted) for x in ("up", "down"))
    metrics = parse_prometheus(httpx.get(f"http://127.0.0.1:{planner_port}/metrics", timeout=10).text)
    decided = {labels["action"]: v for labels, v in metrics["elastic_planner_decisions_total"]}
    assert (decided["up"], decided["down"]) == (n_up, n_down), metrics
    assert metrics["elastic_planner_target_dp"] == [({}, 1.0)], metrics
    log = server.log_path.read_text()
    for line in re.findall(r"planner: decision (?:up|down) .*", log):
        print(line)
    assert re.search(r"planner: decision up target=2 current=1 inputs=\{.*\"predicted\".*\} reason=", log)
    print(f"{len(load.results)} requests; up 1->3 in {up_s:.1f} s, down 3->1 in {down_s:.1f} s")


def test_dead_planner_leaves_the_deployment_serving(server, reference, planner_port):
    m = re.search(r"started Planner \(pid (\d+)", server.log_path.read_text())
    assert m, server.tail()
    pid = int(m.group(1))
    before = server.topology()
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    gone = f"component Planner (pid {pid}) was killed by signal SIGKILL; non-critical, the rest keeps running"
    while time.monotonic() < deadline and gone not in server.log_path.read_text():
        time.sleep(0.2)
    assert gone in server.log_path.read_text(), server.tail()
    # The rest keeps serving, at the same size, and more load does not change it.
    load = Load(server)
    try:
        load.set_clients(6)
        time.sleep(8)
    finally:
        load.set_clients(0)
    assert server.proc.poll() is None, server.tail()
    after = server.topology()
    assert (after["dp_size"], after["epoch"]) == (before["dp_size"], before["epoch"])
    assert load.errors == [] and load.results
    assert all(text == reference[p] for p, text, _, _ in load.results)
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{planner_port}/metrics", timeout=2)


# ---------------------------------------------------------------------------------------------
# the Kubernetes capacity provider against a fake API server


def test_kubernetes_provider_scales_the_statefulset():
    from aiohttp import web

    from components.control.capacity_k8s import KubernetesProvider

    state = {"replicas": 2, "patches": [], "auth": set()}

    async def scale(request):
        state["auth"].add(request.headers.get("Authorization"))
        if request.method == "PATCH":
            assert request.content_type == "application/merge-patch+json"
            body = await request.json()
            state["replicas"] = body["spec"]["replicas"]
            state["patches"].append(state["replicas"])
        return web.json_response(
            {"kind": "Scale", "spec": {"replicas": state["replicas"]}, "status": {"replicas": state["replicas"]}}
        )

    async def pod(request):
        i = int(request.match_info["name"].rsplit("-", 1)[1])
        if i >= state["replicas"]:
            return web.json_response({"kind": "Status", "code": 404}, status=404)
        phase = "Failed" if i == 3 else "Running"
        return web.json_response({"metadata": {"name": request.match_info["name"]}, "status": {"phase": phase}})

    async def go():
        app = web.Application()
        app.add_routes(
            [
                web.route("*", "/apis/apps/v1/namespaces/ns/statefulsets/worker/scale", scale),
                web.get("/api/v1/namespaces/ns/pods/{name}", pod),
            ]
        )
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_ports(1)[0]
        await web.TCPSite(runner, "127.0.0.1", port).start()
        prov = KubernetesProvider(
            api_url=f"http://127.0.0.1:{port}", namespace="ns", statefulset="worker", token="t0k", poll_s=0.05
        )
        try:
            await prov.acquire([2, 3], op="op1")
            assert state["replicas"] == 4
            await asyncio.sleep(0.3)
            assert prov.alive(2) is True and prov.alive(3) is False and prov.alive(7) is None
            await prov.release(3, op="op1", graceful=False)
            assert state["replicas"] == 3
            await prov.release(2, op="op2", graceful=True)
            assert state["replicas"] == 2
            with pytest.raises(RuntimeError, match="rank 5 cannot start alone.*ranks 2..4 are not started"):
                await prov.acquire([5], op="op3")
        finally:
            await prov.close()
            await runner.cleanup()

    asyncio.run(go())
    assert state["auth"] == {"Bearer t0k"}
    assert state["patches"] == [4, 3, 2]
