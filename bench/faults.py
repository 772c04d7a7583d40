"""Fault matrix: `dynamo serve graphs/elastic:Frontend` (defaults but the planner, off so the sizes
stay the benchmark's, except in the planner's own row) at 3 ranks under streaming greedy clients,
one fault per row, each on a fresh graph.

Rows:
  serving rank killed / stalled   SIGKILL / SIGSTOP of rank 1 while it serves
  serving rank killed (4 slots)   the same with 4 expert slots per rank (min_ranks 2): 2 of the 8
                                  experts only rank 1 holds, the survivors load them from disk
  serving rank killed (replicas)  ... and 6 slots (4 redundant experts): every expert rank 1 holds
                                  has a replica on a survivor, nothing is read from disk
  serving rank killed mid scale-up
                                  SIGKILL of rank 1 while a scale-up 3 -> 4's joiner warms up
  source rank killed mid pull     SIGKILL of rank 1 while a scale-up 3 -> 4's joiner pulls its
                                  weights from ranks 0-2 (the joiner holds its reads back 1 s,
                                  injected, so they meet a dead source): the scale-up masks rank 1
                                  out itself, re-pulls its reads from ranks 0 and 2 and ends done
                                  (recovered: its own failover's commit); a scale-up replaces rank 1
  leaving rank killed             SIGKILL of rank 2 while a scale-down 3 -> 2 drains it
  every serving rank killed       SIGKILL of ranks 0, 1 and 2, 0.5 s apart: no serving rank is left
                                  (/health 503, completions 503 with the reason) until the router
                                  has rebuilt the deployment at 3 ranks from new processes loading
                                  the checkpoint ("recovered": that rebuild's commit); the clients
                                  pause 0.25 s after a failed request, which counts as lost
  parked rank killed, then scale-up
                                  scale 3 -> 2 (rank 2 parks), SIGKILL of parked rank 2: dropped
                                  from the topology ("detected"), and a scale-up to 3 starts a new
                                  process for it ("recovered": its commit)
  joiner killed in starting / pull / warmup / connecting / committing
                                  a scale-up 3 -> 4 whose joiner dies on the command sent as the
                                  operation enters that phase (injected: the joiner exits on it):
                                  describe / pull_weights / warmup / connect / configure; before
                                  the commit a new joiner is started and the scale-up ends done,
                                  in the commit it rolls back
  router killed                   SIGKILL of the router (`dynamo serve` restarts it; it adopts)
  router killed mid scale-up      the same while a scale-up 3 -> 4 starts its joiner
  router stalled                  SIGSTOP of the router past its liveness deadline, then SIGCONT
                                  (`dynamo serve` finds it hung, kills and restarts it; it adopts)
  corrupt snapshot                a scale-up 3 -> 4 whose only snapshot to restore the joiner from
                                  (criu tier, baked for the row) has one byte of an image flipped:
                                  refused with the reason in the record, the joiner cold-starts
  planner killed                  SIGKILL of the planner (not critical: the rest serves on)

Per row: when the fault was taken up (detected), when the deployment was whole again (recovered:
a failover's commit, an aborted scale-up's end, the restarted router's adoption; a joiner's fault
is timed from its exit), when a failed serving rank's replacement served (back at the starting
size), requests sent / completed / lost, and completions whose tokens differ from the single-rank
reference engine. Every row ends with a scale request that must succeed (no wedge). Prints a
table and writes JSON (`--out`).

    python -m bench.faults                       # every row, CPU, bench/results/faults.json
    python -m bench.faults --faults "router killed" -- --Worker.device=cuda
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import httpx

from bench.measure import write_results
from harness.server import Server, Traffic, engine_reference, failure_reasons, scale
from harness.tamper import flip_byte, largest

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
            try:  # the router's verdict; a failover may wait for the operation in flight to end
                found = log_time(srv, rf"rank {rank} failed: ")
            except AssertionError:  # a restarted router failed it over while adopting
                found = fo["started_at"]
            return {
                "detected_s": found - t_fault,
                "recovered_s": fo["committed_at"] - t_fault if fo["committed_at"] else None,
                "failover_downtime_ms": fo["downtime_s"] * 1e3 if fo["downtime_s"] is not None else None,
                "experts_from_disk": fo["experts_from_disk"],
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


def kill_rank_mid_scale_up(
    srv: Server, args, command: str, stall_s: float, rank: int = 1, size: int = 4
) -> tuple[set[str], float]:
    """Scale up to `size` with joiners that hold `command` back `stall_s` (injected); SIGKILL
    `rank` as a joiner starts to hold it. Returns the operations before and when it was killed."""
    before, pid, seen = op_ids(srv), rank_pid(srv, rank), len(srv.output)
    r = srv.control("POST", "/scale", json={"dp_size": size, "fault": f"stall_on={command},stall_s={stall_s}"})
    assert r.status_code == 202, r.text
    deadline = time.monotonic() + args.timeout_s
    while f"injected fault: stalling {command}" not in srv.output[seen:]:
        assert time.monotonic() < deadline, srv.tail(60)
        time.sleep(0.02)
    t = time.time()
    os.kill(pid, signal.SIGKILL)
    return before, t


def serving_rank_killed_mid_scale_up(srv: Server, args) -> dict:
    """Rank 1 killed while a scale-up 3 -> 4's joiner warms up alone (held back 5 s): the
    scale-up gives way (aborts), the failover of rank 1 runs, then the scale-up runs again (to
    4, replacing rank 1 too: "replaced")."""
    before, t = kill_rank_mid_scale_up(srv, args, "warmup", 5.0)
    measured = wait_failover(srv, 1, before, t, args.timeout_s)
    up = next(op for op in measured["operations"] if op["kind"] == "up")
    measured["scale_up"] = f"{up['phase']} in {list(up['phases'])[-1]}: {up['error']}"
    return measured


def source_killed_mid_pull(srv: Server, args) -> dict:
    """Rank 1 killed while a scale-up 3 -> 4's joiner holds back its pull (1 s), rank 1 among the
    ranks it reads from: the scale-up masks rank 1 out itself ("recovered": that commit) and
    re-pulls what rank 1 was to send from the survivors, and ends done; a scale-up then replaces
    rank 1 ("replaced"). Detected: the router's verdict on rank 1."""
    before, t = kill_rank_mid_scale_up(srv, args, "pull_weights", 1.0)
    deadline = time.monotonic() + args.timeout_s
    ops = new_ops(srv, before)
    while time.monotonic() < deadline:
        ops = new_ops(srv, before)
        if len(ops) >= 2 and ops[-1]["total_s"] is not None and not srv.topology()["scaling"]:
            break
        time.sleep(0.2)
    else:
        return {"operations": ops}
    up, last = ops[0], ops[-1]
    repulled = sorted({int(r) for loss in up["pull_losses"] for r in loss["repulled_from"]})
    tensors = sum(len(names) for loss in up["pull_losses"] for names in loss["repulled_from"].values())
    return {
        # The router's verdict, or the scale-up's own (its provider saw the process die first).
        "detected_s": log_time(srv, r"rank 1 failed: |-> masking \(.*\): ranks \[1\] failed") - t,
        "recovered_s": up["failover_committed_at"] - t if up["failover_committed_at"] else None,
        "failover_downtime_ms": up["failover_downtime_s"] * 1e3 if up["failover_downtime_s"] is not None else None,
        "replaced_s": last["committed_at"] - t if last["kind"] == "up" and last["committed_at"] else None,
        "scale_up": f"{up['phase']}, masked {up['masked']}, {tensors} tensors re-pulled from ranks "
        f"{repulled}{': ' + up['error'] if up['error'] else ''}",
        "operations": ops,
    }


