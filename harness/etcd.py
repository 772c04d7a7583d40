"""A real etcd (Debian's etcd-server, unpacked by `make install`) on free ports, for tests."""

from __future__ import annotations

import base64
import contextlib
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator

import httpx

from harness.server import env_tool, free_ports


@contextlib.contextmanager
def running_etcd() -> Iterator[str]:
    """A fresh etcd with a private data dir; yields its client URL, removes it all after."""
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


def kv(url: str) -> dict[str, str]:
    """Every key in etcd with its value, through its v3 JSON gateway (key and range_end "\\0":
    all keys)."""
    zero = base64.b64encode(b"\0").decode()
    r = httpx.post(f"{url}/v3/kv/range", json={"key": zero, "range_end": zero})
    return {
        base64.b64decode(e["key"]).decode(): base64.b64decode(e.get("value", "")).decode()
        for e in r.json().get("kvs", [])
    }
