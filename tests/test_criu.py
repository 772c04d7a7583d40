"""CRIU, for real (the venv's, from `make install`; as root): detection, one image restored as two
concurrent copies that keep their memory and state, tampered images refused, and a process
holding an engine rank restored able to generate."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import snapshot.criu as criu_mod
from harness.server import alive, gone_within
from harness.tamper import flip_byte, largest
from snapshot.cli import tier_lines
from snapshot.criu import criu_status, find_criu
from snapshot.criu_image import IMAGE_MANIFEST, CriuError, dump, restore, spawn, verify_image
from snapshot.manifest import SnapshotCorrupt

SEED = 1234
DATA_BYTES = 64 << 20
REPO = Path(__file__).resolve().parents[1]
# The children import the project's modules.
REPO_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}

# The children below print "ready" once set up, then, on each SIGUSR1, serve one connection on a
# new unix socket whose random name they print: a copy restored from an image opens its own
# socket, after the restore, and says where on its own output. One command a line, `handle`
# answers it; "bye" ends the connection, "exit N" the process.
SERVE = r"""
import os, signal, socket, sys
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
print("ready", READY, flush=True)
while True:
    signal.sigwaitinfo({signal.SIGUSR1})
    path = os.path.join(sys.argv[1], os.urandom(8).hex() + ".sock")
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    srv.listen(1)
    print("listening", path, flush=True)
    conn, _ = srv.accept()
    srv.close()
    os.unlink(path)
    with conn, conn.makefile("rw") as f:
        for line in f:
            if line.strip() == "bye":
                break
            if line.startswith("exit "):
                os._exit(int(line.split()[1]))
            f.write(handle(line.strip()) + "\n")
            f.flush()
"""

# 64 MiB of known data and a small state machine (warm -> serving -> stopped, a counter), and an
# abstract unix socket held listening, as the CUDA driver holds one: every copy restores it.
CHILD = (
    r"""
import hashlib, os, random, socket, sys
data = random.Random(int(sys.argv[2])).randbytes(int(sys.argv[3]))
phase, n = "warm", 0
READY = ""
held = socket.socket(socket.AF_UNIX)
held.bind("\0elastic-ep-test-" + sys.argv[2])
held.listen(1)

def handle(cmd):
    global phase, n
    if cmd == "digest":
        return hashlib.sha256(data).hexdigest()
    if cmd == "net":  # where this thread's sockets go, after joining the restorer's namespace
        from snapshot.criu_image import join_restorer_network
        moved = join_restorer_network()
        return f"{moved} {os.stat('/proc/thread-self/ns/net').st_ino}"
    if cmd == "state":
        return f"{phase} {n}"
    if cmd == "start" and phase == "warm":
        phase = "serving"
        return phase
    if cmd == "inc" and phase == "serving":
        n += 1
        return str(n)
    if cmd == "stop" and phase == "serving":
        phase = "stopped"
        return phase
    return f"refused: {cmd} while {phase}"
"""
    + SERVE
)

# A CPU engine rank of the built-in model, its step loop started, that has generated once; then
# paused, its NIXL agent (and UCX context) dropped: UCX's deleted shared-memory file is more than
# CRIU dumps by default ("Can't dump ghost file /dev/shm/ucx_shm_posix_..."), and the agent's
# name is no one else's to keep.
ENGINE_CHILD = (
    r"""
import json, time, torch
from components.engine.models.builtin import builtin_model_dir
from harness.reference import PROMPTS, generate, single_rank
torch.set_grad_enabled(False)
eng = single_rank(builtin_model_dir(), max_len=128)
eng.start()

def gen():
    eng.resume().result(60)
    tokens = generate(eng, PROMPTS, 8, ignore_eos=True)[0]
    eng.pause().result(60)
    return tokens

READY = json.dumps(gen())
eng.comm.suspend()

def handle(cmd):
    if cmd == "generate":
        return json.dumps(gen())
    if cmd == "agent":  # a new NIXL agent, in the restored process
        eng.comm.resume()
        return str(len(eng.comm.metadata()) > 0)
    return "unknown"
"""
    + SERVE
)


def wait_line(log: Path, prefix: str, after: int = 0, timeout: float = 60) -> str:
    """The first line of `log` past its first `after` lines that starts with `prefix`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = log.read_text().splitlines() if log.exists() else []
        for ln in lines[after:]:
            if ln.startswith(prefix):
                return ln
        time.sleep(0.02)
    raise AssertionError(f"{log}: no {prefix!r} line in {timeout} s: {log.read_text() if log.exists() else ''}")