def kill_leaving_rank(srv: Server, args, size: int) -> tuple[set[str], float, int]:
    """Scale down by one with a long drain; SIGKILL the leaving rank (the highest) once it is out
    of routing and draining. Returns the operations before, when it was killed and its rank."""
    rank = max(srv.topology()["active"])
    before, pid = op_ids(srv), rank_pid(srv, rank)
    r = srv.control("POST", "/scale", json={"dp_size": size - 1, "drain_timeout": 30})
    assert r.status_code == 202, r.text
    deadline = time.monotonic() + args.timeout_s
    while time.monotonic() < deadline:
        if next(v["state"] for v in srv.topology()["ranks"] if v["rank"] == rank) == "LEAVING":
            break
        time.sleep(0.01)
    t = time.time()
    os.kill(pid, signal.SIGKILL)
    return before, t, rank


def leaving_rank_killed(srv: Server, args) -> dict:
    """Scale 3 -> 2 with a long drain; SIGKILL rank 2 once it is out of routing and draining."""
    before, t, rank = kill_leaving_rank(srv, args, 3)
    return wait_failover(srv, rank, before, t, args.timeout_s)


def every_serving_rank_killed(srv: Server, args) -> dict:
    """SIGKILL every serving rank, 0.5 s apart. Detected: the router's verdict that none is left;
    recovered: the rebuild's commit (serving again at the size before)."""
    before, size = op_ids(srv), srv.topology()["dp_size"]
    victims = [rank_pid(srv, r) for r in srv.topology()["active"]]
    t = time.time()
    for i, pid in enumerate(victims):
        if i:
            time.sleep(0.5)
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + args.timeout_s
    ops = new_ops(srv, before)
    while time.monotonic() < deadline:
        ops = new_ops(srv, before)
        done = [op for op in ops if op["kind"] == "rebuild" and op["phase"] == "done"]
        if done and not srv.topology()["scaling"]:
            break
        time.sleep(0.2)
    else:
        return {"operations": ops}
    rebuild = done[-1]
    return {
        "detected_s": log_time(srv, r"every serving rank failed") - t,
        "recovered_s": rebuild["committed_at"] - t,
        "replaced_s": rebuild["committed_at"] - t,
        "rebuild": f"{rebuild['id']}: {rebuild['to_size']} of {size} ranks, joined_from {rebuild['joined_from']}, "
        f"{len(ops)} operations",
        "operations": ops,
    }


