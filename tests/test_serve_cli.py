"""`dynamo serve` end to end: the real console command, real Dynamo processes (echo graph)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from components.worker.component import FAULT_ENV
from harness.server import env_tool, free_ports

ROOT = Path(__file__).resolve().parents[1]
GRAPH = "tests/graphs/echo:Frontend"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_cli(*args: str, timeout: float = 60, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [env_tool("dynamo"), *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env
    )


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is dead for our purposes.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


class Served:
    """A `dynamo serve` run whose merged output goes to a file we poll."""

    def __init__(self, tmp: Path, *args: str) -> None:
        self.port = free_port()
        self.log_path = tmp / "serve.log"
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(
            [env_tool("dynamo"), "serve", GRAPH, f"--Frontend.port={self.port}", *args],
            cwd=ROOT,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.url = f"http://127.0.0.1:{self.port}/v1"

    @property
    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for(self, pattern: str, timeout: float = 30) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.search(pattern, self.output)
            if m:
                return m
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"{pattern!r} not seen in serve output:\n{self.output[-4000:]}")

    def pids(self) -> dict[str, int]:
        return {m[1]: int(m[2]) for m in re.finditer(r"started (\S+) \(pid (\d+)", self.output)}

    def discovery_dir(self) -> str:
        return self.wait_for(r"file discovery \((/[^)]+)\)")[1]

    def wait_models(self, n_workers: int, timeout: float = 40) -> None:
        self.wait_for(r"started Frontend \(pid")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.output[-4000:]
            try:
                r = httpx.get(f"{self.url}/models", timeout=2)
                if r.status_code == 200 and any(m["id"] == "echo" for m in r.json()["data"]):
                    served = len(re.findall(r"rank \d+ serving model", self.output))
                    if served >= n_workers:
                        return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"model never listed:\n{self.output[-4000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        for pid in self.pids().values():
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        self._log.close()


@pytest.fixture
def serve_factory(tmp_path: Path) -> Iterator:
    runs: list[Served] = []

    def start(*args: str) -> Served:
        s = Served(tmp_path, *args)
        runs.append(s)
        return s

    yield start
    for s in runs:
        s.stop()


# ---------------------------------------------------------------------------------------------
# CLI surface (nothing starts)


def test_help_explains_options() -> None:
    r = run_cli("serve", "--help")
    assert r.returncode == 0, r.stderr
    for text in (
        "--Name.key=value",
        "-f",
        "--namespace",
        "--discovery",
        "--etcd-endpoints",
        "exit codes",
        "startup deadline",
    ):
        assert text in r.stdout
    r = run_cli("serve", GRAPH, "--help")
    assert r.returncode == 0, r.stderr
    assert "--Frontend.port: int = 8000" in r.stdout
    assert "--EchoWorker.replicas: int = 1" in r.stdout


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("--Frontend.nope=1", "Frontend has no field 'nope'"),
        ("--Frontend.port=abc", "wrong type for Frontend.port"),
        ("--Nope.port=1", "unknown component 'Nope'"),
        ("--EchoWorker.replicas=[1]", "wrong type for EchoWorker.replicas"),
        ("--Frontend.router_mode=kv", "router_mode must be one of"),
        ("--Frontend.body_timeout_s=0", "body_timeout_s must be > 0"),
    ],
)
def test_bad_override_exits_2(override: str, message: str) -> None:
    r = run_cli("serve", GRAPH, override)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert message in r.stderr
    assert "started" not in r.stderr


def test_bad_config_file_exits_2(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("Frontend: {port: eighty}\n")
    r = run_cli("serve", GRAPH, "-f", str(cfg))
    assert r.returncode == 2 and "Frontend.port" in r.stderr, r.stderr
    cfg.write_text("Router: {x: 1}\n")
    r = run_cli("serve", GRAPH, "-f", str(cfg))
    assert r.returncode == 2 and "unknown component 'Router'" in r.stderr, r.stderr


def test_config_layers_and_module_form(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("Frontend: {port: 9001, migration_limit: 0}\nEchoWorker: {replicas: 3, model_name: m}\n")
    r = run_cli(
        "serve",
        "tests.graphs.echo:Frontend",
        "-f",
        str(cfg),
        "--Frontend.port=9002",
        "--EchoWorker.model_name",
        "123",
        "--dry-run",
    )
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert '"port": 9002' in out and '"migration_limit": 0' in out and '"replicas": 3' in out
    assert '"model_name": "123"' in out  # a string field keeps the raw text
    labels = re.findall(r"^(\S+?)(?: \(non-critical\))?: ", out, re.M)
    assert labels == ["EchoWorker.0", "EchoWorker.1", "EchoWorker.2", "Frontend"]


def test_bad_graph_exits_2() -> None:
    r = run_cli("serve", "tests/graphs/missing:Frontend")
    assert r.returncode == 2 and "not found" in r.stderr
    r = run_cli("serve", "tests.graphs.echo:Nope")
    assert r.returncode == 2 and "no attribute 'Nope'" in r.stderr


# ---------------------------------------------------------------------------------------------
# live graphs


def test_serve_echo_graph(serve_factory) -> None:
    s = serve_factory("--EchoWorker.replicas=2")
    ddir = s.discovery_dir()
    s.wait_models(n_workers=2)
    assert f"OpenAI API: {s.url}" in s.output

    client = openai.OpenAI(base_url=s.url, api_key="unused", max_retries=0, timeout=20)
    assert [m.id for m in client.models.list().data] == ["echo"]
    for _ in range(4):  # round-robin: both ranks answer
        c = client.completions.create(model="echo", prompt="hello world", max_tokens=32)
        assert c.choices[0].text == "hello world"
    assert "[Frontend] " in s.output and "[EchoWorker.1] " in s.output
    assert len(re.findall(r"\[EchoWorker\.\d\] .*request received", s.output)) >= 4

    # A worker rank is not critical: reported, and the graph keeps serving.
    pids = s.pids()
    os.kill(pids["EchoWorker.0"], signal.SIGKILL)
    s.wait_for(r"component EchoWorker\.0 \(pid \d+\) was killed by signal SIGKILL; non-critical")
    c = client.completions.create(model="echo", prompt="still here", max_tokens=32)
    assert c.choices[0].text == "still here"
    assert s.proc.poll() is None

    # SIGTERM: clean stop, exit 0, no child left, private discovery dir removed.
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(30) == 0, s.output[-3000:]
    assert "stopping (terminated)" in s.output
    assert [label for label, pid in pids.items() if alive(pid)] == []
    assert not os.path.exists(ddir)


def test_critical_death_stops_graph(serve_factory) -> None:
    s = serve_factory()
    ddir = s.discovery_dir()
    s.wait_models(n_workers=1)
    pids = s.pids()
    os.kill(pids["Frontend"], signal.SIGKILL)
    rc = s.proc.wait(30)
    assert rc != 0
    assert re.search(r"component Frontend \(pid \d+\) was killed by signal SIGKILL; it is critical", s.output)
    assert "Last log lines" in s.output
    assert not alive(pids["EchoWorker.0"])
    assert not os.path.exists(ddir)


def test_dynamo_without_subcommand_is_usage_error() -> None:
    r = run_cli()
    assert r.returncode == 2 and "serve" in r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "components.graph.serve", "serve"], cwd=ROOT, capture_output=True, text=True, timeout=30
    )
    assert r.returncode == 2 and "a graph is required" in r.stderr


def serve_to_its_end(tmp_path: Path, *options: str, env: dict[str, str] | None = None):
    """`dynamo serve` of the elastic graph on free ports, without the planner, until it stops: a
    configuration it cannot serve. The 150 s bound is below the router's 300 s bootstrap timeout."""
    return run_cli(
        "serve",
        "graphs/elastic:Frontend",
        "--discovery-dir",
        str(tmp_path),
        *options,
        f"--Frontend.port={free_port()}",
        f"--Router.port={free_port()}",
        "--Planner.enabled=false",
        timeout=150,
        env=env,
    )