class Session:
    """One conversation with the child: signal it, connect to the socket it announces in `log`."""

    def __init__(self, pid: int, log: Path):
        seen = len(log.read_text().splitlines()) if log.exists() else 0
        os.kill(pid, signal.SIGUSR1)
        path = wait_line(log, "listening ", seen).split(" ", 1)[1]
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.settimeout(60)
        self.sock.connect(path)
        self.f = self.sock.makefile("rw")

    def ask(self, cmd: str) -> str:
        self.f.write(cmd + "\n")
        self.f.flush()
        return self.f.readline().strip()

    def close(self):
        self.f.write("bye\n")
        self.f.flush()
        self.f.close()
        self.sock.close()


@pytest.fixture(scope="module")
def work():
    d = Path(tempfile.mkdtemp(prefix="criu-"))  # short: unix socket paths are at most 107 bytes
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def image(work):
    """The child, taken to `serving 2`, dumped (and so killed)."""
    (work / "child.py").write_text(CHILD)
    log = work / "start.log"
    p = spawn([sys.executable, str(work / "child.py"), str(work), str(SEED), str(DATA_BYTES)], log, env=REPO_ENV)
    try:
        wait_line(log, "ready")
        s = Session(p.pid, log)
        assert [s.ask("start"), s.ask("inc"), s.ask("inc"), s.ask("state")] == ["serving", "1", "2", "serving 2"]
        s.close()
        m = dump(p, work / "img")
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == -signal.SIGKILL  # criu kills what it dumped; dump() reaped it
    return work / "img", m, p.pid


def test_criu_detected():
    assert find_criu() == str(Path(sys.prefix) / "bin" / "criu"), "run `make install`: it unpacks CRIU into .venv"
    ok, why = criu_status()
    assert ok, why
    assert why.startswith(f"CRIU 4.1.1 at {sys.prefix}/bin/criu: ") and why.endswith("`criu check` looks good")


def test_criu_wrapper_from_anywhere(tmp_path):
    """The wrapper finds its unpacked loader and libraries from any cwd, by absolute, relative
    and linked path."""
    criu = Path(find_criu())
    link = tmp_path / "criu"
    link.symlink_to(criu)
    for argv, cwd in [([str(criu)], "/"), ([os.path.relpath(criu, criu.parent.parent)], criu.parent.parent)]:
        r = subprocess.run([*argv, "--version"], capture_output=True, text=True, cwd=cwd)
        assert r.returncode == 0 and r.stdout.startswith("Version: 4.1.1"), r.stderr
    r = subprocess.run([str(link), "check"], capture_output=True, text=True, cwd=tmp_path)
    assert "Looks good" in r.stdout, r.stdout + r.stderr


def test_two_copies_of_one_image(image, work):
    img, m, dumped_pid = image
    data = random.Random(SEED).randbytes(DATA_BYTES)
    assert m.image_bytes > DATA_BYTES and m.seconds > 0 and m.pid == dumped_pid
    assert m.stdio == ["dev/null", str(work / "start.log")[1:], str(work / "start.log")[1:]]
    assert any(n.startswith("pages-") for n in m.files) and verify_image(img) == m
    logs = [work / f"copy{i}.log" for i in range(2)]
    copies = []
    try:
        for log in logs:
            with open(log, "ab") as out:
                copies.append(restore(img, output=out))
        a, b = copies
        assert a.ns_pid == b.ns_pid == dumped_pid  # each keeps the dumped PID inside its namespace
        assert len({a.pid, b.pid, dumped_pid}) == 3
        # Each in a network namespace of its own, where it holds the abstract socket it was
        # dumped with: in ours, the second copy's restore would fail to bind it.
        ours = os.stat("/proc/self/ns/net").st_ino
        assert len({ours, *(os.stat(f"/proc/{c.pid}/ns/net").st_ino for c in copies)}) == 3
        for c in copies:
            assert f"@elastic-ep-test-{SEED}" in Path(f"/proc/{c.pid}/net/unix").read_text()
        sa, sb = Session(a.pid, logs[0]), Session(b.pid, logs[1])  # both open at once
        assert sa.ask("net") == f"True {ours}"  # what a restored worker does before it connects
        expected = hashlib.sha256(data).hexdigest()
        assert [sa.ask("digest"), sa.ask("state")] == [expected, "serving 2"]
        assert [sb.ask("digest"), sb.ask("state")] == [expected, "serving 2"]
        assert [sa.ask("inc"), sa.ask("inc")] == ["3", "4"]
        assert [sb.ask("inc"), sb.ask("stop"), sb.ask("inc")] == ["3", "stopped", "refused: inc while stopped"]
        assert [sa.ask("state"), sb.ask("state")] == ["serving 4", "stopped 3"]
        sa.close()
        sb.close()
        # Each copy's output went to its own log, none to the original's.
        for log in logs:
            assert [ln.split()[0] for ln in log.read_text().splitlines()] == ["listening"]
        assert [ln.split()[0] for ln in (work / "start.log").read_text().splitlines()] == ["ready", "listening"]
        assert a.running() and b.running()
    finally:
        for c in copies:
            c.close()
    assert not any(c.running() for c in copies)
    assert not any(Path(f"/proc/{c.pid}").exists() for c in copies)
    assert not any(c.workdir.exists() for c in copies)