def parked_rank_killed(srv: Server, args) -> dict:
    """Scale 3 -> 2 (rank 2 parks), SIGKILL the parked rank 2, then scale up to 3. Detected: the
    router dropped it; recovered: the scale-up's commit, a new process for rank 2."""
    before = op_ids(srv)
    down = scale(srv, 2)
    assert down["parked"] == [2], down
    t = time.time()
    os.kill(rank_pid(srv, 2), signal.SIGKILL)
    deadline = time.monotonic() + args.timeout_s
    while time.monotonic() < deadline and any(r["rank"] == 2 for r in srv.topology()["ranks"]):
        time.sleep(0.05)
    detected = log_time(srv, r"rank 2 \(parked, pid \d+\) died: dropped") - t
    up = scale(srv, 3)
    return {
        "detected_s": detected,
        "recovered_s": up["committed_at"] - t if up["committed_at"] else None,
        "scale_up": f"{up['phase']}: joined_from {up['joined_from']}",
        "operations": new_ops(srv, before),
    }


# Row name -> the command a joiner is sent in that phase (`exit_on` makes it exit there): starting
# ends with the router asking new instances which rank they are; committing's Configure reaches
# the serving ranks too (paused, some already on the new epoch), so the commit rolls back.
JOINER_PHASES = {
    "starting": "describe",
    "pull": "pull_weights",
    "warmup": "warmup",
    "connecting": "connect",
    "committing": "configure",
}


def joiner_killed(command: str) -> Callable[[Server, argparse.Namespace], dict]:
    """Scale 3 -> 4; the joiner exits on `command` (its fault, injected through the router).
    Timed from the joiner's exit (its last log line): detected when the operation began to abort
    or roll back, recovered when that was over."""

    def run(srv: Server, args) -> dict:
        before = op_ids(srv)
        rec = scale(srv, 4, fault=f"exit_on={command}")
        t = log_time(srv, rf"rank \d+: injected fault: exiting on {command}$")
        op = re.escape(rec["id"])
        caught = log_time(srv, rf"\[op {op}\] (aborting in|rolling back|joiner \d+ died during)")
        retried = [f"rank {r['rank']} in {r['phase']}" for r in rec["joiner_retries"]]
        return {
            "detected_s": caught - t,
            "recovered_s": ended(rec) - t,
            "outcome": f"{rec['phase']}"
            + (f", new joiner after {retried}" if retried else "")
            + (f" in {list(rec['phases'])[-1]}: {rec['error']}" if rec["error"] else ""),
            "operations": new_ops(srv, before),
        }

    return run


LOG_TIME = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \w+ [\w.]+: (.*)$")


def log_time(srv: Server, message: str, after: float | None = None) -> float:
    """When a component last logged a line whose message matches `message` (unix time; Python
    logging writes local time); with `after`, the first such line from that time on."""
    lines = srv.output.splitlines()
    for line in lines if after is not None else reversed(lines):
        m = LOG_TIME.search(line)
        if m and re.search(message, m.group(2)):
            t = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            if after is None or t >= after - 0.001:  # the log's clock has milliseconds
                return t
    raise AssertionError(f"no log line matches {message!r}")


def router_pids(srv: Server) -> list[int]:
    return [int(p) for p in re.findall(r"started Router \(pid (\d+)", srv.output)]