def assert_stopped_because(r: subprocess.CompletedProcess, reason: str, who: str = r"Worker\.[01]") -> None:
    """The graph stopped with exit 1, its last word on the component `who` (a rank by default)
    the one line `reason` (a regex) it said, and no traceback anywhere."""
    assert r.returncode == 1, r.stdout + r.stderr
    assert re.search(rf"^dynamo serve: {who} cannot start: {reason}; stopping the graph$", r.stderr, re.M), r.stderr
    assert "Traceback" not in r.stdout + r.stderr


def test_a_rank_that_cannot_start_stops_the_graph_with_its_reason(tmp_path) -> None:
    """Not a router waiting 300 s for ranks that will never come: the first rank that cannot start
    stops everything, and its one-line reason is the last thing `dynamo serve` says about it."""
    r = serve_to_its_end(tmp_path, "--Worker.max_len=100000")
    assert_stopped_because(r, "max_len 100000 exceeds the model's 4096 positions")


def test_a_device_that_is_not_one_is_refused_at_start(tmp_path) -> None:
    r = run_cli("serve", "graphs/elastic:Frontend", "--discovery-dir", str(tmp_path), "--Worker.device=gpu")
    assert r.returncode == 2, r.stdout + r.stderr
    assert """invalid config for Worker: device must be "cpu", "cuda" or "cuda:N" (got 'gpu')""" in r.stderr
    assert "started" not in r.stdout + r.stderr


