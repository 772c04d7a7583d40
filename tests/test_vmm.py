"""VMM arenas: weights, expert slots and KV at fixed addresses whose physical memory is released
before a driver checkpoint and mapped again after restore, under the same captured CUDA graphs.

The GPU tests skip without CUDA. The checkpoint test writes its measurements as JSON into
$VMM_RESULTS_DIR (when set) and prints a table (run pytest with -s to see it).
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from components.engine.memory import stack_reserve
from components.engine.memory.vmm import VmmArena, VmmError, VmmExporter, VmmImport, place_engine_memory, receive
from harness.reference import PROMPTS, generate, make_checkpoint, reference, single_rank

REPO = Path(__file__).resolve().parents[1]
CHILD = REPO / "harness" / "vmm_child.py"
MAX_NEW = 10


def test_arena_refuses_cpu_with_a_clear_error():
    with pytest.raises(VmmError, match="CUDA device"):
        VmmArena(1 << 20, "cpu")


# ---- 1: the arena itself -------------------------------------------------------------------------
@pytest.mark.gpu
def test_arena_release_remap_keeps_addresses_and_graphs():
    arena = VmmArena(40 << 20, "cuda", chunk_bytes=16 << 20)  # three chunks
    try:
        assert arena.mapped and arena.nbytes % arena.granularity == 0 and arena.nbytes >= 40 << 20
        w = arena.alloc((1024, 1024), torch.float32)
        odd = arena.alloc((333,), torch.bfloat16)
        big = arena.alloc((8 << 20,), torch.uint8)
        for t in (w, odd, big):
            assert t in arena and t.data_ptr() % 256 == 0 and t.is_contiguous()
        assert w.data_ptr() == arena.ptr and odd.data_ptr() == arena.ptr + (4 << 20)
        with pytest.raises(VmmError, match="full"):
            arena.alloc((arena.nbytes,), torch.uint8)
        ptrs = [t.data_ptr() for t in (w, odd, big)]

        torch.manual_seed(0)
        W = torch.randn(1024, 1024)
        x = torch.randn(64, 1024, device="cuda")
        w.copy_(W)
        odd.fill_(3)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                y = torch.relu(x @ w)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = torch.relu(x @ w)
        g.replay()
        torch.cuda.synchronize()
        ref = y.clone()
        assert torch.allclose(ref, torch.relu(x.cpu() @ W).cuda(), atol=1e-3, rtol=1e-3)

        free0 = torch.cuda.mem_get_info()[0]
        arena.release()
        arena.release()  # idempotent
        free1 = torch.cuda.mem_get_info()[0]
        assert not arena.mapped
        assert free1 - free0 >= arena.nbytes - (2 << 20), (free0, free1, arena.nbytes)
        assert [t.data_ptr() for t in (w, odd, big)] == ptrs

        arena.remap()
        assert arena.mapped and torch.cuda.mem_get_info()[0] <= free1 - arena.nbytes + (2 << 20)
        assert [t.data_ptr() for t in (w, odd, big)] == ptrs
        y.zero_()
        w.copy_(W)  # contents are undefined after remap: refill
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, ref)
        odd.fill_(5)
        assert bool((odd == 5).all())
    finally:
        arena.close()
    with pytest.raises(VmmError, match="closed"):
        arena.remap()


@pytest.mark.gpu
@pytest.mark.parametrize("keep", [True, False])
def test_lent_arena_is_freed_by_its_release(keep):
    """An exporter that keeps its descriptors between requests must not keep the memory alive: a
    release frees it, a released arena lends nothing, and after a remap it lends the new memory."""
    arena = VmmArena(64 << 20, "cuda", chunk_bytes=32 << 20)
    exporter = VmmExporter(arena, keep=keep)
    try:
        t = arena.alloc((16 << 20,), torch.int32)
        t.copy_(torch.arange(t.numel(), device="cuda", dtype=torch.int32))
        for _ in range(2):  # a second pull gets the same memory, whether re-exported or not
            imp = VmmImport(receive(exporter.address), "cuda")
            assert torch.equal(imp.tensor[: t.nbytes].view(torch.int32), t)
            imp.tensor[:4].fill_(255)  # read-write
            imp.close()
        assert t[0].item() == -1
        torch.cuda.synchronize()
        free = torch.cuda.mem_get_info()[0]
        arena.release()
        assert torch.cuda.mem_get_info()[0] - free >= 64 << 20, "the lent descriptors kept the memory alive"
        with pytest.raises(VmmError, match="sent no memory"):
            receive(exporter.address)
        arena.remap()
        t.fill_(7)
        imp = VmmImport(receive(exporter.address), "cuda")
        assert torch.equal(imp.tensor[: t.nbytes].view(torch.int32), t)
        imp.close()
    finally:
        exporter.close()
        arena.close()


@pytest.mark.gpu
def test_place_engine_memory_keeps_ties_and_values():
    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(100, 64)
            self.lm_head = nn.Linear(64, 100, bias=False)
            self.lm_head.weight = self.embed.weight
            self.norm = nn.LayerNorm(64)

        moe_layers = []

    m = Tiny().cuda()
    with torch.no_grad():  # views handed out under no_grad can still be written with grad enabled
        arena0 = VmmArena(1 << 20, "cuda")
        kv0 = arena0.alloc((4, 8), torch.float32)
    kv0[torch.tensor([1], device="cuda")] = m.norm(torch.randn(1, 64, device="cuda"))[:, :8]
    arena0.close()
    kv = SimpleNamespace(k=[torch.ones(3, 8, device="cuda")], v=[torch.ones(3, 8, device="cuda")])
    klist = kv.k
    want = {n: p.detach().clone() for n, p in m.named_parameters()}
    arena = place_engine_memory(m, kv)
    try:
        assert m.lm_head.weight is m.embed.weight and m.lm_head.weight in arena
        for n, p in m.named_parameters():
            assert p in arena and isinstance(p, nn.Parameter) and torch.equal(p, want[n])
        assert kv.k is klist and kv.k[0] in arena and kv.v[0] in arena and not kv.k[0].any()
    finally:
        arena.close()


# ---- 2: an engine rank in VMM memory -------------------------------------------------------------
@pytest.mark.gpu
def test_vmm_rank_matches_transformers_across_release_and_restore(tmp_path):
    path = make_checkpoint("mixtral", tmp_path / "mixtral")
    ref_tokens, _ = reference(path, PROMPTS, MAX_NEW)
    eng = single_rank(path, "cuda", vmm=True)
    arena = eng.arena
    assert arena is not None and arena.mapped
    for _, p in eng.model.named_parameters():
        assert p in arena
    for _, moe in eng.model.moe_layers:
        assert moe.w_gate in arena and moe.w_up in arena and moe.w_down in arena
    assert all(t in arena for t in eng.kv.k + eng.kv.v)
    placement = eng.default_placement([0])
    eng.start()
    try:
        tokens, ends = generate(eng, PROMPTS, MAX_NEW, ignore_eos=True)
        assert tokens == ref_tokens and ends == ["length"] * len(PROMPTS)
        captures, replays = eng.graphs.captures, eng.graphs.replays
        assert replays > 0 and captures == len(eng.graphs.sizes)
        ptrs = [p.data_ptr() for _, p in eng.model.named_parameters()]

        eng.pause().result(30)
        free0 = torch.cuda.mem_get_info()[0]
        stack = stack_reserve.per_thread(eng.device)
        allocated = torch.cuda.memory_allocated(eng.device)
        eng.call(eng.release_memory).result(30)
        assert not arena.mapped and torch.cuda.mem_get_info()[0] > free0 + arena.nbytes
        assert stack_reserve.per_thread(eng.device) < stack  # the checkpoint would save the reserve
        # So would cuBLAS's workspaces of the eager streams (32 MiB each; the warm-up stream's at
        # least); the graphs, captured with the capture stream's, replay below all the same.
        assert torch.cuda.memory_allocated(eng.device) <= allocated - (32 << 20)

        def refill():
            eng.restore_memory()
            eng.model.load_dense(eng.ckpt)
            eng.load_experts(placement)

        eng.call(refill).result(60)
        assert arena.mapped and [p.data_ptr() for _, p in eng.model.named_parameters()] == ptrs
        assert stack_reserve.per_thread(eng.device) == stack
        eng.resume().result(30)
        tokens2, _ = generate(eng, PROMPTS, MAX_NEW, ignore_eos=True)
        assert tokens2 == ref_tokens
        assert eng.graphs.captures == captures and eng.graphs.replays > replays  # no recapture
    finally:
        eng.stop()


def test_release_memory_needs_vmm(tmp_path):
    eng = single_rank(make_checkpoint("mixtral", tmp_path / "m"))
    try:
        assert eng.arena is None
        with pytest.raises(RuntimeError, match="vmm=True"):
            eng.release_memory()
    finally:
        eng.comm.close()


# ---- 3: checkpoint/restore of a parked rank process ----------------------------------------------
def make_big_checkpoint(
    path: Path, layers: int = 4, hidden: int = 2048, inter: int = 4096, experts: int = 8, vocab: int = 32000
) -> Path:
    """A Mixtral-shaped random bf16 checkpoint (about 2 GB at the defaults), made on the GPU."""
    from safetensors.torch import save_file

    from components.engine.models.registry import config_from_dict, expected_tensors

    cfg = {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "num_hidden_layers": layers,
        "num_local_experts": experts,
        "num_experts_per_tok": 2,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1e6,
        "max_position_embeddings": 4096,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    gen = torch.Generator(device="cuda").manual_seed(0)
    tensors = {}
    for name, shape in expected_tensors(config_from_dict(cfg)).items():
        if name.endswith("norm.weight") or "layernorm" in name:
            tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            t = torch.randn(shape, generator=gen, device="cuda", dtype=torch.float32) * 0.02
            tensors[name] = t.to(torch.bfloat16).cpu()
    save_file(tensors, str(path / "model.safetensors"))
    return path


def _smi(*args) -> list[list[str]]:
    out = subprocess.run(
        ["nvidia-smi", *args, "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=60
    ).stdout
    return [[c.strip() for c in line.split(",")] for line in out.strip().splitlines() if line.strip()]


def gpu_used_mb() -> int:
    return sum(int(r[0]) for r in _smi("--query-gpu=memory.used"))


def child_mb(pid: int, baseline: int) -> dict:
    """The child's GPU memory: its nvidia-smi compute-app row when one shows up (not in every
    container), and the device total minus the total before it started."""
    apps = {
        int(r[0]): int(r[1])
        for r in _smi("--query-compute-apps=pid,used_memory")
        if len(r) == 2 and r[0].isdigit() and r[1].isdigit()
    }
    return {"app_mb": apps.get(pid), "delta_mb": gpu_used_mb() - baseline}


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class Child:
    def __init__(self, model: Path, comm: str, max_new: int):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        self.p = subprocess.Popen(
            [sys.executable, str(CHILD), str(model), comm, str(max_new)],
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.q: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self):
        for line in self.p.stdout:
            if line.startswith("@@ "):
                self.q.put(json.loads(line[3:]))
        self.q.put({"event": "exit", "error": f"child exited ({self.p.poll()})"})

    def read(self, timeout: float = 300) -> dict:
        msg = self.q.get(timeout=timeout)
        assert "error" not in msg, msg["error"]
        return msg

    def ask(self, cmd: str, timeout: float = 300) -> dict:
        self.p.stdin.write(json.dumps({"cmd": cmd}) + "\n")
        self.p.stdin.flush()
        msg = self.read(timeout)
        assert msg["event"] == cmd, msg
        return msg

    def close(self):
        if self.p.poll() is None:
            try:
                self.ask("quit", timeout=30)
            except Exception:
                pass
            try:
                self.p.wait(30)
            except subprocess.TimeoutExpired:
                self.p.kill()


def park_cycle(child: Child, ready: dict, baseline: int, release: bool) -> dict:
    """(release the arena,) checkpoint, restore, (remap + reload,) generate; checks and timings."""
    from snapshot import cuda_checkpoint

    pid = child.p.pid
    row = {"mode": "arena released" if release else "weights resident"}
    if release:
        row["release_s"] = child.ask("release")["release_s"]
    row["resident"] = child_mb(pid, baseline)
    row["rss_mb_before"] = rss_mb(pid)
    t = cuda_checkpoint.checkpoint(pid)
    assert cuda_checkpoint.state(pid) == "checkpointed"
    row["checkpoint_s"] = t["lock"] + t["checkpoint"]
    row["parked"] = child_mb(pid, baseline)
    row["rss_mb_parked"] = rss_mb(pid)
    t = cuda_checkpoint.restore(pid)
    row["restore_s"] = t["restore"] + t["unlock"]
    assert cuda_checkpoint.state(pid) == "running"
    row["restored"] = child_mb(pid, baseline)
    if release:
        r = child.ask("restore")
        row["remap_s"], row["reload_s"] = r["remap_s"], r["reload_s"]
    out = child.ask("generate")
    assert out["tokens"] == ready["tokens"], f"{row['mode']}: tokens changed after restore"
    assert out["captures"] == ready["captures"], "graphs were recaptured"
    assert out["replays"] > ready["replays"]
    assert (out["arena_ptr"], out["lm_head_ptr"]) == (ready["arena_ptr"], ready["lm_head_ptr"])
    return row


def _mb(d: dict) -> float:
    return d["app_mb"] if d["app_mb"] is not None else d["delta_mb"]


def run_checkpoint_flow(model: Path, comm: str, max_new: int, name: str) -> dict:
    from snapshot import cuda_checkpoint

    ok, why = cuda_checkpoint.available()
    if not ok:
        pytest.skip(why)
    torch.cuda.synchronize()
    baseline = gpu_used_mb()
    child = Child(model, comm, max_new)
    try:
        ready = child.read(600)
        assert ready["event"] == "ready" and ready["mapped"]
        rows = [park_cycle(child, ready, baseline, release=False), park_cycle(child, ready, baseline, release=True)]
    finally:
        child.close()
    result = {
        "model": str(model),
        "comm": comm,
        "arena_mb": ready["arena_bytes"] / 2**20,
        "build_s": ready["build_s"],
        "torch_reserved_mb": ready["torch_reserved"] / 2**20,
        "baseline_gpu_used_mb": baseline,
        "captures": ready["captures"],
        "rows": rows,
    }
    print(
        f"\n[{name}] arena {result['arena_mb']:.0f} MiB, comm={comm}, torch cache {result['torch_reserved_mb']:.0f} MiB"
    )
    print(
        f"{'mode':<18}{'resident MB':>12}{'parked MB':>11}{'ckpt s':>9}{'restore s':>11}"
        f"{'remap+reload s':>16}{'host RSS parked MB':>20}"
    )
    for r in rows:
        refill = f"{r['remap_s']:.3f}+{r['reload_s']:.3f}" if "remap_s" in r else "-"
        print(
            f"{r['mode']:<18}{_mb(r['resident']):>12.0f}{_mb(r['parked']):>11.0f}{r['checkpoint_s']:>9.3f}"
            f"{r['restore_s']:>11.3f}{refill:>16}{r['rss_mb_parked']:>20.0f}"
        )
    out_dir = os.environ.get("VMM_RESULTS_DIR")
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / f"{name}.json").write_text(json.dumps(result, indent=1))
    held, released = rows
    # Parked, the process holds (almost) no GPU memory either way.
    for r in rows:
        assert _mb(r["parked"]) <= max(64, 0.05 * _mb(held["resident"])), r
    # Releasing the arena took the weights, expert slots and KV off the GPU before the checkpoint
    # (checked where the arena is large against nvidia-smi's MiB resolution and noise).
    if result["arena_mb"] >= 256:
        assert _mb(released["resident"]) <= _mb(held["resident"]) - 0.8 * result["arena_mb"], rows
    return result


@pytest.mark.gpu
def test_checkpoint_parks_vmm_rank_without_weights(tmp_path):
    """A ~2 GB bf16 Mixtral-shaped rank, local one-rank communicator."""
    layers = int(os.environ.get("VMM_TEST_LAYERS", "4"))
    model = make_big_checkpoint(tmp_path / "big", layers=layers)
    run_checkpoint_flow(model, "local", 16, "vmm_checkpoint_big")


@pytest.mark.gpu
def test_checkpoint_parks_vmm_rank_with_nixl_comm(tmp_path):
    """The same flow with the default NIXL communicator (its VRAM buffers registered)."""
    model = make_checkpoint("mixtral", tmp_path / "tiny")
    run_checkpoint_flow(model, "nixl", MAX_NEW, "vmm_checkpoint_nixl_tiny")


def outside(call: str, pid: int) -> dict:
    """cuda_checkpoint.<call>(pid) from a fresh process with no CUDA context, as the router has."""
    code = (
        "import json, sys; from snapshot import cuda_checkpoint as c; "
        "print(json.dumps(getattr(c, sys.argv[1])(int(sys.argv[2]))))"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, call, str(pid)], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, f"{call}(pid {pid}) from another process: {r.stderr.strip().splitlines()[-1:]}"
    return json.loads(r.stdout)


@pytest.mark.gpu
def test_checkpoint_of_a_rank_that_served_its_weights(tmp_path):
    """A leaving rank, parked as the router parks it: its weights were registered with NIXL and a
    manifest handed out; the store is closed and the arena released, then another process with no
    CUDA context checkpoints and restores it. The same graphs replay the same tokens."""
    from snapshot import cuda_checkpoint

    ok, why = cuda_checkpoint.available()
    if not ok:
        pytest.skip(why)
    model = make_checkpoint("mixtral", tmp_path / "tiny")
    child = Child(model, "nixl", MAX_NEW)
    try:
        ready = child.read(600)
        assert child.ask("store")["tensors"] > 0
        child.ask("store_close")
        child.ask("release")
        pid = child.p.pid
        outside("checkpoint", pid)
        assert cuda_checkpoint.state(pid) == "checkpointed"
        outside("restore", pid)
        assert cuda_checkpoint.state(pid) == "running"
        child.ask("restore")
        child.ask("store")  # serving again after the restore
        out = child.ask("generate")
    finally:
        child.close()
    assert out["tokens"] == ready["tokens"]
    assert out["captures"] == ready["captures"] and out["replays"] > ready["replays"]
