"""Snapshots: bake the artifacts tier on CPU, verify, inspect, refuse mismatches, the CLI."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from harness.tamper import flip_byte
from snapshot import cuda_checkpoint
from snapshot.bake import DEFAULTS, bake, target_for
from snapshot.criu import criu_status
from snapshot.manifest import (
    SnapshotCorrupt,
    SnapshotExists,
    SnapshotManifest,
    SnapshotMismatch,
    SnapshotTarget,
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
    from components.worker.component import Worker

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


def test_checksums_are_not_recomputed_for_unchanged_files(builtin_snap, tmp_path, monkeypatch):
    """Each joiner restored from one image verifies it: the second time, files whose content is
    unchanged on disk are not hashed again, and a byte flipped in place is still found, even
    with the modification time set back (the change time moves whatever a writer does)."""
    import hashlib
    import os
    import shutil

    from snapshot import manifest

    src, _ = builtin_snap
    d = tmp_path / "copy"
    shutil.copytree(src, d)
    verify(d)
    hashed = []
    digest = hashlib.file_digest
    monkeypatch.setattr(hashlib, "file_digest", lambda f, algo: hashed.append(f.name) or digest(f, algo))
    verify(d)
    assert hashed == []
    f = d / "engine.json"
    st = f.stat()
    flip_byte(f, 10)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(SnapshotCorrupt, match=r"engine\.json: checksum mismatch"):
        verify(d)
    assert len(hashed) == 1 and manifest._hashed


def test_tampered_file_is_named(builtin_snap, tmp_path):
    import shutil

    src, _ = builtin_snap
    d = tmp_path / "copy"
    shutil.copytree(src, d)
    verify(d)
    f = d / "engine.json"
    flip_byte(f, 10)
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


def _in_time(fn, *args):
    """fn(*args), which must return or raise within seconds (a FIFO opened for reading would wait
    for a writer forever)."""
    import threading

    box: list = []

    def run():
        try:
            box.append(("ok", fn(*args)))
        except Exception as e:
            box.append(("raised", e))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(30)
    assert box, f"{fn.__name__} blocked"
    kind, value = box[0]
    if kind == "raised":
        raise value
    return value


def test_only_regular_files_inside_the_snapshot_are_read(builtin_snap, tmp_path):
    import shutil

    from snapshot.manifest import MANIFEST_MAX_BYTES, encode_manifest

    src, m = builtin_snap
    d = tmp_path / "copy"
    outside = tmp_path / "outside"
    outside.mkdir()

    def fresh():
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(src, d)
        return d / "engine.json"

    def refused(fn, says):
        with pytest.raises(SnapshotCorrupt) as e:
            _in_time(fn, d)
        assert str(e.value).startswith(f"snapshot {d}: ") and says in str(e.value), str(e.value)

    # engine.json as a link to an identical copy: its checksum would match if it were followed
    f = fresh()
    shutil.copy(f, outside / "engine.json")
    f.unlink()
    f.symlink_to(outside / "engine.json")
    refused(verify, "engine.json: a symbolic link, not a regular file")
    f.unlink()
    os.mkfifo(f)
    refused(verify, "engine.json: a FIFO, not a regular file")
    f.unlink()
    f.mkdir()
    refused(verify, "engine.json: a directory, not a regular file")

    # the manifest itself
    fresh()
    manifest = d / "manifest.json"
    shutil.copy(manifest, outside / "manifest.json")
    manifest.unlink()
    manifest.symlink_to(outside / "manifest.json")
    for fn in (load_manifest, verify):
        refused(fn, "manifest.json: a symbolic link, not a regular file")
    manifest.unlink()
    os.mkfifo(manifest)
    refused(load_manifest, "manifest.json: a FIFO, not a regular file")
    manifest.unlink()
    manifest.write_bytes(encode_manifest(m)[:-2] + b" " * MANIFEST_MAX_BYTES + b"}\n")
    refused(load_manifest, f"manifest.json: over {MANIFEST_MAX_BYTES} bytes, not a snapshot manifest")
    raw = json.loads(encode_manifest(m))
    manifest.write_text(json.dumps({**raw, "restore_hook": "rm -rf /"}))
    refused(load_manifest, "manifest.json: invalid manifest (Object contains unknown field `restore_hook`")
    manifest.write_text(json.dumps({**raw, "files": {**raw["files"], "engine.json": "abc"}}))
    refused(load_manifest, "manifest.json: invalid manifest (Expected `str` matching regex")

    # names that leave the snapshot are refused before anything is opened
    (outside / "x").write_text("secret")
    digest = __import__("hashlib").sha256(b"secret").hexdigest()
    for name in ("../outside/x", str(outside / "x"), "sub/../../outside/x", "./engine.json", "", "."):
        manifest.write_text(json.dumps({**raw, "files": {**raw["files"], name: digest}}))
        refused(load_manifest, f"manifest.json: invalid manifest (lists {name!r}, not a relative path inside")
    # ... and so is a path through a linked directory, whatever it points at
    (d / "sub").symlink_to(outside)
    manifest.write_text(json.dumps({**raw, "files": {**raw["files"], "sub/x": digest}}))
    refused(verify, "sub/x: sub is a symbolic link, not a directory")
    manifest.write_text(json.dumps(raw))
    refused(verify, "sub: unexpected file (not in manifest.json)")  # not listed: still not a snapshot's
    (d / "sub").unlink()
    assert verify(d) == m


def test_the_store_follows_no_links(builtin_snap, builtin_target, tmp_path):
    import shutil

    root = tmp_path / "store"
    root.mkdir()
    shutil.copytree(builtin_snap[0], root / "good")
    (root / "link").symlink_to(builtin_snap[0])
    os.mkfifo(root / "fifo")  # not a snapshot: skipped, never opened
    ok, refused = _in_time(find_compatible, builtin_target, root)
    assert [i.path for i in ok] == [str(root / "good")]
    assert refused == {str(root / "link"): f"snapshot {root / 'link'}: a symbolic link, not followed"}


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
    # The scheduling policy is part of the baked engine.
    mixed = msgspec.structs.replace(builtin_target, batch_invariant=False)
    with pytest.raises(SnapshotMismatch, match=r"batch_invariant is True in the snapshot, False here$"):
        check_compatible(builtin_snap[0], mixed)
    # A rank restored with another MoE exchange than its peers' could not join their group.
    assert m.ep_transport == builtin_target.ep_transport == "nixl"  # on CPU there is no other
    windows = msgspec.structs.replace(builtin_target, ep_transport="window")
    with pytest.raises(SnapshotMismatch, match=r"ep_transport is nixl in the snapshot, window here$"):
        check_compatible(builtin_snap[0], windows)
    # A CUDA image restores only on the GPU and driver it was baked on.
    baked = msgspec.structs.replace(m, device_type="NVIDIA H200", driver_version="13000")
    here = msgspec.structs.replace(baked, device_type="NVIDIA H100 80GB HBM3", driver_version="12080")
    with pytest.raises(
        SnapshotMismatch,
        match=r"device_type is 'NVIDIA H200' in the snapshot, 'NVIDIA H100 80GB HBM3' here; "
        r"driver_version is 13000 in the snapshot, 12080 here$",
    ):
        check_compatible(baked, SnapshotTarget(**{f: getattr(here, f) for f in SnapshotTarget.__struct_fields__}))

    ok, refused = find_compatible(builtin_target, store)
    assert [i.path for i in ok] == [str(builtin_snap[0])]
    assert "model_identity" in refused[str(path)]
    remove_snapshot(path)
    assert not path.exists()


def test_ep_transport_is_resolved_as_a_rank_resolves_it(monkeypatch):
    """The snapshot's field is the exchange the engine runs, not the option as written: "auto"
    takes the windows only where every rank can have a GPU of its own (or MPS runs)."""
    import torch

    from components.engine.rank import ep_transport
    from snapshot.bake import rank_config

    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", "/nonexistent")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    cuda = torch.device("cuda", 0)
    assert ep_transport(rank_config("cpu", ep_transport="window"), torch.device("cpu")) == "nixl"
    assert ep_transport(rank_config("cuda", ep_transport="window", max_ranks=16), cuda) == "window"
    assert ep_transport(rank_config("cuda", ep_transport="nixl", max_ranks=4), cuda) == "nixl"
    assert ep_transport(rank_config("cuda", max_ranks=8), cuda) == "window"  # auto, a GPU each
    assert ep_transport(rank_config("cuda", max_ranks=16), cuda) == "nixl"  # auto, GPUs shared
    assert target_for(None, device="cpu").ep_transport == "nixl"


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
    baked = cli("bake", "--out", out, "--max-ranks", 2, "-q", env_root=root, check=0).stdout  # the criu tier
    assert f"baked {out}" in baked and re.search(r"CRIU 4\.1\.1 image [\d.]+ [KMG]i?B, baked in [\d.]+ s", baked)
    r = cli("bake", "--out", out, "-q", env_root=root, check=2)
    assert "already exists" in r.stderr and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1

    m = load_manifest(out)
    assert m.tier == "criu" and m.criu_version == "4.1.1" and m.max_ranks == 2 and m.bake_seconds > 0
    image = {n: d for n, d in m.files.items() if n.startswith("criu/")}
    assert "criu/criu-image.json" in image and m.image_bytes == sum(
        (out / n).stat().st_size for n in image if n not in ("criu/criu-image.json", "criu/dump.log")
    )
    # What the bake says fills the image (its anonymous memory by mapping) is the image's size,
    # to within CRIU's metadata.
    memory = json.loads((out / "warmup.json").read_text())["image_memory"]["warm"]
    assert 0.9 * m.image_bytes < memory["total_bytes"] < 1.1 * m.image_bytes and memory["largest"]
    assert re.search(r"anonymous memory warm: [\d.]+ [KMG]i?B \(largest mappings: \S+ [\d.]+ [KMG]i?B", baked)
    r = cli("list", env_root=root, check=0)
    assert "ID" in r.stdout and m.snapshot_id in r.stdout and "elastic-ep/tiny-moe" in r.stdout and "criu" in r.stdout
    r = cli("list", "--root", tmp_path / "empty", check=0)
    assert "no snapshots" in r.stdout

    r = cli("inspect", out, check=0)
    assert m.model_identity in r.stdout and "max_ranks" in r.stdout
    r = cli("inspect", m.snapshot_id, "--json", env_root=root, check=0)  # by id, under the root
    assert msgspec.json.decode(r.stdout.encode(), type=SnapshotManifest) == m

    r = cli("verify", out, check=0)
    assert r.stdout.startswith("ok")
    core = next(n for n in image if n.startswith("criu/core-"))
    data = (out / core).read_bytes()
    (out / core).write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    r = cli("verify", out, check=1)
    assert f"{core}: checksum mismatch" in r.stderr
    (out / core).write_bytes(data)
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
    """Same code as the console script, in-process (no interpreter start per case). Every bad
    argument: exit 2, one line `snapshot-bake: error: ...`, nothing written."""
    from snapshot.cli import main

    def run(*args):
        try:
            rc = main([str(a) for a in args])
        except SystemExit as e:  # argparse's own checks
            rc = e.code
        return rc, capsys.readouterr().err

    def refused(*args, says: str):
        rc, err = run("bake", "-q", *args)
        assert rc == 2 and err.startswith("snapshot-bake: error: ") and says in err, (args, rc, err)
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err

    out = ("--out", tmp_path / "x")
    rc, err = run("bake", *out, "--model", tmp_path / "nope", "-q")
    assert rc == 2 and err.strip() == f"snapshot-bake: error: {tmp_path / 'nope'}: no such directory"
    (tmp_path / "m").mkdir()
    refused(*out, "--model", tmp_path / "m", says="missing config.json")
    (tmp_path / "file").write_text("not a model")
    refused(*out, "--model", tmp_path / "file", says=f"{tmp_path / 'file'}: not a directory")
    refused(*out, "--max-len", 100000, says="max_len 100000 exceeds")
    refused("--max-ranks", 2, "--min-ranks", 3, says="--min-ranks (3)")
    refused("--max-ranks", 0, says="argument --max-ranks: must be at least 1, got 0")
    refused("--max-ranks", 100000, says="argument --max-ranks: must be at most 1024, got 100000")
    refused("--max-seqs", 100000000, says="argument --max-seqs: must be at most 4096, got 100000000")
    refused("--max-batched-tokens", 10**9, says="must be at most 131072")
    refused("--max-len", -1, says="must be at least 0, got -1")
    refused("--redundant-experts", -1, says="argument --redundant-experts: must be at least 0, got -1")
    refused("--redundant-experts", "1e9", says="expected an integer, got '1e9'")
    # min_ranks 1: each rank holds every expert already, so any redundant expert changes nothing
    refused(*out, "--redundant-experts", 1, says="redundant_experts 1 does not fit")
    refused(*out, "--min-ranks", 2, "--redundant-experts", 9, says="hold at most 8 redundant experts")
    refused("--cuda-graph-sizes", "1,x", says="expected an integer, got 'x'")
    refused("--cuda-graph-sizes", "0", says="must be at least 1, got 0")
    refused("--cuda-graph-sizes", "1,2,99999", says="must be at most 4096")
    refused(*out, "--cuda-graph-sizes", "1,2", says="cuda_graph_sizes are captured on CUDA only")
    # (a GPU machine's check; here the CLI first finds no GPU)
    with pytest.raises(ValueError, match=r"128 exceeds both max_seqs \(8\) and max_batched_tokens \(64\)"):
        bake(tmp_path / "y", device="cuda", max_seqs=8, max_batched_tokens=64, cuda_graph_sizes=(8, 128))
    refused(*out, "--device", "tpu", says="--device must be cpu, cuda or cuda:N, not 'tpu'")
    refused("--bogus", says="unrecognized arguments: --bogus")
    # where the snapshot cannot be written: found before the engine is built, not after
    proc = "/proc/elastic-ep-test"
    refused("--out", f"{proc}/x", says=f"{proc}/x: cannot be created: /proc is not writable")
    refused("--root", proc, says=f"{proc}: cannot be created: /proc is not writable")
    refused("--out", tmp_path / "file" / "x", says=f"cannot be created: {tmp_path / 'file'} is not a directory")
    refused("--out", tmp_path / "file", says=f"{tmp_path / 'file'}: exists and is not a directory")
    os.mkfifo(tmp_path / "fifo")
    refused("--out", tmp_path / "fifo", "--force", says="exists and is not a directory")
    assert not (tmp_path / "x").exists() and (tmp_path / "file").read_text() == "not a model"

    # A missing snapshot directory, or none at all, is a bad argument to every command (2, the
    # same line); a directory that is no valid snapshot is a failed check (1) to `verify`.
    nothing = tmp_path / "nothing"
    for cmd in ("verify", "inspect", "rm"):
        rc, err = run(cmd, nothing)
        assert (rc, err) == (2, f"snapshot-bake: error: snapshot {nothing}: no such directory\n"), cmd
        rc, err = run(cmd, tmp_path / "fifo")
        assert (rc, err) == (2, f"snapshot-bake: error: snapshot {tmp_path / 'fifo'}: not a directory\n"), cmd
        # Path("") is the current directory: never taken for one
        rc, err = run(cmd, "")
        assert rc == 2 and err.startswith(f"snapshot-bake: error: argument DIR: an empty path (see snapshot-bake {cmd}")
    for args in (("list", "--root", ""), ("verify", "x", "--root", ""), ("bake", "-q", "--out", "")):
        rc, err = run(*args)
        assert rc == 2 and "an empty path" in err, args
    rc, err = run("verify", tmp_path / "m")  # a directory, but no snapshot
    assert rc == 1 and "manifest.json is missing" in err


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
    # One graph for every decode-only step (padded to max_seqs), and for steps with prompt tokens
    # the decodes plus one, two, ... 512-row prompt pieces up to CUDA's default budget of 8192.
    assert m.cuda_graph_sizes == [8, *(8 + 512 * k for k in range(1, 17))] and m.batch_invariant
    assert m.driver_version == "" or int(m.driver_version) >= 12000
    verify(path)
    check_compatible(m, target_for(None, device="cuda", max_seqs=8))