@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_cuda_where_none_is_usable_stops_the_graph_with_its_reason(tmp_path, device) -> None:
    """--Worker.device=cuda (or cuda:N, every rank on that GPU) where the ranks see no GPU (none is
    visible to them on any machine here): they say why they cannot start, not torch's error from
    its first CUDA call."""
    r = serve_to_its_end(tmp_path, f"--Worker.device={device}", env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert_stopped_because(
        r,
        rf"device {device}: (this torch \(.+\) is built without CUDA|"
        r"no CUDA device is visible \(CUDA_VISIBLE_DEVICES=\)); --Worker\.device=cpu runs on the CPU",
    )


def test_a_rank_that_cannot_import_the_engine_stops_the_graph_with_its_reason(tmp_path, tmp_path_factory) -> None:
    """A broken install (torch's CUDA libraries missing, a package not in this python) fails every
    retry alike: the rank names the python and the import error and the graph stops, not a
    frontend left up with no rank behind it. torch is shadowed by one whose import fails."""
    shadow = tmp_path_factory.mktemp("shadow")
    (shadow / "torch").mkdir()
    (shadow / "torch" / "__init__.py").write_text(
        'raise ImportError("libtorch_cuda.so: cannot open shared object file: No such file or directory")\n'
    )
    path = os.pathsep.join(p for p in (str(shadow), os.environ.get("PYTHONPATH", "")) if p)
    r = serve_to_its_end(tmp_path, env={**os.environ, "PYTHONPATH": path})
    assert_stopped_because(
        r,
        r"\S*python\S* cannot import the engine: "
        r"libtorch_cuda\.so: cannot open shared object file: No such file or directory",
    )


@pytest.mark.parametrize(
    "options, killed, reason",
    [
        (
            ["--Worker.dp_size=1"],
            0,
            r"every rank of the first group \(\[0\]\) died before registering: their last lines say why",
        ),
        (
            ["--Worker.dp_size=2", "--Worker.min_ranks=2"],
            1,
            r"ranks \[1\] of the first group died or hung before registering \(their last lines say why\): 1 left, "
            r"fewer than Worker\.min_ranks \(2\)",
        ),
    ],
    ids=["every-rank", "below-min-ranks"],
)
def test_first_ranks_killed_while_loading_leaving_too_few_stop_the_graph(tmp_path, options, killed, reason) -> None:
    """Too few ranks of the first group live to form it (killed as they load, never registered):
    the router says so and the graph stops, not a router waiting for them, restarted into that
    wait again. With enough left, the group forms without them (tests/test_failover.py)."""
    r = serve_to_its_end(tmp_path, *options, env={**os.environ, FAULT_ENV: f"killed_loading={killed}"})
    assert_stopped_because(r, reason, who="Router")
    assert re.search(rf"component Worker\.{killed} \(pid \d+\) was killed by signal SIGKILL", r.stderr), r.stderr


def serve_logged(log: Path, *args: str) -> subprocess.Popen:
    with log.open("w") as out:
        return subprocess.Popen(
            [env_tool("dynamo"), "serve", *args], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def started(log: Path, n: int) -> list[int]:
    """The pids of the Sidecar's first `n` starts."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        pids = [int(p) for p in re.findall(r"started Sidecar \(pid (\d+), restartable\)", log.read_text())]
        if len(pids) >= n:
            return pids
        time.sleep(0.1)
    raise AssertionError(log.read_text())


def test_a_restartable_component_is_started_again(tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    proc = serve_logged(log, "tests/graphs/restart:Sidecar")
    try:
        first = started(log, 1)[0]
        os.kill(first, signal.SIGKILL)
        second = started(log, 2)[1]
        assert second != first and alive(second)
        assert f"component Sidecar (pid {first}) was killed by signal SIGKILL; restarting it" in log.read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log.read_text()
        assert not alive(second)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_a_hung_component_is_killed_and_started_again(tmp_path: Path) -> None:
    """Stopped (SIGSTOP) for longer than its liveness deadline, a process that declares a health
    URL is taken for hung: SIGKILLed, and restarted like any restartable process that died."""
    log, port = tmp_path / "serve.log", free_ports(1)[0]
    url = f"http://127.0.0.1:{port}/"

    def answering() -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                httpx.get(url, timeout=1)
                return
            except httpx.HTTPError:
                time.sleep(0.1)
        raise AssertionError(log.read_text())

    proc = serve_logged(log, "tests/graphs/restart:Sidecar", f"--Sidecar.health_port={port}")
    try:
        first = started(log, 1)[0]
        answering()
        time.sleep(1.0)  # probed at least once: it has answered
        os.kill(first, signal.SIGSTOP)
        second = started(log, 2)[1]
        text = log.read_text()
        assert re.search(rf"Sidecar \(pid {first}\) did not answer {url} for \d+\.\d s: hung, SIGKILL", text), text
        assert f"component Sidecar (pid {first}) was killed by signal SIGKILL; restarting it" in text
        assert not alive(first)
        answering()  # the new one serves on the same port
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log.read_text()
        assert not alive(second)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_a_component_that_hangs_before_it_ever_answers_is_killed_and_started_again(tmp_path: Path) -> None:
    """Liveness before the first answer: a process that hangs in its start, never answering its
    health URL, is SIGKILLed at its startup deadline and restarted; the next start serves and is
    left alone past that deadline."""
    log, port = tmp_path / "serve.log", free_ports(1)[0]
    url = f"http://127.0.0.1:{port}/"
    proc = serve_logged(
        log,
        "tests/graphs/restart:Sidecar",
        f"--Sidecar.health_port={port}",
        "--Sidecar.hang_at_start=true",
        f"--Sidecar.hang_marker={tmp_path / 'hung-once'}",
        "--Sidecar.startup_timeout_s=2",
    )
    try:
        first, second = started(log, 2)[:2]
        text = log.read_text()
        assert f"Sidecar (pid {first}) did not answer {url} within 2 s of its start: hung, SIGKILL" in text, text
        assert f"component Sidecar (pid {first}) was killed by signal SIGKILL; restarting it" in text
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(url, timeout=1)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.1)
        time.sleep(3.0)  # past the startup deadline: an answering process is not killed
        assert alive(second) and log.read_text().count("hung, SIGKILL") == 1, log.read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_a_component_that_never_answers_stops_the_graph_after_three_starts() -> None:
    port = free_ports(1)[0]
    r = run_cli(
        "serve",
        "tests/graphs/restart:Sidecar",
        f"--Sidecar.health_port={port}",
        "--Sidecar.hang_at_start=true",
        "--Sidecar.startup_timeout_s=1",
    )
    assert r.returncode == 1, r.stderr
    url = f"http://127.0.0.1:{port}/"
    assert len(re.findall(rf"did not answer {url} within 1 s of its start: hung, SIGKILL", r.stderr)) == 3, r.stderr
    assert r.stderr.count("was killed by signal SIGKILL; restarting it") == 2, r.stderr
    assert (
        "was killed by signal SIGKILL, 3 times in a row before it ever answered its health URL; "
        "not restarting it again, stopping the graph" in r.stderr
    ), r.stderr


def test_a_restartable_component_that_keeps_dying_stops_the_graph() -> None:
    r = run_cli("serve", "tests/graphs/restart:Sidecar", "--Sidecar.exit_at_start=true")
    assert r.returncode == 1, r.stderr
    assert r.stderr.count("exited with code 3; restarting it") == 2, r.stderr
    assert (
        "component Sidecar (pid " in r.stderr
        and "exited with code 3, 3 times in a row within 30 s of its start; not restarting it again, stopping the graph"
        in r.stderr
    ), r.stderr
    assert "stopping (Sidecar keeps dying)" in r.stderr
