"""The peer-window EP exchange between processes (harness/window_peer.py): rows reach the right
peer and slot and come back in order, eagerly and replayed from a CUDA graph, between ranks on one
GPU and on two; a peer that never sends makes the others' exchange fail with EPError naming it
(after the timeout, not a hang); counts short of the ranks are refused before a kernel reads them."""

from __future__ import annotations

import base64
import json
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu


def run_group(devices: list[str], *extra: str, timeout: float = 120) -> list[dict]:
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "harness.window_peer", "--rank", str(r), "--device", dev, *extra],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for r, dev in enumerate(devices)
    ]
    metas = [p.stdout.readline().strip() for p in procs]
    for m in metas:
        base64.b64decode(m)  # a rank that failed to start printed no metadata
    for p in procs:
        p.stdin.write(json.dumps(metas) + "\n")
        p.stdin.flush()
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=timeout)
        assert p.returncode == 0
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def layouts() -> list[list[str]]:
    out = [["cuda:0", "cuda:0"], ["cuda:0"] * 4]
    if torch.cuda.device_count() >= 2:
        out += [["cuda:0", "cuda:1"], ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]]
    return out


@pytest.mark.parametrize("devices", layouts(), ids=lambda d: "+".join(d))
def test_rows_come_back_exact_eager_and_from_a_graph(devices):
    for res in run_group(devices):
        print(res)
        assert res["eager_ok"] and res["graph_ok"], res


def test_a_silent_peer_fails_the_exchange_with_its_rank():
    results = run_group(["cuda:0", "cuda:0", "cuda:0"], "--silent-peer", "2")
    for res in results[:2]:
        assert res["error"] and "ranks [2]" in res["error"] and "timed out" in res["error"], res


def test_too_few_counts_is_refused_before_any_kernel_reads_them():
    from components.engine.exchange.windows import PeerWindows
    from harness.window_peer import experts

    dev = torch.device("cuda:0")
    win = PeerWindows(0, 4, 64, 256, torch.bfloat16, dev, "node")
    try:
        rows = torch.zeros(8, 256, dtype=torch.bfloat16, device=dev)
        local = torch.zeros(8, dtype=torch.int32, device=dev)
        counts = torch.tensor([8, 0], device=dev)
        with pytest.raises(ValueError, match="^2 counts for an exchange of 4 ranks$"):
            win.exchange(rows, local, counts, torch.empty_like(rows), experts)
    finally:
        win.close()
