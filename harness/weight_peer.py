"""A serving rank that offers its weights, for tests/test_weight_transfer.py.

Run as `python -m harness.weight_peer --rank R --dir D ...`: builds a WeightStore over `make_weights`,
writes its msgspec-encoded manifest to D/manifest-R.bin, then serves until D/stop exists (a source
must outlive the puller's last READ). Completion notifications from pullers are appended to
D/done-R.json as they arrive.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from components.protocol.transfer import decode_manifest

ROOT = Path(__file__).resolve().parents[1]
N_SLOTS = 8
SLOT_SHAPE = (64, 32)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def make_weights(rank: int, seed: int = 1234, big_mb: int = 0, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Deterministic weights. Non-expert tensors depend on `seed` only (every rank serves the same
    ones); expert slots also on `rank` (ranks hold different experts), so a test can tell which
    source and which slot a pulled expert came from."""
    w: dict[str, torch.Tensor] = {}
    w["embed"] = torch.randn(1000, 64, generator=_gen(seed))
    w["norm"] = torch.randn(4096, generator=_gen(seed + 1)).to(torch.bfloat16)
    w["attn.qkv"] = torch.randn(192, 64, generator=_gen(seed + 2)).to(torch.bfloat16)
    w["odd"] = torch.randint(0, 256, (7,), dtype=torch.uint8, generator=_gen(seed + 3))  # odd byte count
    w["half3"] = torch.randn(3, generator=_gen(seed + 4)).to(torch.float16)  # 6 bytes: 16-bit words
    for i in range(4):
        n = (big_mb << 20) // 4 // 4
        if n:
            w[f"big.{i}"] = torch.randn(n, generator=_gen(seed + 100 + i))
    w = {k: v.to(device) for k, v in w.items()}
    # One buffer of expert slots, as the MoE layer holds them; each slot is also a named view.
    buf = torch.randn(N_SLOTS, *SLOT_SHAPE, generator=_gen(seed * 31 + rank + 7)).to(torch.bfloat16).to(device)
    w["moe.w_gate"] = buf
    for s in range(N_SLOTS):
        w[f"experts.0.{s}.gate"] = buf[s]
    return w


def fresh_like(w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Zeroed destinations with the same layout, slot views included (what a joiner allocates)."""
    out: dict[str, torch.Tensor] = {}
    buf = torch.zeros_like(w["moe.w_gate"])
    for k, v in w.items():
        if k == "moe.w_gate":
            out[k] = buf
        elif k.startswith("experts.0."):
            out[k] = buf[int(k.split(".")[2])]
        else:
            out[k] = torch.zeros_like(v)
    return out


def in_arena(w: dict[str, torch.Tensor]):
    """The same weights moved into one CUDA VMM arena (slot views re-derived); (weights, arena)."""
    from components.engine.memory.vmm import VmmArena, plan_bytes

    whole = {k: v for k, v in w.items() if not k.startswith("experts.0.")}
    arena = VmmArena(plan_bytes((v.shape, v.dtype) for v in whole.values()), w["moe.w_gate"].device)
    out = {k: arena.alloc_like(v) for k, v in whole.items()}
    for s in range(N_SLOTS):
        out[f"experts.0.{s}.gate"] = out["moe.w_gate"][s]
    return out, arena


def write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--big-mb", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--corrupt", default=None, help="flip a byte of this tensor after the manifest is made")
    ap.add_argument("--exit-early", action="store_true", help="exit right after writing the manifest")
    ap.add_argument("--max-s", type=float, default=300.0, help="give up serving after this long")
    ap.add_argument("--vmm", action="store_true", help="CUDA: hold the weights in a VMM arena, lent to pullers")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"[src {args.rank}] %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)

    from components.engine.weights.store import WeightStore
    from components.protocol.transfer import encode_manifest

    d = Path(args.dir)
    w = make_weights(args.rank, args.seed, args.big_mb, args.device)
    arena = None
    if args.vmm:
        w, arena = in_arena(w)
    store = WeightStore(args.rank, w, device=args.device, arena=arena)
    man = store.manifest()
    if args.corrupt:
        # After the checksum was taken: what a puller reads no longer matches what was promised.
        b = w[args.corrupt].reshape(-1).view(torch.uint8)
        b[b.numel() // 2] ^= 0x5A
    write_atomic(d / f"manifest-{args.rank}.bin", encode_manifest(man))
    if args.exit_early:
        os._exit(0)  # a source that vanishes without goodbye

    done: list[dict] = []
    deadline = time.monotonic() + args.max_s
    while not (d / "stop").exists() and time.monotonic() < deadline:
        new = store.pulls_done()
        if new:
            done.extend({"rank": m.rank, "tensors": m.tensors, "bytes": m.bytes, "ok": m.ok} for m in new)
            write_atomic(d / f"done-{args.rank}.json", json.dumps(done).encode())
        time.sleep(0.02)
    store.close()
    store.close()  # idempotent
    return 0


NON_EXPERT = ["embed", "norm", "attn.qkv", "odd", "half3"] + [f"big.{i}" for i in range(4)]


class Sources:
    """Source processes sharing one directory (manifests, stop flag, completion records)."""

    def __init__(self, d: Path):
        self.dir = d
        self.procs: dict[int, subprocess.Popen] = {}

    def spawn(self, rank: int, *extra: str) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        log = open(self.dir / f"log-{rank}.txt", "wb")
        cmd = [sys.executable, "-m", "harness.weight_peer", "--rank", str(rank), "--dir", str(self.dir), *extra]
        self.procs[rank] = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        log.close()

    def manifest(self, rank: int, timeout: float = 60.0):
        path = self.dir / f"manifest-{rank}.bin"
        deadline = time.monotonic() + timeout
        while not path.exists():
            p = self.procs[rank]
            if p.poll() is not None and not path.exists():
                raise RuntimeError(f"source {rank} exited {p.returncode} before its manifest\n{self.logs()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"no manifest from source {rank} in {timeout}s\n{self.logs()}")
            time.sleep(0.02)
        return decode_manifest(path.read_bytes())

    def done(self, rank: int, timeout: float = 10.0) -> list[dict]:
        """Completion notifications source `rank` has received (waits for at least one)."""
        path = self.dir / f"done-{rank}.json"
        deadline = time.monotonic() + timeout
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        return json.loads(path.read_text()) if path.exists() else []

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(self.dir.glob("log-*.txt"))
        )

    def stop(self) -> None:
        (self.dir / "stop").touch()
        for _r, p in self.procs.items():
            try:
                p.send_signal(signal.SIGCONT)
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


if __name__ == "__main__":
    sys.exit(main())
