"""etcd discovery, a flag away: the elastic graph against a real etcd (Debian's etcd-server)."""

from __future__ import annotations

import base64
import shutil
import subprocess
import tempfile
import time

import httpx
import pytest

from harness.server import Server, env_tool, free_ports


@pytest.fixture
def etcd():
    client, peer = free_ports(2)
    data = tempfile.mkdtemp(prefix="etcd-test-")
    url = f"http://127.0.0.1:{client}"
    proc = subprocess.Popen(
        [
            env_tool("etcd"),
            "--data-dir",
            data,
            "--listen-client-urls",
            url,
            "--advertise-client-urls",
            url,
            "--listen-peer-urls",
            f"http://127.0.0.1:{peer}",
            "--initial-advertise-peer-urls",
            f"http://127.0.0.1:{peer}",
            "--initial-cluster",
            f"default=http://127.0.0.1:{peer}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.2)
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        shutil.rmtree(data, ignore_errors=True)


def keys(url: str) -> list[str]:
    """Every key in etcd, through its v3 JSON gateway (key and range_end "\\0" = all keys)."""
    zero = base64.b64encode(b"\0").decode()
    r = httpx.post(f"{url}/v3/kv/range", json={"key": zero, "range_end": zero, "keys_only": True})
    return [base64.b64decode(kv["key"]).decode() for kv in r.json().get("kvs", [])]


def test_elastic_graph_on_etcd(etcd):
    srv = Server(["--discovery", "etcd", "--etcd-endpoints", etcd])
    try:
        registered = keys(etcd)
        assert any("worker" in k and "generate" in k for k in registered), registered
        text = srv.stream_text([5, 17, 42], 8)
        assert text
        assert srv.topology()["active"] == [0, 1]
    finally:
        assert srv.stop() == 0
    # Leases end with the processes: nothing of this deployment stays registered.
    deadline = time.monotonic() + 15
    while any("worker" in k for k in keys(etcd)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not any("worker" in k for k in keys(etcd)), keys(etcd)