def restorer(img: Path, log: Path, dies_with: int = 0) -> subprocess.Popen:
    """A process that restores one copy of `img` (its output to `log`), prints the copy's pid and
    waits: the restoring process a test then kills."""
    code = (
        "import sys, time\n"
        "from snapshot.criu_image import restore\n"
        "c = restore(sys.argv[1], output=open(sys.argv[2], 'ab'), dies_with=int(sys.argv[3]))\n"
        "print(c.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    argv = [sys.executable, "-c", code, str(img), str(log), str(dies_with)]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, env=REPO_ENV, cwd=REPO)


def test_a_copy_dies_with_the_process_that_restored_it(image, work):
    """unshare dies with the restoring process (PDEATHSIG), the init of the copy's PID namespace
    with unshare (--kill-child), and the copy with that init: a killed restorer leaves no copy."""
    img, _, _ = image
    p = restorer(img, work / "orphan.log")
    try:
        pid = int(p.stdout.readline())
        assert alive(pid)
    finally:
        p.kill()
        p.wait()
    assert gone_within(pid, 30)


def test_a_copys_exit_status_is_reported(image, work):
    """The copy's own status, not criu's: the namespace's init (snapshot.nsinit) is its parent."""
    img, _, _ = image
    log = work / "status.log"
    with open(log, "ab") as out, restore(img, output=out) as c:
        s = Session(c.pid, log)
        s.f.write("exit 3\n")
        s.f.flush()
        assert c.wait(30) == 3 and c.returncode == 3
    with open(log, "ab") as out, restore(img, output=out) as c:
        os.kill(c.pid, signal.SIGKILL)
        assert c.wait(30) == -signal.SIGKILL
    with open(log, "ab") as out, restore(img, output=out) as c:
        pass
    assert c.returncode == -signal.SIGKILL  # closed while running: killed with its namespace


def test_the_provider_sees_a_restored_copys_exit_status(image):
    """What LocalProvider holds for a restored joiner (spawn.adopt's Child) reports how it ended."""
    import asyncio

    from components.graph.component import ProcessSpec
    from components.graph.spawn import adopt

    img, _, _ = image

    async def run(end) -> int | None:
        r, w = os.pipe()
        try:
            restored = restore(img, output=w)
        finally:
            os.close(w)
        child = await adopt(ProcessSpec(label="copy", argv=[]), restored, r)
        end(restored)
        code = await asyncio.wait_for(child.proc.wait(), 30)
        assert child.proc.returncode == code and not child.alive()
        return code

    assert asyncio.run(run(lambda c: os.kill(c.pid, signal.SIGKILL))) == -signal.SIGKILL
    assert asyncio.run(run(lambda c: os.kill(c.pid, signal.SIGTERM))) == -signal.SIGTERM


def test_a_copy_given_a_graph_outlives_its_restorer_and_ends_with_the_graph(image, work):
    """restore(dies_with=graph): the copy is not tied to the restoring process (a router restart
    keeps it) but to the graph, whose end SIGTERMs it."""
    img, _, _ = image
    graph = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    p = restorer(img, work / "kept.log", dies_with=graph.pid)
    try:
        pid = int(p.stdout.readline())
        p.kill()
        p.wait()
        time.sleep(1.0)
        assert alive(pid)  # the restorer is gone, the copy serves on
        s = Session(pid, work / "kept.log")
        assert s.ask("state") == "serving 2"
        s.close()
        graph.kill()
        graph.wait()
        assert gone_within(pid, 30)
    finally:
        for q in (p, graph):
            if q.poll() is None:
                q.kill()
                q.wait()


def test_tampered_image_refused(image, tmp_path):
    img, m, _ = image
    bad = tmp_path / "img"
    shutil.copytree(img, bad)
    pages = largest(bad, m.files)
    flip_byte(bad / pages, 12345)
    with pytest.raises(SnapshotCorrupt) as e:
        restore(bad)
    assert str(e.value) == f"CRIU image {bad}: {pages}: checksum mismatch (tampered or corrupt)"
    shutil.rmtree(bad)
    shutil.copytree(img, bad)
    (bad / "core-1.img").write_bytes(b"")
    with pytest.raises(SnapshotCorrupt, match=r"core-1.img: unexpected file \(not in criu-image.json\)"):
        restore(bad)
    (bad / "core-1.img").unlink()
    (bad / "inventory.img").unlink()
    with pytest.raises(SnapshotCorrupt, match="inventory.img: missing"):
        restore(bad)
    (bad / IMAGE_MANIFEST).unlink()
    with pytest.raises(SnapshotCorrupt, match=f"{IMAGE_MANIFEST} is missing"):
        restore(bad)
    with pytest.raises(SnapshotCorrupt, match="no such directory"):
        restore(tmp_path / "nothing")


def test_dump_and_restore_refusals(tmp_path):
    p = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        # Not its own session leader: its session's leader (pytest's) is not dumped with it.
        with pytest.raises(CriuError, match=rf"criu dump of pid {p.pid} failed: Error .*session"):
            dump(p, tmp_path / "a")
        assert p.poll() is None  # a failed dump leaves it running
        with pytest.raises(CriuError, match="not empty"):
            dump(p, tmp_path / "a")
    finally:
        p.kill()
        p.wait()
    p = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"],
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    m = dump(p, tmp_path / "b", leave_running=True)
    try:
        assert p.poll() is None and m.stdio == ["dev/null"] * 3
        with pytest.raises(CriuError, match=r"stdout/stderr were on stdin's file \(dev/null\)"):
            restore(tmp_path / "b", output=1)
        with restore(tmp_path / "b") as c:  # beside the original: its own PID namespace
            assert c.ns_pid == p.pid and c.running()
    finally:
        p.kill()
        p.wait()


def fake_criu(path: Path, body: str) -> str:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)


