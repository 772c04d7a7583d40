"""Scale-operation benchmark: downtime and total time of 2 -> 4 and 4 -> 2 for modes A, B, C,
and decode throughput while an operation prepares against a static deployment.

Runs `dynamo serve graphs/elastic:Frontend` as a user would, keeps streaming clients busy, and
scales through the router's API. Downtime is the router's measurement (first pause request to
last resume reply); the decode step is the median gap between streamed tokens with no operation
running, so `downtime / step` says how many decode steps a commit costs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

from tests.server import MODEL, Server


class Load:
    """Streaming clients; every token's arrival time is kept."""

    def __init__(self, srv: Server, clients: int, max_tokens: int):
        self.srv, self.max_tokens = srv, max_tokens
        self.stamps: list[float] = []
        self.gaps: list[tuple[float, float]] = []  # (time, gap since the previous token of that stream)
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self.client, args=(i,), daemon=True) for i in range(clients)]

    def client(self, i: int) -> None:
        http = httpx.Client(base_url=self.srv.http.base_url, timeout=300)
        k = i
        while not self.stop.is_set():
            body = {"model": MODEL, "prompt": [5 + k % 50, 17, 42, 99], "max_tokens": self.max_tokens,
                    "temperature": 0, "stream": True, "ignore_eos": True}
            k += 1
            try:
                last = None
                with http.stream("POST", "/v1/completions", json=body) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: {"):
                            now = time.time()
                            with self.lock:
                                self.stamps.append(now)
                                if last is not None:
                                    self.gaps.append((now, now - last))
                            last = now
            except Exception as e:  # counted and reported, never hidden
                self.errors.append(repr(e))

    def rate(self, t0: float, t1: float) -> float:
        with self.lock:
            n = sum(1 for t in self.stamps if t0 <= t < t1)
        return n / max(t1 - t0, 1e-9)

    def step(self, t0: float, t1: float) -> float:
        with self.lock:
            gaps = [g for t, g in self.gaps if t0 <= t < t1]
        return statistics.median(gaps) if gaps else float("nan")

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(timeout=300)


def run_mode(mode: str, args) -> list[dict]:
    print(f"mode {mode}: starting the graph", file=sys.stderr)
    srv = Server([f"--Worker.max_ranks={args.max_ranks}", f"--Worker.dp_size={args.small}",
                  "--Router.rebalance=false"])
    rows = []
    try:
        with Load(srv, args.clients, args.max_tokens) as load:
            time.sleep(args.warmup_s)
            for src, dst in ((args.small, args.large), (args.large, args.small)):
                s0 = time.time()
                time.sleep(args.static_s)
                s1 = time.time()
                print(f"mode {mode}: scaling {src} -> {dst}", file=sys.stderr)
                t0 = time.time()
                r = srv.control("POST", "/scale?wait=true", json={"dp_size": dst, "mode": mode}, timeout=600)
                op = r.json()
                if op.get("phase") != "done":
                    raise RuntimeError(f"mode {mode} {src}->{dst} did not complete: {op}")
                prep_end = op["committed_at"] - (op["downtime_s"] or 0)
                rows.append({
                    "mode": mode, "from": src, "to": dst, "downtime_s": op["downtime_s"], "total_s": op["total_s"],
                    "phases": op["phases"], "decode_step_s": load.step(s0, s1),
                    "tok_s_static": load.rate(s0, s1), "tok_s_preparing": load.rate(t0, prep_end),
                    "prepare_s": prep_end - t0, "pull_bytes": op["pull_bytes"],
                })
                r = rows[-1]
                print(f"mode {mode}: {src}->{dst} downtime {r['downtime_s'] * 1e3:.1f} ms, total {r['total_s']:.2f} s",
                      file=sys.stderr)
                time.sleep(args.settle_s)
        if load.errors:
            raise RuntimeError(f"{len(load.errors)} client errors, first: {load.errors[0]}")
    finally:
        srv.stop()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="A,B,C", help="comma-separated modes to run (A blocking, B async prepare, "
                   "C async prepare + reuse); default %(default)s")
    p.add_argument("--small", type=int, default=2, help="the smaller size (default %(default)s)")
    p.add_argument("--large", type=int, default=4, help="the larger size (default %(default)s)")
    p.add_argument("--max-ranks", type=int, default=4, help="Worker.max_ranks (default %(default)s)")
    p.add_argument("--clients", type=int, default=4, help="concurrent streaming clients (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per request (default %(default)s)")
    p.add_argument("--warmup-s", type=float, default=3.0, help="traffic before measuring (default %(default)s)")
    p.add_argument("--static-s", type=float, default=4.0,
                   help="static window measured before each operation (default %(default)s)")
    p.add_argument("--settle-s", type=float, default=2.0, help="pause after each operation (default %(default)s)")
    p.add_argument("--out", type=Path, default=Path("bench/results/scale.json"), help="JSON output path")
    args = p.parse_args()

    rows = [row for mode in args.modes.split(",") for row in run_mode(mode.strip(), args)]
    print("| mode | scale | downtime ms | downtime / decode step | total s | prepare s | tok/s static | "
          "tok/s preparing |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['from']} -> {r['to']} | {r['downtime_s'] * 1e3:.1f} | "
              f"{r['downtime_s'] / r['decode_step_s']:.1f} | {r['total_s']:.2f} | {r['prepare_s']:.2f} | "
              f"{r['tok_s_static']:.0f} | {r['tok_s_preparing']:.0f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "command": " ".join(["python -m bench.scale", *sys.argv[1:]]), "rows": rows,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()}, "args": vars(args) | {"out": str(args.out)},
    }, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
