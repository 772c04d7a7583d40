"""Snapshots: bake the artifacts tier on CPU, verify, inspect, refuse mismatches, the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from snapshot import cuda_checkpoint
from snapshot.bake import DEFAULTS, bake, target_for
from snapshot.criu import criu_status
from snapshot.manifest import (
    SnapshotCorrupt,
    SnapshotExists,
    SnapshotManifest,
    SnapshotMismatch,
    check_compatible,
    load_manifest,
    verify,
    write_snapshot,
)
from snapshot.store import find_compatible, list_snapshots, remove_snapshot

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return tmp_path_factory.mktemp("snapshots")


@pytest.fixture(scope="module")
def builtin_snap(store):
    path, m = bake(store / "builtin", progress=False)
    return path, m


@pytest.fixture(scope="module")
def builtin_target():
    return target_for(None)  # the Worker defaults, on this machine


def cli(*args, env_root=None, check=None):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    if env_root is not None:
        env["ELASTIC_EP_SNAPSHOTS"] = str(env_root)
    r = subprocess.run(
        [sys.executable, "-m", "snapshot.cli", *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=120,
    )
    if check is not None:
        assert r.returncode == check, (r.returncode, r.stdout, r.stderr)
    return r


def test_defaults_follow_the_worker():
    from components.worker import Worker

    c = Worker.Config()
    assert DEFAULTS == {k: getattr(c, k) for k in DEFAULTS}


def test_bake_builtin_verifies_and_matches_its_deployment(builtin_snap, builtin_target):
    path, m = builtin_snap
    assert sorted(p.name for p in path.iterdir()) == [
        "engine.json",
        "manifest.json",
        "model_config.json",
        "warmup.json",
    ]
    assert verify(path) == m == load_manifest(path)
    assert m.tier == "artifacts" and not m.weights_included
    assert m.device_type == "cpu" and m.driver_version == "" and m.cuda_graph_sizes == []
    assert (m.max_ranks, m.max_seqs, m.max_len) == (4, 16, 4096) and m.dtype == "float32"  # the model's length
    assert m.num_experts == 8 and m.slots_per_rank == 8  # min_ranks 1: every expert on one rank
    assert m.model_identity == builtin_target.model_identity and m.model_name == "elastic-ep/tiny-moe"
    assert m.warmup_seconds > 0
    check_compatible(m, builtin_target)  # no exception
    check_compatible(path, builtin_target)
    from components.engine.rank import RankConfig

    cfg = msgspec.json.decode((path / "engine.json").read_bytes(), type=RankConfig)
    assert cfg.max_ranks == 4 and cfg.device == "cpu"
    warm = json.loads((path / "warmup.json").read_text())
    assert set(warm["steps_s"]) >= {"load_skeleton", "warmup"}


def test_tampered_file_is_named(builtin_snap, tmp_path):
    import shutil

    src, _ = builtin_snap
    d = tmp_path / "copy"
    shutil.copytree(src, d)
    verify(d)
    f = d / "engine.json"
    raw = bytearray(f.read_bytes())
    raw[10] ^= 1
    f.write_bytes(bytes(raw))
    with pytest.raises(SnapshotCorrupt, match=r"engine\.json: checksum mismatch \(tampered or corrupt\)") as e:
        verify(d)
    assert str(d) in str(e.value)
    f.unlink()
    with pytest.raises(SnapshotCorrupt, match=r"engine\.json: missing"):
        verify(d)
    shutil.copy(src / "engine.json", f)
    (d / "extra.bin").write_bytes(b"x")
    with pytest.raises(SnapshotCorrupt, match=r"extra\.bin: unexpected file"):
        verify(d)
    (d / "manifest.json").write_text("{not json")
    with pytest.raises(SnapshotCorrupt, match=r"manifest\.json: invalid manifest"):
        verify(d)
    (d / "manifest.json").unlink()
    with pytest.raises(SnapshotCorrupt, match=r"manifest\.json is missing"):
        verify(d)


def test_other_model_and_max_ranks_are_refused(builtin_snap, builtin_target, store, tmp_path):
    from harness.reference import make_checkpoint

    model = make_checkpoint("mixtral", tmp_path / "mixtral")
    path, m = bake(store / "mixtral", model, max_len=256, progress=False)
    with pytest.raises(SnapshotMismatch) as e:
        check_compatible(m, builtin_target, path=path)
    msg = str(e.value)
    assert msg.startswith(
        f"snapshot {path}: does not match this deployment: model_identity is "
        f"{m.model_identity[:12]}.. in the snapshot, {builtin_target.model_identity[:12]}.. here"
    )
    assert "max_len is 256 in the snapshot, 4096 here" in msg
    assert "max_ranks" not in msg

    other = msgspec.structs.replace(builtin_target, max_ranks=8)
    with pytest.raises(
        SnapshotMismatch,
        match=r"^snapshot .*builtin: does not match this deployment: "
        r"max_ranks is 4 in the snapshot, 8 here$",
    ):
        check_compatible(builtin_snap[0], other)

    ok, refused = find_compatible(builtin_target, store)
    assert [i.path for i in ok] == [str(builtin_snap[0])]
    assert "model_identity" in refused[str(path)]
    remove_snapshot(path)
    assert not path.exists()


def test_write_snapshot_is_atomic_and_refuses_overwrite(tmp_path, builtin_snap):
    m = builtin_snap[1]
    d = tmp_path / "s"
    written = write_snapshot(d, m, {"a.txt": b"a", "sub/b.bin": b"b"})
    assert set(written.files) == {"a.txt", "sub/b.bin"} and verify(d) == written
    with pytest.raises(SnapshotExists, match="already exists"):
        write_snapshot(d, m, {"a.txt": b"c"})
    write_snapshot(d, m, {"a.txt": b"c"}, force=True)
    assert (d / "a.txt").read_bytes() == b"c" and not (d / "sub").exists()
    other = tmp_path / "not-a-snapshot"
    other.mkdir()
    (other / "precious").write_text("keep")
    with pytest.raises(SnapshotExists, match="not a snapshot"):
        write_snapshot(other, m, {"a.txt": b"a"}, force=True)
    assert (other / "precious").exists()
    with pytest.raises(ValueError):
        write_snapshot(tmp_path / "t", m, {"../escape": b"x"})
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp dirs left
    assert list_snapshots(tmp_path)[0].path == str(d)


def test_criu_status_sentences(tmp_path):
    ok, why = criu_status(criu=None) if not __import__("shutil").which("criu") else (False, "")
    if why:
        assert not ok and why.startswith("CRIU not installed (apt-get install criu;")
    fake = tmp_path / "criu"
    fake.write_text("#!/bin/sh\necho 'Version: 3.17.1'\n")
    fake.chmod(0o755)
    assert criu_status(str(fake)) == (False, "CRIU 3.17.1 found; the criu tier needs >= 4.0 with its CUDA plugin")
    fake.write_text("#!/bin/sh\necho 'Version: 4.1'\necho 'GitID: v4.1'\n")
    ok, why = criu_status(str(fake), plugin_dirs=[str(tmp_path / "plugins")])
    assert not ok and "CRIU 4.1 found but not its CUDA plugin" in why
    (tmp_path / "plugins").mkdir()
    (tmp_path / "plugins" / "cuda_plugin.so").write_bytes(b"")
    assert criu_status(str(fake), plugin_dirs=[str(tmp_path / "plugins")])[0]


def test_cli_help():
    r = cli("--help", check=0)
    for sub in ("bake", "list", "inspect", "verify", "rm", "tiers"):
        assert sub in r.stdout
    for sub in ("bake", "list", "inspect", "verify", "rm", "tiers"):
        r = cli(sub, "--help", check=0)
        assert "usage: snapshot-bake " + sub in r.stdout
    assert "--max-ranks" in cli("bake", "--help").stdout


def test_cli_round_trip(tmp_path):
    root = tmp_path / "store"
    out = root / "one"
    r = cli("bake", "--out", out, "--max-ranks", 2, "-q", env_root=root, check=0)
    assert f"baked {out}" in r.stdout
    r = cli("bake", "--out", out, "-q", env_root=root, check=2)
    assert "already exists" in r.stderr and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1

    m = load_manifest(out)
    r = cli("list", env_root=root, check=0)
    assert (
        "ID" in r.stdout and m.snapshot_id in r.stdout and "elastic-ep/tiny-moe" in r.stdout and "artifacts" in r.stdout
    )
    r = cli("list", "--root", tmp_path / "empty", check=0)
    assert "no snapshots" in r.stdout

    r = cli("inspect", out, check=0)
    assert m.model_identity in r.stdout and "max_ranks" in r.stdout
    r = cli("inspect", m.snapshot_id, "--json", env_root=root, check=0)  # by id, under the root
    assert msgspec.json.decode(r.stdout.encode(), type=SnapshotManifest) == m

    r = cli("verify", out, check=0)
    assert r.stdout.startswith("ok")
    (out / "warmup.json").write_text("{}")
    r = cli("verify", out, check=1)
    assert "warmup.json: checksum mismatch" in r.stderr

    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "data").write_text("keep")
    r = cli("rm", plain, check=2)
    assert "manifest.json is missing" in r.stderr and "refusing" in r.stderr
    assert (plain / "data").exists()

    cli("rm", out, check=0)
    assert not out.exists()
    r = cli("list", env_root=root, check=0)
    assert "no snapshots" in r.stdout


def test_cli_bad_input(tmp_path, capsys):
    """Same code as the console script, in-process (no interpreter start per case)."""
    from snapshot.cli import main

    def run(*args):
        rc = main([str(a) for a in args])
        return rc, capsys.readouterr().err

    rc, err = run("bake", "--out", tmp_path / "x", "--model", tmp_path / "nope", "-q")
    assert rc == 2 and err.strip() == f"snapshot-bake: error: {tmp_path / 'nope'}: no such directory"
    (tmp_path / "m").mkdir()
    rc, err = run("bake", "--out", tmp_path / "x", "--model", tmp_path / "m", "-q")
    assert rc == 2 and "missing config.json" in err and len(err.strip().splitlines()) == 1
    rc, err = run("bake", "--out", tmp_path / "x", "--max-len", 100000, "-q")
    assert rc == 2 and "max_len 100000 exceeds" in err
    rc, err = run("bake", "--max-ranks", 2, "--min-ranks", 3)
    assert rc == 2 and "--min-ranks (3)" in err
    with pytest.raises(SystemExit) as e:
        run("bake", "--max-ranks", 0)
    assert e.value.code == 2 and "must be at least 1" in capsys.readouterr().err
    rc, err = run("verify", tmp_path / "nothing")
    assert rc == 1 and "no such directory" in err
    rc, err = run("inspect", tmp_path / "nothing")
    assert rc == 2 and "no such directory" in err
    assert not (tmp_path / "x").exists()


def test_cli_tiers():
    r = cli("tiers", check=0)
    lines = {ln.split()[0]: ln for ln in r.stdout.splitlines()}
    assert set(lines) == {"artifacts", "parked", "criu"}
    ok, why = cuda_checkpoint.available()
    if not ok:  # a CPU machine: say why the GPU parked tier is not possible
        assert "the GPU parked tier is unavailable: " + why in lines["parked"]
    ok, why = criu_status()
    assert why in lines["criu"]
    if not ok:
        assert "unavailable" in lines["criu"]


# ---- GPU ---------------------------------------------------------------------------------------

CHILD = r"""
import sys, torch
x = torch.arange(64 * 1024 * 1024, device="cuda", dtype=torch.float32)  # 256 MiB
s = float(x.double().sum()); print("ready", flush=True)
sys.stdin.readline()
print("same" if float(x.double().sum()) == s else "differs", flush=True)
"""


@pytest.mark.gpu
def test_cuda_checkpoint_round_trip():
    ok, why = cuda_checkpoint.available()
    if not ok:
        pytest.skip(why)
    p = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        assert cuda_checkpoint.state(p.pid) == "running"
        t = cuda_checkpoint.checkpoint(p.pid, timeout_ms=10000)
        assert set(t) == {"lock", "checkpoint"}
        assert cuda_checkpoint.state(p.pid) == "checkpointed"
        t = cuda_checkpoint.restore(p.pid)
        assert set(t) == {"restore", "unlock"}
        assert cuda_checkpoint.state(p.pid) == "running"
        p.stdin.write("go\n")
        p.stdin.flush()
        assert p.stdout.readline().strip() == "same"
    finally:
        p.kill()
        p.wait()


@pytest.mark.gpu
def test_bake_on_cuda_records_gpu_and_graphs(tmp_path):
    import torch

    path, m = bake(tmp_path / "gpu", device="cuda", max_seqs=8, progress=False)
    assert m.device_type == torch.cuda.get_device_name(0)
    assert m.cuda_graph_sizes == [1, 2, 4, 8]
    assert m.driver_version == "" or int(m.driver_version) >= 12000
    verify(path)
    check_compatible(m, target_for(None, device="cuda", max_seqs=8))