def test_a_usable_criu_is_checked_once(tmp_path):
    """criu_status asks a CRIU that works once (the provider asks at every scale-up), one that
    does not every time, and a changed binary again."""
    calls = tmp_path / "calls"
    body = 'echo "$1" >> {calls}\ncase $1 in --version) echo "Version: 4.1.1";; check) echo "Looks good.";; esac\n'
    fake = fake_criu(tmp_path / "criu", body.format(calls=calls))
    assert criu_status(fake) == criu_status(fake) == (True, f"CRIU 4.1.1 at {fake}: `criu check` looks good")
    assert calls.read_text().split() == ["--version", "check"]
    os.utime(fake, ns=(0, 0))  # another binary at the same path
    assert criu_status(fake)[0] and calls.read_text().split() == ["--version", "check"] * 2
    broken = fake_criu(tmp_path / "broken", f'echo "$1" >> {calls}\necho "Version: 4.1.1"; exit 1\n')
    assert not criu_status(broken)[0] and not criu_status(broken)[0]
    assert calls.read_text().split()[4:] == ["--version", "check"] * 2


def test_criu_status_sentences(tmp_path, monkeypatch):
    fake = fake_criu(tmp_path / "criu", "echo 'Version: 3.17.1'\n")
    assert criu_status(fake) == (False, f"CRIU 3.17.1 at {fake}; the criu tier needs >= 4.0")
    fake_criu(tmp_path / "criu", "echo nothing\n")
    assert criu_status(fake) == (False, f"CRIU at {fake}: `criu --version` gave no version")
    none = str(tmp_path / "none")
    assert criu_status(none) == (False, f"CRIU at {none}: No such file or directory")
    fake_criu(
        tmp_path / "criu",
        'case $1 in --version) echo "Version: 4.1.1";;\n'
        "check) echo 'Warn  (criu/kerndat.c:1285): Can''t keep kdat cache on non-tempfs' >&2\n"
        "       echo 'Error (criu/cr-check.c:1626): vDSO: ldd: no such symbol' >&2; exit 1;;\nesac\n",
    )
    why = f"CRIU 4.1.1 at {fake}: `criu check` failed: Error (criu/cr-check.c:1626): vDSO: ldd: no such symbol"
    assert criu_status(fake) == (False, why)
    monkeypatch.setattr(criu_mod, "find_criu", lambda: fake)
    assert [ln for ln in tier_lines() if ln[0] == "criu"] == [("criu", False, f"unavailable: {why}")]
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert criu_status(fake) == (False, f"CRIU 4.1.1 at {fake}; checkpoint and restore need root")
    monkeypatch.setattr(criu_mod, "find_criu", lambda: None)
    ok, why = criu_status()
    assert not ok and why == "CRIU not found (`make install` unpacks Debian trixie's CRIU 4.1.1 into .venv/criu)"


