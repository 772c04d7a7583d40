"""One EP rank for tests/test_ep_nixl.py, run as `python -m harness.ep_peer ...` in its own process.

Ranks find each other through files in a shared directory (metadata, barriers) and report what
they received as a JSON file the test checks against `payload()`.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch

SIZES = (0, 1, 7, 255, 4096)


def payload_size(tag: str, i: int, src: int, dst: int, cap: int) -> int:
    h = int.from_bytes(hashlib.blake2b(f"{tag}:{i}:{src}:{dst}".encode(), digest_size=8).digest(), "little")
    choice = h % 8
    if choice < len(SIZES):
        return min(SIZES[choice], cap)
    if choice == 5:
        return cap
    if choice == 6:
        return max(cap - 1, 0)
    return (h >> 8) % (cap + 1)


def payload(tag: str, i: int, src: int, dst: int, cap: int) -> torch.Tensor:
    """Deterministic bytes that differ per (tag, round, src, dst) and per position."""
    n = payload_size(tag, i, src, dst, cap)
    seed = int.from_bytes(hashlib.blake2b(f"p:{tag}:{i}:{src}:{dst}".encode(), digest_size=4).digest(), "little")
    x = torch.arange(n, dtype=torch.int64)
    return ((x * (2 * (seed % 97) + 1) + (x >> 8) * 13 + seed) % 256).to(torch.uint8)


def digest(t: torch.Tensor) -> list:
    b = t.cpu().numpy().tobytes()
    return [len(b), hashlib.sha256(b).hexdigest()]


def resident_bytes(t: torch.Tensor) -> int:
    """Bytes of the pages under a CPU tensor that are in memory (mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    page = os.sysconf("SC_PAGE_SIZE")
    start = t.data_ptr() // page * page
    n = -(-(t.data_ptr() + t.numel() * t.element_size() - start) // page)
    vec = ctypes.create_string_buffer(n)
    if libc.mincore(start, n * page, vec) != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    return sum(b & 1 for b in vec.raw) * page


def write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def wait_files(paths: list[Path], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        if time.monotonic() > deadline:
            missing = [p.name for p in paths if not p.exists()]
            raise TimeoutError(f"waited {timeout}s for {missing}")
        time.sleep(0.01)


class Peer:
    def __init__(self, args):
        from components.engine.exchange.nixl import NixlCommunicator

        self.args = args
        self.dir = Path(args.dir)
        self.rank = args.rank
        self.cap = args.capacity
        self.comm = NixlCommunicator(
            args.rank,
            args.max_ranks,
            args.capacity,
            device=args.device,
            timeout_s=args.timeout,
            progress_thread=args.progress_thread,
        )
        self.result: dict = {"rank": self.rank, "rounds": [], "errors": {}, "mismatches": 0}

    def barrier(self, name: str, ranks) -> None:
        write_atomic(self.dir / f"bar-{name}-{self.rank}", b"")
        wait_files([self.dir / f"bar-{name}-{r}" for r in ranks])

    def exchange_metadata(self, ranks) -> None:
        write_atomic(self.dir / f"meta-{self.rank}.bin", self.comm.metadata())
        paths = {r: self.dir / f"meta-{r}.bin" for r in ranks}
        wait_files(list(paths.values()))
        self.comm.connect({r: p.read_bytes() for r, p in paths.items()})

    def round(self, tag: str, i: int) -> None:
        active = self.comm.active
        send = {dst: payload(tag, i, self.rank, dst, self.cap).to(self.comm.device) for dst in active}
        got = self.comm.all_to_all(send)
        entry = {"tag": tag, "i": i, "active": list(active), "recv": {}}
        for src, t in got.items():
            entry["recv"][str(src)] = digest(t)
            if not torch.equal(t.cpu(), payload(tag, i, src, self.rank, self.cap)):
                self.result["mismatches"] += 1
        self.result["rounds"].append(entry)

    def finish(self, ranks) -> None:
        # Final collective, then a file barrier: once every rank has returned from it, every
        # notification has landed, so no one closes under a peer's feet (NIXL notifications are
        # fire-and-forget; a target that has gone makes the initiator fail).
        self.comm.all_to_all({})
        self.barrier("final", ranks)
        self.comm.close()
        self.comm.close()  # idempotent

    def report(self) -> None:
        write_atomic(self.dir / f"result-{self.rank}.json", json.dumps(self.result).encode())


def scenario_exchange(p: Peer) -> None:
    a = p.args
    world = list(range(a.world))
    p.exchange_metadata(world)
    p.comm.set_active(world, 0)
    if a.overcap and p.rank == 0:
        try:
            p.comm.all_to_all({1: torch.zeros(p.cap + 1, dtype=torch.uint8, device=p.comm.device)})
        except Exception as e:  # noqa: BLE001 - the test checks the type and message
            p.result["errors"]["overcap"] = f"{type(e).__name__}: {e}"
    for i in range(a.rounds):
        p.round(a.tag, i)
    if a.latency:
        small = {dst: torch.full((64,), p.rank, dtype=torch.uint8, device=p.comm.device) for dst in world}
        for _ in range(50):
            p.comm.all_to_all(small)
        t0 = time.perf_counter()
        for _ in range(a.latency):
            p.comm.all_to_all(small)
        p.result["latency_us"] = (time.perf_counter() - t0) / a.latency * 1e6
    p.finish(world)


def scenario_subset(p: Peer) -> None:
    """4 connected; epoch 0 has only {0, 1} active while 2 and 3 warm up masked; epoch 1 has all."""
    a = p.args
    world = list(range(a.world))
    first = [0, 1]
    p.exchange_metadata(world)
    if p.rank in first:
        p.comm.set_active(first, 0)
    else:
        p.comm.mask_remote()
    p.result["connected"] = list(p.comm.connected)
    p.result["active0"] = list(p.comm.active)
    for i in range(a.rounds):
        p.round("sub0", i)
    p.barrier("commit", world)  # the commit barrier: everyone is between collectives
    p.comm.set_active(world, 1)
    for i in range(a.rounds):
        p.round("sub1", i)
    p.finish(world)


def scenario_mask(p: Peer) -> None:
    a = p.args
    world = list(range(a.world))
    p.exchange_metadata(world)
    p.comm.mask_remote()
    p.result["active_masked"] = list(p.comm.active)
    for i in range(a.rounds):
        p.round(f"mask{p.rank}", i)  # ranks run different numbers of nothing: purely local
    other = (p.rank + 1) % a.world
    try:
        p.comm.all_to_all({other: torch.zeros(3, dtype=torch.uint8)})
    except Exception as e:  # noqa: BLE001
        p.result["errors"]["masked_dest"] = f"{type(e).__name__}: {e}"
    p.comm.set_active(world, 0)
    p.round("unmasked", 0)
    p.finish(world)


def scenario_kill(p: Peer) -> None:
    a = p.args
    world = list(range(a.world))
    victim = a.world - 1
    survivors = [r for r in world if r != victim]
    p.exchange_metadata(world)
    p.comm.set_active(world, 0)
    for i in range(a.rounds):
        p.round("pre", i)
    p.barrier("rounds", world)
    if p.rank == victim:
        p.report()
        time.sleep(600)  # the test kills us
        return
    wait_files([p.dir / "killed"])
    t0 = time.monotonic()
    try:
        p.round("after", 0)
    except Exception as e:  # noqa: BLE001
        p.result["errors"]["dead_peer"] = f"{type(e).__name__}: {e}"
    p.result["error_after_s"] = time.monotonic() - t0
    # Forced scale-down: mask the dead rank under a new epoch and keep going.
    p.comm.set_active(survivors, 1)
    p.comm.disconnect([victim])
    p.result["connected_after"] = list(p.comm.connected)
    for i in range(a.rounds):
        p.round("post", i)
    p.finish(survivors)


def scenario_park(p: Peer) -> None:
    """Both exchange; rank 1 parks (suspend: no agent, buffers kept) while rank 0 goes on alone;
    rank 1 resumes under a new agent, the two reconnect and exchange again under a new epoch."""
    a = p.args
    world = [0, 1]
    p.exchange_metadata(world)
    p.comm.set_active(world, 0)
    for i in range(a.rounds):
        p.round("before", i)
    p.barrier("leave", world)
    buffers = (p.comm._recv.data_ptr(), p.comm._send.data_ptr())
    first_name = p.comm.name
    if p.rank == 0:
        p.comm.set_active([0], 1)
        p.comm.disconnect([1])
        p.round("alone", 0)
        p.barrier("parked", world)
    else:
        p.comm.set_active([1], 1)
        p.comm.disconnect([0])
        p.comm.suspend()
        p.result["resident_after_suspend"] = resident_bytes(p.comm._recv) + resident_bytes(p.comm._send)
        p.result["suspended_metadata"] = p.comm.metadata().hex()
        try:
            p.comm.connect({0: (p.dir / "meta-0.bin").read_bytes()})
        except Exception as e:  # noqa: BLE001 - the test checks the type and message
            p.result["errors"]["connect_suspended"] = f"{type(e).__name__}: {e}"
        p.round("parked", 0)  # alone: purely local, no agent needed
        if a.hold:
            held = torch.ones(1 << 20, device="cuda")  # GPU state for the checkpoint to move
            write_atomic(p.dir / "parked", str(os.getpid()).encode())
            wait_files([p.dir / "unpark"], timeout=300)
            p.result["held_intact"] = bool(held.eq(1).all())
        p.barrier("parked", world)
        p.comm.resume()
    p.result["renamed"] = p.comm.name != first_name
    p.result["same_buffers"] = (p.comm._recv.data_ptr(), p.comm._send.data_ptr()) == buffers
    write_atomic(p.dir / f"meta2-{p.rank}.bin", p.comm.metadata())
    wait_files([p.dir / f"meta2-{r}.bin" for r in world])
    p.comm.connect({r: (p.dir / f"meta2-{r}.bin").read_bytes() for r in world})
    p.comm.set_active(world, 2)
    for i in range(a.rounds):
        p.round("after", i)
    p.finish(world)


SCENARIOS = {
    "exchange": scenario_exchange,
    "subset": scenario_subset,
    "mask": scenario_mask,
    "kill": scenario_kill,
    "park": scenario_park,
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenario", choices=sorted(SCENARIOS), required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--max-ranks", type=int, default=8)
    ap.add_argument("--capacity", type=int, default=1 << 16)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--timeout", type=float, default=30.0)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--tag", default="x")
    ap.add_argument("--overcap", action="store_true")
    ap.add_argument("--latency", type=int, default=0)
    ap.add_argument("--progress-thread", type=lambda v: {"on": True, "off": False, "auto": None}[v], default=None)
    ap.add_argument("--dir", required=True)
    ap.add_argument(
        "--hold",
        action="store_true",
        help="park: the parked rank holds GPU memory and waits for DIR/unpark (a CUDA checkpoint window)",
    )
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"[rank {args.rank}] %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    p = Peer(args)
    try:
        SCENARIOS[args.scenario](p)
    except BaseException as e:
        p.result["fatal"] = f"{type(e).__name__}: {e}"
        p.report()
        raise
    p.report()
    return 0


if __name__ == "__main__":
    sys.exit(main())
