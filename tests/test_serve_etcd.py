"""etcd discovery, a flag away: the elastic graph against a real etcd (Debian's etcd-server)."""

from __future__ import annotations

import time

import pytest

from harness.etcd import kv, running_etcd
from harness.server import Server


@pytest.fixture
def etcd():
    with running_etcd() as url:
        yield url


def test_elastic_graph_on_etcd(etcd):
    srv = Server(["--discovery", "etcd", "--etcd-endpoints", etcd])
    try:
        registered = list(kv(etcd))
        assert any("worker" in k and "generate" in k for k in registered), registered
        text = srv.stream_text([5, 17, 42], 8)
        assert text
        assert srv.topology()["active"] == [0, 1]
    finally:
        assert srv.stop() == 0
    # Leases end with the processes: nothing of this deployment stays registered.
    deadline = time.monotonic() + 15
    while any("worker" in k for k in kv(etcd)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not any("worker" in k for k in kv(etcd)), list(kv(etcd))
