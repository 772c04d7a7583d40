"""NixlCommunicator over real NIXL/UCX between real processes (CPU DRAM; a GPU variant where CUDA is).

Each rank is a `python -m harness.ep_peer` process; ranks exchange metadata and barriers through
files in the test's tmp dir and report digests of everything they received, which the test
checks byte-for-byte against the deterministic payloads in harness/ep_peer.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from components.engine.exchange.communicator import EPError
from components.engine.exchange.nixl import NixlCommunicator
from harness.ep_peer import digest, payload, wait_files, write_atomic
from harness.server import freeze

ROOT = Path(__file__).resolve().parent.parent
CAP = 1 << 16


def _spawn(tmp: Path, scenario: str, world: int, *extra: str) -> list[subprocess.Popen]:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = []
    for r in range(world):
        log = open(tmp / f"log-{r}.txt", "wb")
        cmd = [
            sys.executable,
            "-m",
            "harness.ep_peer",
            "--scenario",
            scenario,
            "--rank",
            str(r),
            "--world",
            str(world),
            "--dir",
            str(tmp),
            *extra,
        ]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
        log.close()
    return procs


def _logs(tmp: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(tmp.glob("log-*.txt")))


def _join(tmp: Path, procs, timeout: float = 120.0, expect_rc=None) -> list[dict]:
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"peers did not finish in {timeout}s\n{_logs(tmp)}")
    results = []
    for r, p in enumerate(procs):
        want = 0 if expect_rc is None else expect_rc.get(r, 0)
        if want is not None:
            assert p.returncode == want, f"rank {r} exited {p.returncode}\n{_logs(tmp)}"
        path = tmp / f"result-{r}.json"
        results.append(json.loads(path.read_text()) if path.exists() else None)
    return results


def _run(tmp: Path, scenario: str, world: int, *extra: str, timeout: float = 120.0) -> list[dict]:
    return _join(tmp, _spawn(tmp, scenario, world, *extra), timeout)


def _check_rounds(res: dict, cap: int = CAP) -> int:
    """Every round: results from exactly the active ranks, each byte-identical to what was sent."""
    assert "fatal" not in res, res["fatal"]
    assert res["mismatches"] == 0
    me = res["rank"]
    for rnd in res["rounds"]:
        assert sorted(int(s) for s in rnd["recv"]) == rnd["active"], rnd
        for src, got in rnd["recv"].items():
            want = digest(payload(rnd["tag"], rnd["i"], int(src), me, cap))
            assert got == want, f"rank {me} round {rnd['tag']}/{rnd['i']} from {src}: {got} != {want}"
    return len(res["rounds"])


def _sizes_seen(results, cap: int = CAP) -> set[int]:
    return {n for res in results for rnd in res["rounds"] for n, _ in rnd["recv"].values()}


def test_all_to_all_2_ranks(tmp_path):
    results = _run(tmp_path, "exchange", 2, "--rounds", "30", "--overcap", "--latency", "1000")
    for res in results:
        assert _check_rounds(res) == 30
    sizes = _sizes_seen(results)
    assert {0, CAP}.issubset(sizes) and len(sizes) > 5, sizes
    err = results[0]["errors"]["overcap"]
    assert err.startswith("EPError") and "rank 1" in err and str(CAP + 1) in err and str(CAP) in err
    lat = results[0]["latency_us"]
    print(f"\nall_to_all, 2 ranks, 64 B payloads, CPU/UCX: {lat:.1f} us per call (rank 0)")


def test_all_to_all_4_ranks(tmp_path):
    results = _run(tmp_path, "exchange", 4, "--rounds", "12", "--tag", "four")
    for res in results:
        assert _check_rounds(res) == 12
        assert all(rnd["active"] == [0, 1, 2, 3] for rnd in res["rounds"])
    assert 0 in _sizes_seen(results)


def test_many_collectives_exercise_parity(tmp_path):
    cap = 512
    results = _run(tmp_path, "exchange", 2, "--rounds", "200", "--capacity", str(cap), "--tag", "many")
    for res in results:
        assert _check_rounds(res, cap) == 200


def test_connected_subset_then_all_four(tmp_path):
    results = _run(tmp_path, "subset", 4, "--rounds", "8")
    for res in results:
        assert _check_rounds(res) == 16
        r = res["rank"]
        assert res["connected"] == [0, 1, 2, 3]
        assert res["active0"] == ([0, 1] if r < 2 else [r])
        first = [rnd["active"] for rnd in res["rounds"] if rnd["tag"] == "sub0"]
        second = [rnd["active"] for rnd in res["rounds"] if rnd["tag"] == "sub1"]
        assert first == [[0, 1] if r < 2 else [r]] * 8
        assert second == [[0, 1, 2, 3]] * 8


def test_a_parked_rank_suspends_and_resumes_with_the_same_buffers(tmp_path):
    results = _run(tmp_path, "park", 2, "--rounds", "4")
    for res in results:
        assert _check_rounds(res) == 4 + 1 + 4
        assert res["same_buffers"]
        assert [rnd["active"] for rnd in res["rounds"] if rnd["tag"] == "after"] == [[0, 1]] * 4
    assert results[1]["renamed"] and not results[0]["renamed"]
    assert results[1]["suspended_metadata"] == ""
    # Its buffers' pages were given back: at most the two partial pages at each buffer's ends.
    assert results[1]["resident_after_suspend"] <= 4 * os.sysconf("SC_PAGE_SIZE")
    assert results[1]["errors"]["connect_suspended"] == (
        "EPError: rank 1: communicator is suspended (parked); resume() it first"
    )


@pytest.mark.gpu
def test_a_parked_rank_survives_a_cuda_checkpoint(tmp_path):
    """The parked rank of the park scenario is checkpointed and restored (CUDA driver API) while
    its peer goes on; then both reconnect. NIXL's EP buffers stay in host memory: a peer's UCX
    keeps device buffers mapped over CUDA IPC after a disconnect, and the driver then refuses the
    restore (CUDA_ERROR_INVALID_VALUE, H200, driver 580). On the GPU the MoE exchange goes through
    peer windows instead, which peers unmap before the checkpoint (tests/test_gpu_elastic.py,
    `window`)."""
    from snapshot import cuda_checkpoint

    ok, why = cuda_checkpoint.available()
    if not ok:
        pytest.skip(why)
    procs = _spawn(tmp_path, "park", 2, "--rounds", "4", "--device", "cpu", "--hold")
    wait_files([tmp_path / "parked"], timeout=120)
    pid = int((tmp_path / "parked").read_text())
    try:
        cuda_checkpoint.checkpoint(pid)
        assert cuda_checkpoint.state(pid) == "checkpointed"
        cuda_checkpoint.restore(pid)
    finally:
        write_atomic(tmp_path / "unpark", b"")
    results = _join(tmp_path, procs)
    assert results[1]["held_intact"]
    for res in results:
        assert _check_rounds(res) == 4 + 1 + 4


def test_mask_remote_is_local(tmp_path):
    results = _run(tmp_path, "mask", 2, "--rounds", "5")
    for res in results:
        r = res["rank"]
        _check_rounds(res)
        assert res["active_masked"] == [r]
        local = [rnd for rnd in res["rounds"] if rnd["tag"].startswith("mask")]
        assert len(local) == 5 and all(list(rnd["recv"]) == [str(r)] for rnd in local)
        err = res["errors"]["masked_dest"]
        assert err.startswith("EPError") and f"rank {1 - r}" in err and "not active" in err
        unmasked = [rnd for rnd in res["rounds"] if rnd["tag"] == "unmasked"]
        assert unmasked[0]["active"] == [0, 1]


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_dead_or_hung_peer_raises_within_timeout(tmp_path, how):
    """A killed peer (UCX sees the disconnect) and a frozen one (SIGSTOP: only the timeout can
    tell) both give the survivors an EPError naming rank 2; they then scale down and carry on."""
    world, victim, timeout = 3, 2, 3.0
    procs = _spawn(tmp_path, "kill", world, "--rounds", "4", "--timeout", str(timeout))
    try:
        wait_files([tmp_path / f"bar-rounds-{r}" for r in range(world)] + [tmp_path / f"result-{victim}.json"], 60)
    except TimeoutError:
        for p in procs:
            p.kill()
        pytest.fail(f"peers did not reach the kill point\n{_logs(tmp_path)}")
    if how == "kill":
        procs[victim].kill()
        procs[victim].wait()
    else:
        freeze(procs[victim].pid)
    write_atomic(tmp_path / "killed", b"")
    try:
        results = _join(tmp_path, procs[:victim])
    finally:
        procs[victim].kill()
        procs[victim].wait()
    for r in range(world - 1):
        res = results[r]
        err = res["errors"]["dead_peer"]
        assert err.startswith("EPError") and "rank 2" in err, err
        if how == "stop":
            assert "timed out" in err and "no data from rank 2" in err, err
        assert res["error_after_s"] < timeout + 2.0, res["error_after_s"]
        assert res["connected_after"] == [0, 1]
        _check_rounds(res)
        post = [rnd for rnd in res["rounds"] if rnd["tag"] == "post"]
        assert len(post) == 4 and all(rnd["active"] == [0, 1] for rnd in post)
        print(f"\n{how}: rank {r}: dead peer reported after {res['error_after_s']:.2f}s: {err}")


# ---------------------------------------------------------------- in-process (no collectives)


@pytest.fixture(scope="module")
def comm():
    c = NixlCommunicator(0, 4, 1024, timeout_s=2.0)
    yield c
    c.close()


def test_capacity_mismatch_is_refused(comm):
    other = NixlCommunicator(1, 4, 2048)
    try:
        with pytest.raises(EPError, match=r"capacity_bytes=2048.*capacity_bytes=1024"):
            comm.connect({1: other.metadata()})
        assert comm.connected == (0,)
        with pytest.raises(EPError, match="max_ranks"):
            other2 = NixlCommunicator(2, 8, 1024)
            try:
                comm.connect({2: other2.metadata()})
            finally:
                other2.close()
        with pytest.raises(EPError, match="belongs to rank 1"):
            comm.connect({3: other.metadata()})
    finally:
        other.close()


def test_local_only_and_invalid_inputs(comm):
    assert comm.active == (0,) and comm.connected == (0,)
    x = torch.arange(100, dtype=torch.uint8)
    out = comm.all_to_all({0: x})
    assert list(out) == [0] and torch.equal(out[0], x) and out[0].data_ptr() != x.data_ptr()
    assert comm.all_to_all({})[0].numel() == 0
    with pytest.raises(EPError, match=r"rank 0: payload for rank 0 is 1025 bytes, over capacity_bytes=1024"):
        comm.all_to_all({0: torch.zeros(1025, dtype=torch.uint8)})
    with pytest.raises(EPError, match=r"to rank 3 .*not active"):
        comm.all_to_all({3: torch.zeros(1, dtype=torch.uint8)})
    with pytest.raises(EPError, match=r"1-D uint8"):
        comm.all_to_all({0: torch.zeros(4, dtype=torch.float32)})
    with pytest.raises(EPError, match=r"ranks \[1, 2\]: not connected"):
        comm.set_active([0, 1, 2], 5)
    with pytest.raises(EPError, match="malformed"):
        comm.connect({1: b"not metadata"})
    comm.set_active([0], 3)
    with pytest.raises(EPError, match="epoch 2 does not follow"):
        comm.set_active([0], 2)
    comm.set_active([0], 3)  # same set, same epoch, nothing run yet: a no-op
    comm.mask_remote()
    assert comm.active == (0,)


def test_close_twice_and_use_after_close():
    c = NixlCommunicator(1, 2, 64)
    c.close()
    c.close()
    with pytest.raises(EPError, match="closed"):
        c.all_to_all({})


@pytest.mark.gpu
def test_all_to_all_2_ranks_gpu(tmp_path):
    results = _run(tmp_path, "exchange", 2, "--rounds", "20", "--device", "cuda", "--latency", "500", timeout=120)
    for res in results:
        assert _check_rounds(res) == 20
    print(f"\nall_to_all, 2 ranks, 64 B payloads, VRAM/UCX: {results[0]['latency_us']:.1f} us per call")
