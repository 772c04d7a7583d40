"""Scale-operation benchmark: downtime and total time of 2 -> 4 and 4 -> 2 for modes A, B, C,
D (C restoring parked ranks) and a full restart, the join time by phase, and decode throughput
while an operation prepares against a static deployment. Every greedy completion of a prompt
must equal the first one seen for it, before and after each scale; on a GPU, each rank's GPU
memory (nvidia-smi) is recorded after each operation, parked ranks included.

Runs `dynamo serve graphs/elastic:Frontend` as a user would, keeps streaming clients busy, and
scales through the router's API. Downtime is the router's measurement (first pause request to
last resume reply); the decode step is the median gap between streamed tokens with no operation
running, so `downtime / step` says how many decode steps a commit costs.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench.measure import write_results
from harness.server import Server, Traffic


def gpu_memory() -> dict[int, int]:
    """nvidia-smi's MiB per process id, plus the device total under key 0 ({} without a GPU)."""

    def smi(query: str) -> list[list[str]]:
        try:
            out = subprocess.run(
                ["nvidia-smi", query, "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30
            ).stdout
        except (OSError, subprocess.TimeoutExpired):
            return []
        return [[c.strip() for c in line.split(",")] for line in out.splitlines() if line.strip()]

    used = {
        int(r[0]): int(r[1])
        for r in smi("--query-compute-apps=pid,used_memory")
        if len(r) == 2 and r[0].isdigit() and r[1].isdigit()
    }
    total = [int(r[0]) for r in smi("--query-gpu=memory.used") if r and r[0].isdigit()]
    return used | ({0: sum(total)} if total else {})


def rank_memory(srv: Server, parked: list[int]) -> dict[str, dict]:
    """Per rank: pid, GPU MiB as nvidia-smi lists it (None when its container hides pids), and for
    parked ranks the CUDA checkpoint state."""
    mem = gpu_memory()
    out = {}
    for v in srv.topology()["ranks"]:
        row = {"pid": v["pid"], "gpu_mib": mem.get(v["pid"]), "state": v["state"]}
        if v["rank"] in parked and mem:
            from snapshot import cuda_checkpoint

            try:
                row["cuda_state"] = cuda_checkpoint.state(v["pid"])
            except Exception as e:  # reported in the JSON, never fatal to the benchmark
                row["cuda_state"] = f"unknown: {e}"
        out[str(v["rank"])] = row
    return out | {"device_used_mib": mem.get(0)}


PROMPTS = [[5 + k, 17, 42, 99] for k in range(50)]


class Load(Traffic):
    """Streaming clients (harness.server.Traffic) with every chunk's arrival time kept, for token
    rates and decode-step gaps."""

    def __init__(self, srv: Server, clients: int, max_tokens: int):
        super().__init__(srv, PROMPTS, max_tokens, clients, on_chunk=self._stamp)
        self.stamps: list[float] = []
        self.gaps: list[tuple[float, float]] = []  # (time, gap since the previous token of that stream)
        self.lock = threading.Lock()

    def _stamp(self, now: float, gap: float | None) -> None:
        with self.lock:
            self.stamps.append(now)
            if gap is not None:
                self.gaps.append((now, gap))

    def rate(self, t0: float, t1: float) -> float:
        with self.lock:
            n = sum(1 for t in self.stamps if t0 <= t < t1)
        return n / max(t1 - t0, 1e-9)

    def step(self, t0: float, t1: float) -> float:
        with self.lock:
            gaps = [g for t, g in self.gaps if t0 <= t < t1]
        return statistics.median(gaps) if gaps else float("nan")

    def changed(self) -> list[str]:
        """Greedy completions that differ from the first one of the same prompt."""
        first: dict[int, str] = {}
        return [
            f"greedy completion changed, prompt {p}: {text!r} != {first[p]!r}"
            for p, text, _, _ in sorted(list(self.results), key=lambda r: r[2])
            if first.setdefault(p, text) != text
        ]


def non_defaults(args, dp_size: int) -> list[str]:
    """The `dynamo serve` options this run sets that differ from what a user gets by default. The
    planner is always off: the benchmark chooses the sizes."""
    from components.worker.component import Worker

    default = Worker.Config()
    opts = ["--Planner.enabled=false"]
    opts += [f"--Worker.dp_size={dp_size}"] if dp_size != default.dp_size else []
    opts += [f"--Worker.max_ranks={args.max_ranks}"] if args.max_ranks != default.max_ranks else []
    opts += ["--Router.rebalance=false"] if args.no_rebalance else []
    return opts + args.graph_args


def run_mode(mode: str, args) -> list[dict]:
    print(f"mode {mode}: starting the graph", file=sys.stderr)
    srv = Server(non_defaults(args, args.small), boot_timeout_s=600, model=None)
    rows = []
    # Mode C runs a third operation: the scale-up again, now restoring the ranks the scale-down
    # parked. That is mode D (C with snapshot restore).
    steps = [(args.small, args.large, mode), (args.large, args.small, mode)]
    if mode == "C":
        steps.append((args.small, args.large, "D"))
    try:
        with Load(srv, args.clients, args.max_tokens) as load:
            time.sleep(args.warmup_s)
            static = None  # (greedy changed, completions) before any operation: the static deployment's own
            for src, dst, label in steps:
                s0 = time.time()
                time.sleep(args.static_s)
                s1 = time.time()
                static = static or (len(load.changed()), len(load.results))
                print(f"mode {mode}: scaling {src} -> {dst}", file=sys.stderr)
                t0 = time.time()
                r = srv.control("POST", "/scale?wait=true", json={"dp_size": dst, "mode": mode}, timeout=600)
                op = r.json()
                if op.get("phase") != "done":
                    raise RuntimeError(f"mode {mode} {src}->{dst} did not complete: {op}")
                prep_end = op["committed_at"] - (op["downtime_s"] or 0)
                rows.append(
                    {
                        "mode": label,
                        "from": src,
                        "to": dst,
                        "joined_from": op.get("joined_from", {}),
                        "downtime_s": op["downtime_s"],
                        "total_s": op["total_s"],
                        "phases": op["phases"],
                        "decode_step_s": load.step(s0, s1),
                        "tok_s_static": load.rate(s0, s1),
                        "tok_s_preparing": load.rate(t0, prep_end),
                        "prepare_s": prep_end - t0,
                        "pull_bytes": op["pull_bytes"],
                        "parked": op.get("parked", []),
                        "ranks": rank_memory(srv, op.get("parked", [])),
                        "completions": len(load.results),
                        "greedy_mismatches": len(load.changed()),
                        "static_greedy_mismatches": static[0],
                        "static_completions": static[1],
                        "client_errors": len(load.errors),
                    }
                )
                r = rows[-1]
                print(
                    f"mode {label}: {src}->{dst} downtime {r['downtime_s'] * 1e3:.1f} ms, total {r['total_s']:.2f} s",
                    file=sys.stderr,
                )
                time.sleep(args.settle_s)
        # Counted in every row and shown here; the numbers are kept either way.
        for m in [f"prompt {p}: {err}" for p, err in load.errors[:5]] + load.changed()[:5]:
            print(f"mode {mode}: {m}", file=sys.stderr)
    finally:
        srv.stop()
    return rows


def restart(args) -> dict:
    """The baseline: a deployment restarted at the larger size, timed to its first token."""
    t0 = time.time()
    srv = Server(non_defaults(args, args.large), boot_timeout_s=1200, model=None)
    try:
        srv.stream_text([5, 17, 42, 99], 1)
        ready = time.time() - t0
    finally:
        srv.stop()
    print(f"restart at {args.large} ranks: first token after {ready:.1f} s", file=sys.stderr)
    return {
        "mode": "restart",
        "from": args.small,
        "to": args.large,
        "downtime_s": ready,
        "total_s": ready,
        "phases": {},
        "decode_step_s": float("nan"),
        "tok_s_static": 0.0,
        "tok_s_preparing": 0.0,
        "prepare_s": 0.0,
        "pull_bytes": 0,
        "joined_from": {},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--modes",
        default="A,B,C",
        help="comma-separated modes to run (A blocking, B async prepare, C async prepare + reuse); default %(default)s",
    )
    p.add_argument("--small", type=int, default=2, help="the smaller size (default %(default)s)")
    p.add_argument("--large", type=int, default=4, help="the larger size (default %(default)s)")
    p.add_argument("--max-ranks", type=int, default=4, help="Worker.max_ranks (default %(default)s)")
    p.add_argument("--clients", type=int, default=4, help="concurrent streaming clients (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per request (default %(default)s)")
    p.add_argument("--warmup-s", type=float, default=3.0, help="traffic before measuring (default %(default)s)")
    p.add_argument(
        "--static-s", type=float, default=4.0, help="static window measured before each operation (default %(default)s)"
    )
    p.add_argument("--settle-s", type=float, default=2.0, help="pause after each operation (default %(default)s)")
    p.add_argument("--out", type=Path, default=Path("bench/results/scale.json"), help="JSON output path")
    p.add_argument("--no-restart", action="store_true", help="skip the full-restart baseline")
    p.add_argument(
        "--no-rebalance",
        action="store_true",
        help="--Router.rebalance=false: no EPLB after each operation (default: on, as for users)",
    )
    p.add_argument(
        "graph_args",
        nargs="*",
        help="extra `dynamo serve` options after --, e.g. "
        "-- --Worker.model=DIR --Worker.device=cuda --Worker.dtype=bfloat16",
    )
    args = p.parse_args()

    rows: list[dict] = []

    def save() -> None:  # after every mode, so a run cut short still leaves its numbers
        result = {
            "command": " ".join(["python -m bench.scale", *sys.argv[1:]]),
            "rows": rows,
            "non_default_options": non_defaults(args, args.small),
            "args": vars(args) | {"out": str(args.out)},
        }
        write_results(args.out, result, quiet=True)

    for mode in args.modes.split(","):
        rows += run_mode(mode.strip(), args)
        save()
    if not args.no_restart:
        rows.append(restart(args))
        save()
    print(
        "options that differ from `dynamo serve graphs/elastic:Frontend`'s defaults: "
        + " ".join(non_defaults(args, args.small))
    )
    for r in rows[:1]:
        if "static_completions" in r:
            print(
                f"greedy completions that changed under the static deployment, before any operation: "
                f"{r['static_greedy_mismatches']} / {r['static_completions']} (the rows count from the start)"
            )
    print(
        "| mode | scale | downtime ms | downtime / decode step | total s | prepare s | tok/s static | "
        "tok/s preparing | greedy changed / completions | client errors |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['mode']} | {r['from']} -> {r['to']} | {r['downtime_s'] * 1e3:.1f} | "
            f"{r['downtime_s'] / r['decode_step_s']:.1f} | {r['total_s']:.2f} | {r['prepare_s']:.2f} | "
            f"{r['tok_s_static']:.0f} | {r['tok_s_preparing']:.0f} | "
            f"{r.get('greedy_mismatches', '-')} / {r.get('completions', '-')} | {r.get('client_errors', '-')} |"
        )
    if any(r.get("ranks", {}).get("device_used_mib") is not None for r in rows):
        print("\nGPU memory after each operation (MiB, nvidia-smi; '?' where it lists no row for the pid):")
        print("| mode | scale | device used | per rank (state, CUDA checkpoint state of parked ranks) |")
        print("|---|---|---|---|")
        for r in rows:
            ranks = r.get("ranks", {})
            per = ", ".join(
                f"{k}: {v['gpu_mib'] if v['gpu_mib'] is not None else '?'} ({v['state']}"
                + (f", {v['cuda_state']}" if "cuda_state" in v else "")
                + ")"
                for k, v in ranks.items()
                if k != "device_used_mib"
            )
            print(f"| {r['mode']} | {r['from']} -> {r['to']} | {ranks.get('device_used_mib')} | {per} |")
    phases = ["starting", "loading", "warming", "connecting", "draining", "migrating", "committing", "cleanup"]
    print("\njoin time by phase (s):")
    print("| mode | scale | joined from | " + " | ".join(phases) + " |")
    print("|---|---|---|" + "---|" * len(phases))
    for r in rows:
        if r["mode"] != "restart":
            how = ",".join(sorted(set(r["joined_from"].values()))) or "-"
            print(
                f"| {r['mode']} | {r['from']} -> {r['to']} | {how} | "
                + " | ".join(f"{r['phases'].get(p, 0):.3f}" for p in phases)
                + " |"
            )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