def test_engine_rank_restored():
    """A torch process with an engine rank built is dumped and restored; the copy generates the
    same tokens, opens a new NIXL agent and generates again."""
    work = Path(tempfile.mkdtemp(prefix="criu-"))
    try:
        (work / "child.py").write_text(ENGINE_CHILD)
        p = spawn([sys.executable, str(work / "child.py"), str(work)], work / "start.log", env=REPO_ENV, cwd=REPO)
        try:
            tokens = json.loads(wait_line(work / "start.log", "ready ", timeout=300).split(" ", 1)[1])
            m = dump(p, work / "img")
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        assert len(tokens) == 5 and all(len(t) == 8 for t in tokens)
        with open(work / "copy.log", "ab") as out, restore(work / "img", output=out) as c:
            s = Session(c.pid, work / "copy.log")
            assert json.loads(s.ask("generate")) == tokens
            assert s.ask("agent") == "True"
            assert json.loads(s.ask("generate")) == tokens
            s.close()
        assert c.ns_pid == m.pid
    finally:
        shutil.rmtree(work, ignore_errors=True)


# A CUDA process: data on the GPU and a CUDA graph over it (after CUDA init and a capture the
# driver holds its abstract unix socket, `@cuda-uvmfd-<pid namespace>-<pid>@`).
CUDA_CHILD = (
    r"""
import torch
x = torch.arange(1 << 20, dtype=torch.float32, device="cuda") * 3
out = torch.empty_like(x)
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    out.copy_(x * 2)
torch.cuda.synchronize()
READY = ""

def handle(cmd):
    if cmd == "sums":  # the captured graph over the data kept on the GPU, and a new kernel
        g.replay()
        return f"{float(out.double().sum()):.1f} {float((x + 1).double().sum()):.1f}"
    return "unknown"
"""
    + SERVE
)


@pytest.mark.gpu
def test_two_cuda_copies_of_one_image_at_once():
    """What held the provider to one restored CUDA copy at a time: two copies of one CUDA image,
    restored at once (each in its own network namespace, where it rebinds the driver's abstract
    socket), each CUDA-restored and unlocked, replay the graph captured before the dump over the
    data it had on the GPU, and run new kernels."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from snapshot import cuda_checkpoint

    work = Path(tempfile.mkdtemp(prefix="criu-"))
    try:
        (work / "child.py").write_text(CUDA_CHILD)
        p = spawn([sys.executable, str(work / "child.py"), str(work)], work / "start.log", env=REPO_ENV, cwd=REPO)
        try:
            wait_line(work / "start.log", "ready", timeout=300)
            s = Session(p.pid, work / "start.log")
            want = s.ask("sums")
            s.close()
            assert any("cuda-uvmfd" in ln for ln in Path(f"/proc/{p.pid}/net/unix").read_text().splitlines())
            cuda_checkpoint.checkpoint(p.pid)
            dump(p, work / "img")
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        logs = [work / f"copy{i}.log" for i in range(2)]
        outs = [open(log, "ab") for log in logs]
        copies = []
        try:
            copies = [restore(work / "img", output=out) for out in outs]  # both restored before either resumes CUDA
            for c in copies:
                cuda_checkpoint.restore(c.pid)
            sessions = [Session(c.pid, log) for c, log in zip(copies, logs)]
            assert [s.ask("sums") for s in sessions] == [want, want]
            for s in sessions:
                s.close()
        finally:
            for c in copies:
                c.close()
            for out in outs:
                out.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
