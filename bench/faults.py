"""Fault matrix: `dynamo serve graphs/elastic:Frontend` (defaults but the planner, off so the sizes
stay the benchmark's, except in the planner's own row) at 3 ranks under streaming greedy clients,
one fault per row, each on a fresh graph.

Rows:
  serving rank killed / stalled   SIGKILL / SIGSTOP of rank 1 while it serves
  leaving rank killed             SIGKILL of rank 2 while a scale-down 3 -> 2 drains it
  joiner killed in pull / warmup  a scale-up 3 -> 4 whose joiner dies on the command that makes it
                                  pull its weights / warm up (injected: the joiner exits on it)
  router killed                   SIGKILL of the router (`dynamo serve` restarts it; it adopts)
  router killed mid scale-up      the same while a scale-up 3 -> 4 starts its joiner
  planner killed                  SIGKILL of the planner (not critical: the rest serves on)

Per row: when the fault was taken up (detected), when the deployment was whole again (recovered:
a failover's commit, an aborted scale-up's end, the restarted router's adoption), when a failed
serving rank's replacement served (back at the starting size), requests sent / completed / lost,
and completions whose tokens differ from the single-rank reference engine. Every row ends with a
scale request that must succeed (no wedge). Prints a table and writes JSON (`--out`).

    python -m bench.faults                       # every row, CPU, bench/results/faults.json
    python -m bench.faults --faults "router killed" -- --Worker.device=cuda
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from harness.server import Server, Traffic, engine_reference, scale

PROMPTS = [[5 + i, 17, 42 + i, 99, 7 * i + 3, 250] for i in range(12)]
MAX_TOKENS = 24


def op_ids(srv: Server) -> set[str]:
    return {op["id"] for op in srv.control("GET", "/operations").json()}


def new_ops(srv: Server, before: set[str]) -> list[dict]:
    return [op for op in srv.control("GET", "/operations").json() if op["id"] not in before]


def ended(op: dict) -> float:
    return op["started_at"] + op["total_s"]


def wait_failover(srv: Server, rank: int, before: set[str], t_fault: float, timeout: float) -> dict:
    """A failed serving rank: the failover that masked it out and the replacement after it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ops = new_ops(srv, before)
        fo = next((op for op in ops if op["kind"] == "failover" and rank in op["leaving"]), None)
        up = next((op for op in ops if fo and op["kind"] == "up" and op["started_at"] >= fo["started_at"]), None)
        if fo and up and up["total_s"] is not None and not srv.topology()["scaling"]:
            return {
                "detected_s": fo["started_at"] - t_fault,
                "recovered_s": fo["committed_at"] - t_fault if fo["committed_at"] else None,
                "failover_downtime_ms": fo["downtime_s"] * 1e3 if fo["downtime_s"] is not None else None,
                "replaced_s": up["committed_at"] - t_fault if up["committed_at"] else None,
                "operations": ops,
            }
        time.sleep(0.2)
    return {"operations": new_ops(srv, before)}


def rank_pid(srv: Server, rank: int) -> int:
    return next(r["pid"] for r in srv.topology()["ranks"] if r["rank"] == rank)


def serving_rank(sig: int) -> Callable[[Server, argparse.Namespace], dict]:
    def run(srv: Server, args) -> dict:
        before, pid = op_ids(srv), rank_pid(srv, 1)
        t = time.time()
        os.kill(pid, sig)
        return wait_failover(srv, 1, before, t, args.timeout_s)

    return run


def leaving_rank_killed(srv: Server, args) -> dict:
    """Scale 3 -> 2 with a long drain; SIGKILL rank 2 once it is out of routing and draining."""
    before, pid = op_ids(srv), rank_pid(srv, 2)
    r = srv.control("POST", "/scale", json={"dp_size": 2, "drain_timeout": 30})
    assert r.status_code == 202, r.text
    deadline = time.monotonic() + args.timeout_s
    while time.monotonic() < deadline:
        if next(v["state"] for v in srv.topology()["ranks"] if v["rank"] == 2) == "LEAVING":
            break
        time.sleep(0.01)
    t = time.time()
    os.kill(pid, signal.SIGKILL)
    return wait_failover(srv, 2, before, t, args.timeout_s)


