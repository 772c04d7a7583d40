"""Snapshots in the elastic flow: a baked snapshot that fits is used for a joiner, tampered or
foreign ones are refused with the reason and the joiner cold-starts; a leaving rank parks and the
next scale-up restores it instead of starting a process."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from harness.reference import make_checkpoint
from harness.server import ROOT, Server, Traffic, engine_reference, scale
from snapshot.bake import bake

MAX_TOKENS = 24
PROMPTS = [[5 + i, 17, 42 + i, 99, 7 * i + 3, 250] for i in range(8)]


@pytest.fixture(scope="module")
def snapshots(tmp_path_factory):
    root = tmp_path_factory.mktemp("snapshots")
    good, _ = bake(root / "good", progress=False)
    tampered, _ = bake(root / "tampered", progress=False)
    with open(tampered / "engine.json", "r+b") as f:
        f.seek(3)
        f.write(b"X")
    other = make_checkpoint("mixtral", tmp_path_factory.mktemp("other-model"))
    bake(root / "other", model_dir=other, max_len=256, progress=False)
    return root, good


@pytest.fixture(scope="module")
def server(snapshots):
    root, _ = snapshots
    srv = Server(["--Worker.max_ranks=4", f"--Worker.snapshot_root={root}", "--Planner.enabled=false"])
    try:
        yield srv
    finally:
        srv.stop()


def test_joiners_use_a_fitting_snapshot_refuse_bad_ones_and_restore_parked_ranks(server, snapshots):
    reference = dict(enumerate(engine_reference(PROMPTS, MAX_TOKENS)))
    with Traffic(server, PROMPTS, MAX_TOKENS, clients=3) as traffic:
        up = scale(server, 3)
        down = scale(server, 2)
        again = scale(server, 3)
    assert [op["phase"] for op in (up, down, again)] == ["done"] * 3, (up, down, again)
    assert up["joined_from"] == {"2": "snapshot"}
    assert down["parked"] == [2]
    assert again["joined_from"] == {"2": "parked"}
    assert again["phases"]["starting"] < up["phases"]["starting"]
    log = server.tail(2000)
    assert "engine.json: checksum mismatch" in log  # the tampered one, refused by name
    assert "model_identity" in log  # the other model's, refused by field
    assert "RESTORED (from artifacts snapshot" in log
    assert traffic.errors == []
    assert all(toks == reference[p] for p, toks, _, _ in traffic.results)


def test_no_fitting_snapshot_falls_back_to_a_cold_start(server, snapshots):
    root, good = snapshots
    shutil.rmtree(good)
    op = scale(server, 4)
    assert op["phase"] == "done" and op["joined_from"] == {"3": "cold"}, op
    assert scale(server, 2)["phase"] == "done"


def test_checkpointing_parked_cuda_ranks_needs_the_vmm_arena(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "components.graph.serve",
            "serve",
            "graphs/elastic:Frontend",
            "--discovery-dir",
            str(tmp_path),
            "--Worker.device=cuda",
            "--Router.checkpoint_parked=true",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Router.checkpoint_parked needs --Worker.vmm=true" in r.stderr
    assert "started" not in r.stdout + r.stderr
