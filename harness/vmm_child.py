"""Child process of tests/test_vmm.py: one vmm engine rank driven over stdin/stdout.

    python harness/vmm_child.py MODEL_DIR {local|nixl} MAX_NEW

Protocol: the child prints `@@ {json}` lines (anything else on stdout is noise to skip) and reads
one JSON command a line: {"cmd": "generate" | "release" | "restore" | "store" | "store_close" | "quit"}
("store" registers the weights with NIXL and hands out a manifest, as a serving rank does). It first builds the
rank (RankConfig(vmm=True)), generates once and reports "ready". Between commands the rank stays
paused, so the parent may checkpoint the process (no CUDA work in flight, none started).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from components.engine.rank import EngineRank, RankConfig  # noqa: E402
from components.engine.weights.store import WeightStore  # noqa: E402
from harness.reference import PROMPTS, submit_all  # noqa: E402


class LocalComm:
    """A one-rank EPCommunicator (no NIXL): all_to_all hands this rank's message back to it."""

    rank, max_ranks = 0, 1
    windows = None

    def __init__(self, capacity_bytes: int = 1 << 30):
        self.capacity_bytes = capacity_bytes
        self._active: tuple[int, ...] = (0,)

    def metadata(self) -> bytes:
        return b"local"

    def connect(self, peers, activate: bool = False) -> None:
        if set(peers) - {0}:
            raise ValueError("LocalComm has one rank")

    def disconnect(self, ranks) -> None:
        pass

    def set_active(self, ranks, epoch: int) -> None:
        self._active = tuple(sorted(ranks))

    def mask_remote(self) -> None:
        self._active = (0,)

    def declare_gone(self, ranks) -> None:
        pass

    def suspend(self) -> None:
        pass

    def resume(self) -> None:
        pass

    @property
    def active(self) -> tuple[int, ...]:
        return self._active

    @property
    def connected(self) -> tuple[int, ...]:
        return (0,)

    def all_to_all(self, send):
        t = send.get(0)
        return {0: t.clone() if t is not None else torch.empty(0, dtype=torch.uint8)}

    def close(self) -> None:
        pass


def say(**msg) -> None:
    sys.stdout.write("@@ " + json.dumps(msg) + "\n")
    sys.stdout.flush()


def generate(eng: EngineRank, max_new: int) -> list[list[int]]:
    """Every prompt in the same first step (submitted while paused), greedy; leaves it paused."""
    eng.pause().result(60)
    wait = submit_all(eng, PROMPTS, max_new, ignore_eos=True)
    eng.resume().result(60)
    tokens, _ = wait(300)
    eng.pause().result(60)
    return tokens


def state(eng: EngineRank) -> dict:
    return {
        "captures": eng.graphs.captures if eng.graphs else 0,
        "replays": eng.graphs.replays if eng.graphs else 0,
        "arena_ptr": eng.arena.ptr,
        "lm_head_ptr": eng.model.lm_head.weight.data_ptr(),
        "mapped": eng.arena.mapped,
    }


def main() -> None:
    path, comm_kind, max_new = sys.argv[1], sys.argv[2], int(sys.argv[3])
    torch.set_grad_enabled(False)
    t0 = time.perf_counter()
    cfg = RankConfig(vmm=True, device="cuda", max_len=256)
    eng = EngineRank(cfg, path, comm=LocalComm() if comm_kind == "local" else None)
    placement = eng.default_placement([0])
    eng.configure(0, [0], placement)
    eng.load_experts(placement)
    torch.cuda.synchronize()
    build_s = time.perf_counter() - t0
    eng.start()
    tokens = generate(eng, max_new)
    say(
        event="ready",
        pid=os.getpid(),
        tokens=tokens,
        build_s=build_s,
        arena_bytes=eng.arena.nbytes,
        arena_used=eng.arena.used,
        torch_reserved=torch.cuda.memory_reserved(),
        **state(eng),
    )

    def refill():
        t = time.perf_counter()
        eng.restore_memory()
        torch.cuda.synchronize()
        remap_s = time.perf_counter() - t
        t = time.perf_counter()
        eng.model.load_dense(eng.ckpt)
        eng.load_experts(placement)
        torch.cuda.synchronize()
        return remap_s, time.perf_counter() - t

    store = None
    for line in sys.stdin:
        cmd = json.loads(line)["cmd"]
        try:
            if cmd == "generate":
                say(event=cmd, tokens=generate(eng, max_new), **state(eng))
            elif cmd == "release":
                t = time.perf_counter()
                eng.call(eng.release_memory).result(60)  # the rank is paused: not stepping
                say(event=cmd, release_s=time.perf_counter() - t, **state(eng))
            elif cmd == "restore":
                remap_s, reload_s = eng.call(refill).result(300)
                say(event=cmd, remap_s=remap_s, reload_s=reload_s, **state(eng))
            elif cmd == "store":
                store = WeightStore(0, eng.weight_tensors(), device="cuda")
                m = store.manifest()
                say(event=cmd, tensors=len(m.tensors), ipc_regions=len(m.ipc))
            elif cmd == "store_close":
                store.close()
                say(event=cmd)
            elif cmd == "quit":
                eng.stop()
                say(event=cmd)
                return
            else:
                say(event=cmd, error=f"unknown command {cmd!r}")
        except Exception:
            say(event=cmd, error=traceback.format_exc())


if __name__ == "__main__":
    try:
        main()
    except Exception:
        say(event="error", error=traceback.format_exc())
        sys.exit(1)