def joiner_killed(command: str) -> Callable[[Server, argparse.Namespace], dict]:
    """Scale 3 -> 4; the joiner exits on `command` (its fault, injected through the router)."""
    phase = {"pull_weights": "loading", "warmup": "warming"}[command]

    def run(srv: Server, args) -> dict:
        before = op_ids(srv)
        rec = scale(srv, 4, fault=f"exit_on={command}")
        # The joiner exits on the command, sent as the operation enters its phase: the phases
        # before it (in order) end there.
        names = list(rec["phases"])
        t = rec["started_at"] + sum(rec["phases"][p] for p in names[: names.index(phase)])
        return {
            "detected_s": ended(rec) - t,  # the abort (the joiner gone, the group untouched) is over
            "recovered_s": ended(rec) - t,
            "aborted": f"{rec['phase']}: {rec['error']}",
            "operations": new_ops(srv, before),
        }

    return run


def router_pids(srv: Server) -> list[int]:
    return [int(p) for p in re.findall(r"started Router \(pid (\d+)", srv.output)]


def router_killed(during_scale_up: bool) -> Callable[[Server, argparse.Namespace], dict]:
    """SIGKILL the router, serving; or while a scale-up 3 -> 4 is starting its joiner, which the
    restarted router then finds mid-operation and stops (the scale-up is lost with the router)."""

    def run(srv: Server, args) -> dict:
        before, topo, old = op_ids(srv), srv.topology(), router_pids(srv)[-1]
        if during_scale_up:
            r = srv.control("POST", "/scale", json={"dp_size": 4})
            assert r.status_code == 202, r.text
            deadline = time.monotonic() + args.timeout_s
            while time.monotonic() < deadline and not any(v["rank"] == 3 for v in srv.topology()["ranks"]):
                time.sleep(0.05)
        t = time.time()
        os.kill(old, signal.SIGKILL)
        detected = recovered = None
        deadline = time.monotonic() + args.timeout_s
        while time.monotonic() < deadline and recovered is None:
            if detected is None and router_pids(srv)[-1] != old:
                detected = time.time() - t  # `dynamo serve` started the next one
            if detected is not None:
                try:
                    if srv.control("GET", "/health").status_code == 200:
                        recovered = time.time() - t  # it adopted what the ranks serve
                except httpx.HTTPError:
                    pass
            time.sleep(0.05)
        after = srv.topology()
        adopted = re.findall(r"adopted epoch .*", srv.output)
        return {
            "detected_s": detected,
            "recovered_s": recovered,
            "adopted": {
                "log": adopted[-1] if adopted else None,
                "epoch": [topo["epoch"], after["epoch"]],
                "active": [topo["active"], after["active"]],
                "pids_kept": all(
                    any(a["rank"] == b["rank"] and a["pid"] == b["pid"] for b in after["ranks"]) for a in topo["ranks"]
                ),
                "ranks_after": {r["rank"]: r["state"] for r in after["ranks"]},
            },
            "operations": new_ops(srv, before),
        }

    return run


def planner_killed(srv: Server, args) -> dict:
    pid = int(re.findall(r"started Planner \(pid (\d+)", srv.output)[-1])
    t = time.time()
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + args.timeout_s
    while time.monotonic() < deadline and f"component Planner (pid {pid})" not in srv.output:
        time.sleep(0.05)
    # Not critical: reported, and the rest serves on at its size (scaling by hand only from here).
    return {"detected_s": time.time() - t, "recovered_s": None, "note": "not restarted; nothing else affected"}