def router_fault(sig: int, during_scale_up: bool = False) -> Callable[[Server, argparse.Namespace], dict]:
    """SIGKILL the router, serving; or while a scale-up 3 -> 4 is starting its joiner, which the
    restarted router then finds mid-operation and stops (the scale-up is lost with the router).
    SIGSTOP it past its liveness deadline (Router.liveness_timeout_s), then SIGCONT: `dynamo serve`
    finds it hung, kills it and starts another. Detected: the next router started (killed), or the
    stalled one found hung; recovered: the next one adopted what the ranks serve."""

    def run(srv: Server, args) -> dict:
        before, topo, old = op_ids(srv), srv.topology(), router_pids(srv)[-1]
        if during_scale_up:
            r = srv.control("POST", "/scale", json={"dp_size": 4})
            assert r.status_code == 202, r.text
            deadline = time.monotonic() + args.timeout_s
            while time.monotonic() < deadline and not any(v["rank"] == 3 for v in srv.topology()["ranks"]):
                time.sleep(0.05)
        t = time.time()
        os.kill(old, sig)
        hung = f"Router (pid {old}) did not answer"
        detected = recovered = None
        deadline = time.monotonic() + args.timeout_s
        while time.monotonic() < deadline and recovered is None:
            if detected is None and (hung in srv.output if sig == signal.SIGSTOP else router_pids(srv)[-1] != old):
                detected = time.time() - t
            if router_pids(srv)[-1] != old:
                try:
                    if srv.control("GET", "/health").status_code == 200:
                        recovered = time.time() - t  # it adopted what the ranks serve
                except httpx.HTTPError:
                    pass
            time.sleep(0.05)
        if sig == signal.SIGSTOP:
            try:
                os.kill(old, signal.SIGCONT)  # too late: it was killed
            except ProcessLookupError:
                pass
        after = srv.topology()
        adopted = re.findall(r"components\.control\.router: (adopted epoch .*)", srv.output)
        ops = new_ops(srv, before)  # the history outlives the router (its journal)
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
            "interrupted": [f"{op['id']}: {op['error']}" for op in ops if op["phase"] == "interrupted"],
            "operations": ops,
        }

    return run


def corrupt_snapshot_root(args) -> list[str]:
    """A snapshot store holding one criu-tier image baked for this deployment, one byte of its
    largest memory-pages file flipped (the way tests/test_snapshot_flow.py tampers one)."""
    from snapshot.bake import IMAGE_DIR, bake

    root = Path(tempfile.mkdtemp(prefix="faults-snapshots-"))
    device = "cuda" if "--Worker.device=cuda" in args.graph_args else "cpu"
    snap, manifest = bake(root / "corrupt", device=device, tier="criu", progress=False)
    flip_byte(snap / largest(snap, manifest.files, f"{IMAGE_DIR}/pages-"), 4096)
    args.snapshot_root = root  # removed once the row scaled up
    return [f"--Worker.snapshot_root={root}"]


def corrupt_snapshot(srv: Server, args) -> dict:
    """Scale 3 -> 4 with only a corrupt image to restore the joiner from: refused (the reason in
    the operation's record), the joiner cold-starts and serves. Detected: the refusal, from the
    operation's start; recovered: the joiner serving (the commit)."""
    before = op_ids(srv)
    rec = scale(srv, 4)
    shutil.rmtree(args.snapshot_root, ignore_errors=True)
    refused = log_time(srv, rf"\[op {re.escape(rec['id'])}\] no snapshot to restore joiners from")
    return {
        "detected_s": refused - rec["started_at"],
        "recovered_s": rec["committed_at"] - rec["started_at"] if rec["committed_at"] else None,
        "scale_up": f"{rec['phase']}: joined_from {rec['joined_from']}",
        "snapshot_refused": rec["snapshot_refused"],
        "operations": new_ops(srv, before),
    }


def planner_killed(srv: Server, args) -> dict:
    pid = int(re.findall(r"started Planner \(pid (\d+)", srv.output)[-1])
    t = time.time()
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + args.timeout_s
    while time.monotonic() < deadline and f"component Planner (pid {pid})" not in srv.output:
        time.sleep(0.05)
    # Not critical: reported, and the rest serves on at its size (scaling by hand only from here).
    return {"detected_s": time.time() - t, "recovered_s": None, "note": "not restarted; nothing else affected"}


