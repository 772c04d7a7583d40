"""Fault matrix: `dynamo serve graphs/elastic:Frontend` (defaults but the planner, off so the sizes
stay the benchmark's) under streaming greedy clients, one fault per row, each on a fresh graph.

Per row: when the fault was injected, when the router took it up (detection), when the deployment
served again without the faulty rank (recovery: the failover's commit), when the replacement
served (back at the starting size), requests sent / completed / failed, and completions whose
tokens differ from the single-rank reference engine. Every row ends with a scale request that must
succeed (no wedge). Prints a table and writes JSON (`--out`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import time
from pathlib import Path

from harness.server import Server, Traffic, engine_reference, scale

PROMPTS = [[5 + i, 17, 42 + i, 99, 7 * i + 3, 250] for i in range(12)]
MAX_TOKENS = 24


def inject(srv: Server, fault: str) -> tuple[float, int]:
    """Apply `fault` to rank 1; (unix time, the rank)."""
    ranks = {r["rank"]: r["pid"] for r in srv.topology()["ranks"]}
    sig = {"serving rank killed": signal.SIGKILL, "serving rank stalled": signal.SIGSTOP}[fault]
    t = time.time()
    os.kill(ranks[1], sig)
    return t, 1


def wait_recovered(srv: Server, rank: int, before: set[str], timeout: float) -> tuple[dict | None, dict | None]:
    """The failover of `rank` and the replacement after it, once both ended."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ops = [op for op in srv.control("GET", "/operations").json() if op["id"] not in before]
        fo = next((op for op in ops if op["kind"] == "failover" and rank in op["leaving"]), None)
        up = next((op for op in ops if fo and op["kind"] == "up" and op["started_at"] >= fo["started_at"]), None)
        if fo and up and up["total_s"] is not None and not srv.topology()["scaling"]:
            return fo, up
        time.sleep(0.2)
    return None, None


def run_row(fault: str, args, reference: list[str]) -> dict:
    srv = Server(
        ["--Worker.dp_size=3", "--Worker.max_ranks=4", "--Planner.enabled=false", *args.graph_args], boot_timeout_s=600
    )
    try:
        before = {op["id"] for op in srv.control("GET", "/operations").json()}
        with Traffic(srv, PROMPTS, MAX_TOKENS, clients=args.clients) as traffic:
            time.sleep(args.warmup_s)
            t_fault, rank = inject(srv, fault)
            fo, up = wait_recovered(srv, rank, before, args.timeout_s)
            time.sleep(args.settle_s)
        next_scale = scale(srv, 2)["phase"] if fo else "not tried"
        wrong = sum(text != reference[p] for p, text, _, _ in traffic.results)
        return {
            "fault": fault,
            "detected_s": fo["started_at"] - t_fault if fo else None,
            "serving_again_s": fo["committed_at"] - t_fault if fo and fo["committed_at"] else None,
            "failover_downtime_ms": fo["downtime_s"] * 1e3 if fo and fo["downtime_s"] is not None else None,
            "replaced_s": up["committed_at"] - t_fault if up and up["committed_at"] else None,
            "sent": len(traffic.results) + len(traffic.errors),
            "completed": len(traffic.results),
            "failed": len(traffic.errors),
            "wrong_tokens": wrong,
            "next_scale": next_scale,
            "failover": fo,
            "errors": traffic.errors[:5],
        }
    finally:
        srv.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--faults",
        default="serving rank killed,serving rank stalled",
        help="comma-separated rows (default: %(default)s)",
    )
    p.add_argument("--clients", type=int, default=6, help="streaming clients (default %(default)s)")
    p.add_argument("--warmup-s", type=float, default=3.0, help="traffic before the fault (default %(default)s)")
    p.add_argument("--settle-s", type=float, default=2.0, help="traffic after recovery (default %(default)s)")
    p.add_argument("--timeout-s", type=float, default=180.0, help="longest wait for recovery (default %(default)s)")
    p.add_argument("--out", type=Path, default=Path("bench/results/faults.json"), help="JSON output path")
    p.add_argument("graph_args", nargs="*", help="extra `dynamo serve` options after --")
    args = p.parse_args()
    device = "cuda" if "--Worker.device=cuda" in args.graph_args else "cpu"
    reference = engine_reference(PROMPTS, MAX_TOKENS, device=device)
    rows = [run_row(f.strip(), args, reference) for f in args.faults.split(",")]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "command": " ".join(["python -m bench.faults", *sys.argv[1:]]),
                "rows": rows,
                "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
            },
            indent=2,
        )
    )

    def f(v, fmt="{:.2f}"):
        return "-" if v is None else fmt.format(v)

    print(
        "options that differ from `dynamo serve graphs/elastic:Frontend`'s defaults: --Planner.enabled=false "
        "--Worker.dp_size=3 " + " ".join(args.graph_args)
    )
    print(
        "| fault | detected s | serving again s | failover downtime ms | replaced s | sent | completed | "
        "failed | wrong tokens | next /scale |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['fault']} | {f(r['detected_s'])} | {f(r['serving_again_s'])} | "
            f"{f(r['failover_downtime_ms'], '{:.1f}')} | {f(r['replaced_s'])} | {r['sent']} | {r['completed']} | "
            f"{r['failed']} | {r['wrong_tokens']} | {r['next_scale']} |"
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