FAULTS: dict[str, tuple[Callable[[Server, argparse.Namespace], dict], list[str]]] = {
    # row: (injection and measurement, graph options it needs)
    "serving rank killed": (serving_rank(signal.SIGKILL), []),
    "serving rank stalled": (serving_rank(signal.SIGSTOP), []),
    "leaving rank killed": (leaving_rank_killed, []),
    "joiner killed in pull": (joiner_killed("pull_weights"), ["--Router.allow_fault_injection=true"]),
    "joiner killed in warmup": (joiner_killed("warmup"), ["--Router.allow_fault_injection=true"]),
    "router killed": (router_killed(during_scale_up=False), []),
    "router killed mid scale-up": (router_killed(during_scale_up=True), []),
    # The planner's own row runs it; it is asked to keep the size (min_dp = max_dp = 3).
    "planner killed": (planner_killed, ["--Planner.enabled=true", "--Planner.min_dp=3", "--Planner.max_dp=3"]),
}


def run_row(fault: str, args, reference: list[str]) -> dict:
    inject, options = FAULTS[fault]
    srv = Server(
        ["--Worker.dp_size=3", "--Worker.max_ranks=4", "--Planner.enabled=false", *options, *args.graph_args],
        boot_timeout_s=600,
    )
    try:
        with Traffic(srv, PROMPTS, MAX_TOKENS, clients=args.clients) as traffic:
            time.sleep(args.warmup_s)
            measured = inject(srv, args)
            time.sleep(args.settle_s)
        # Not wedged: the next scale works (to whichever size the deployment is not at).
        size = srv.topology()["dp_size"]
        next_scale = scale(srv, 2 if size != 2 else 3)["phase"]
        wrong = sum(text != reference[p] for p, text, _, _ in traffic.results)
        return {
            "fault": fault,
            "detected_s": measured.get("detected_s"),
            "recovered_s": measured.get("recovered_s"),
            "failover_downtime_ms": measured.get("failover_downtime_ms"),
            "replaced_s": measured.get("replaced_s"),
            "sent": len(traffic.results) + len(traffic.errors),
            "completed": len(traffic.results),
            "lost": len(traffic.errors),
            "wrong_tokens": wrong,
            "next_scale": next_scale,
            **{k: v for k, v in measured.items() if k not in ROW_KEYS},
            "errors": traffic.errors[:5],
        }
    finally:
        srv.stop()


ROW_KEYS = ("detected_s", "recovered_s", "failover_downtime_ms", "replaced_s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--faults", default=",".join(FAULTS), help="comma-separated rows (default: %(default)s)")
    p.add_argument("--clients", type=int, default=6, help="streaming clients (default %(default)s)")
    p.add_argument("--warmup-s", type=float, default=3.0, help="traffic before the fault (default %(default)s)")
    p.add_argument("--settle-s", type=float, default=2.0, help="traffic after recovery (default %(default)s)")
    p.add_argument("--timeout-s", type=float, default=180.0, help="longest wait for recovery (default %(default)s)")
    p.add_argument("--out", type=Path, default=Path("bench/results/faults.json"), help="JSON output path")
    p.add_argument("graph_args", nargs="*", help="extra `dynamo serve` options after --")
    args = p.parse_args()
    faults = [f.strip() for f in args.faults.split(",")]
    unknown = [f for f in faults if f not in FAULTS]
    if unknown:
        p.error(f"unknown fault row(s) {unknown}; rows: {', '.join(FAULTS)}")
    device = "cuda" if "--Worker.device=cuda" in args.graph_args else "cpu"
    reference = engine_reference(PROMPTS, MAX_TOKENS, device=device)
    rows = []
    for f in faults:  # a row that breaks is recorded, and the others still run
        try:
            rows.append(run_row(f, args, reference))
        except Exception as e:
            rows.append({"fault": f, "error": f"{type(e).__name__}: {e}"})
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "operations"}), flush=True)
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
        "| fault | detected s | recovered s | failover downtime ms | replaced s | sent | completed | "
        "lost | wrong tokens | next /scale |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['fault']} | row failed: {r['error']} |")
            continue
        print(
            f"| {r['fault']} | {f(r['detected_s'])} | {f(r['recovered_s'])} | "
            f"{f(r['failover_downtime_ms'], '{:.1f}')} | {f(r['replaced_s'])} | {r['sent']} | {r['completed']} | "
            f"{r['lost']} | {r['wrong_tokens']} | {r['next_scale']} |"
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