FAULTS: dict[
    str, tuple[Callable[[Server, argparse.Namespace], dict], list[str] | Callable[[argparse.Namespace], list[str]]]
] = {
    # row: (injection and measurement, graph options it needs)
    "serving rank killed": (serving_rank(signal.SIGKILL), []),
    "serving rank stalled": (serving_rank(signal.SIGSTOP), []),
    "serving rank killed (4 slots)": (serving_rank(signal.SIGKILL), ["--Worker.min_ranks=2"]),
    "serving rank killed (replicas)": (
        serving_rank(signal.SIGKILL),
        ["--Worker.min_ranks=2", "--Worker.redundant_experts=4"],
    ),
    "serving rank killed mid scale-up": (serving_rank_killed_mid_scale_up, ["--Router.allow_fault_injection=true"]),
    "source rank killed mid pull": (source_killed_mid_pull, ["--Router.allow_fault_injection=true"]),
    "leaving rank killed": (leaving_rank_killed, []),
    "every serving rank killed": (every_serving_rank_killed, []),
    "parked rank killed, then scale-up": (parked_rank_killed, []),
    **{
        f"joiner killed in {row}": (joiner_killed(c), ["--Router.allow_fault_injection=true"])
        for row, c in JOINER_PHASES.items()
    },
    "router killed": (router_fault(signal.SIGKILL), []),
    "router killed mid scale-up": (router_fault(signal.SIGKILL, during_scale_up=True), []),
    "router stalled": (router_fault(signal.SIGSTOP), []),
    # Its graph options are made for it: a snapshot store with a corrupt image.
    "corrupt snapshot": (corrupt_snapshot, corrupt_snapshot_root),
    # The planner's own row runs it; it is asked to keep the size (min_dp = max_dp = 3).
    "planner killed": (planner_killed, ["--Planner.enabled=true", "--Planner.min_dp=3", "--Planner.max_dp=3"]),
}


def run_row(fault: str, args, reference: list[str]) -> dict:
    inject, options = FAULTS[fault]
    if callable(options):
        options = options(args)
    srv = Server(
        ["--Worker.dp_size=3", "--Worker.max_ranks=4", "--Planner.enabled=false", *options, *args.graph_args],
        boot_timeout_s=600,
        model=None,
    )
    try:
        with Traffic(srv, PROMPTS, MAX_TOKENS, clients=args.clients, error_pause_s=0.25) as traffic:
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
            "experts_from_disk": measured.get("experts_from_disk"),
            "replaced_s": measured.get("replaced_s"),
            "sent": len(traffic.results) + len(traffic.errors),
            "completed": len(traffic.results),
            "lost": len(traffic.errors),
            "wrong_tokens": wrong,
            "next_scale": next_scale,
            **{k: v for k, v in measured.items() if k not in ROW_KEYS},
            "failure_reasons": failure_reasons(traffic.errors),
        }
    finally:
        srv.stop()


ROW_KEYS = ("detected_s", "recovered_s", "failover_downtime_ms", "experts_from_disk", "replaced_s")


def row_names(text: str) -> tuple[list[str], list[str]]:
    """The rows a comma-separated list names (a row's own name may hold a comma), and what names none."""
    rows, unknown, part = [], [], ""
    for piece in text.split(","):
        part = f"{part},{piece}" if part else piece
        if part.strip() in FAULTS:
            rows.append(part.strip())
            part = ""
    if part.strip():
        unknown.append(part.strip())
    return rows, unknown


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
    faults, unknown = row_names(args.faults)
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
    write_results(args.out, {"command": " ".join(["python -m bench.faults", *sys.argv[1:]]), "rows": rows})

    def f(v, fmt="{:.2f}"):
        return "-" if v is None else fmt.format(v)

    print(
        "options that differ from `dynamo serve graphs/elastic:Frontend`'s defaults: --Planner.enabled=false "
        "--Worker.dp_size=3 " + " ".join(args.graph_args)
    )
    print(
        "| fault | detected s | recovered s | failover downtime ms | experts from disk | replaced s | sent | "
        "completed | lost | wrong tokens | next /scale |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['fault']} | row failed: {r['error']} |")
            continue
        print(
            f"| {r['fault']} | {f(r['detected_s'])} | {f(r['recovered_s'])} | "
            f"{f(r['failover_downtime_ms'], '{:.1f}')} | {f(r['experts_from_disk'], '{}')} | {f(r['replaced_s'])} | "
            f"{r['sent']} | {r['completed']} | "
            f"{r['lost']} | {r['wrong_tokens']} | {r['next_scale']} |"
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
