"""The post's experiment at this machine's scale: one request trace whose rate doubles, replayed
with aiperf on its fixed schedule against three deployments this harness starts, and the 30-second
rolling p95 time to first token of each against an SLO (a failed request counts as a 30 s TTFT):

- static: N ranks throughout;
- restart: N ranks, stopped when the ramp crosses `--restart-at` of its way and started again at
  N+k on the same ports (what a deployment that cannot grow in place does);
- elastic: N ranks with the planner on (`--Planner.min_dp=N --Planner.max_dp=N+k`), which grows it
  in place; joiners are restored from a snapshot baked first where CRIU can run (as root), cold
  otherwise (the JSON says which).

Dynamo's own planner would drive the elastic deployment through its virtual connector
(`--Planner.kind=dynamo`, tested with the runtime's coordinator in tests/test_planner_dynamo.py),
but `dynamo.planner` cannot be installed here (its `aisimulate` dependency downloads from outside
PyPI), so there is no row for it; the JSON says so.

Each trace row is a pre-built completions payload (token-id prompt, `max_tokens`, `ignore_eos`,
greedy), so every deployment sees the same requests whatever tokenizer aiperf loads. aiperf runs
from its own venv (`make bench-tools`: its prometheus-client pin conflicts with the project's), as
does the plot (matplotlib comes with it). Output: a table, JSON (`--out`) and a PNG (`--plot`).

    make bench-tools && .venv/bin/python -m bench.slo                 # CPU, built-in model

The defaults are this 2-core VM's (bench/results/slo_cpu.json): one rank at 4 -> 8 requests/s
misses a 1 s SLO near the end. A second EP rank there adds a process, not a core, so its steps
are slower, not its capacity larger: the CPU run shows the restart's gap and elastic growing
without a failed request, not elastic holding the SLO; that takes a GPU (or a core) per rank.
On one H200 (bench/results/slo_h200.json; two ranks side by side under MPS, joiners cold: a CUDA
snapshot cannot be restored under MPS), sized from one rank's 17.3 requests/s at this shape
(bench.serve --max-seqs 4 --concurrency 4 --isl 256 --osl 128):
    python -m bench.slo --device cuda --model DIR --dtype bfloat16 --max-seqs 4 --max-len 2048 --rate 9.5 \
        --isl 256 --osl 128 --slo-s 0.5 --no-snapshot
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from bench import aiperf
from bench.measure import write_results
from harness.server import Server

ROOT = Path(__file__).resolve().parents[1]
PENALTY_S = 30.0  # a failed request's TTFT, as in the post
DEPLOYMENTS = ("static", "restart", "elastic")
STARTED = "dynamo_frontend_requests_started_total"


def trace(seed: int, duration_s: float, rate0: float, rate1: float, isl: int, osl: int, vocab: int) -> list[dict]:
    """Arrivals of a Poisson process whose rate rises linearly from `rate0` to `rate1` requests/s
    over `duration_s` (thinning of a `rate1` process), prompt and output lengths as
    bench.aiperf.lengths draws them."""
    rng = random.Random(seed)
    rows, t = [], 0.0
    while True:
        t += rng.expovariate(rate1)
        if t >= duration_s:
            return rows
        if rng.random() > (rate0 + (rate1 - rate0) * t / duration_s) / rate1:
            continue
        rows.append(
            {"timestamp": round(t * 1000, 3), "payload": aiperf.payload(rng, *aiperf.lengths(rng, isl, osl), vocab)}
        )


def rolling_p95(reqs: list[dict], t0: float, window_s: float, step_s: float = 1.0) -> list[tuple[float, float]]:
    """(seconds since t0, p95 TTFT of the requests started in the window ending there), a failed
    request counting PENALTY_S."""
    ttfts = [(r["start"] - t0, PENALTY_S if r["error"] or r["ttft_s"] is None else r["ttft_s"]) for r in reqs]
    if not ttfts:
        return []
    end, pts, t = max(s for s, _ in ttfts), [], step_s
    while t <= end + step_s:
        w = sorted(v for s, v in ttfts if t - window_s < s <= t)
        if w:
            pts.append((t, w[min(len(w) - 1, math.ceil(0.95 * len(w)) - 1)]))
        t += step_s
    return pts


def pct(vals: list[float], q: float) -> float | None:
    vals = sorted(v for v in vals if v is not None)
    return vals[min(len(vals) - 1, math.ceil(q * len(vals)) - 1)] if vals else None


def summary(reqs: list[dict], t0: float, marks: list[dict], slo_s: float, window_s: float) -> dict:
    ok = [r for r in reqs if not r["error"]]
    # Before the first scale or restart mark, during (to the last), after.
    first = min((m["t"] for m in marks), default=None)
    last = max((m.get("t_end", m["t"]) for m in marks), default=None)

    def rate(a: float, b: float) -> float | None:
        got = [r for r in ok if a <= r["start"] - t0 < b]
        span = min(b, max((r["end"] - t0 for r in ok), default=a)) - a
        return sum(r["tokens"] for r in got) / span if got and span > 0 else None

    end = max((r["start"] - t0 for r in reqs), default=0.0)
    curve = rolling_p95(reqs, t0, window_s)
    return {
        "requests": len(reqs),
        "completed": len(ok),
        "failed": len(reqs) - len(ok),
        "errors": sorted({r["error"] for r in reqs if r["error"]}),
        **{f"ttft_p{q}_s": pct([r["ttft_s"] for r in ok], q / 100) for q in (50, 95, 99)},
        **{f"itl_p{q}_s": pct([r["itl_s"] for r in ok], q / 100) for q in (50, 95)},
        "tok_s_before": rate(0.0, first) if first is not None else rate(0.0, end),
        "tok_s_during": rate(first, last) if first is not None and last > first else None,
        "tok_s_after": rate(last, end + 1) if last is not None else None,
        "rolling_p95_max_s": max((v for _, v in curve), default=None),
        "seconds_over_slo": sum(1 for _, v in curve if v > slo_s),
        "rolling_p95": curve,
    }


def first_request(srv: Server, stop: threading.Event) -> float | None:
    """When the replay's first request reached the frontend (its request counter), unix time."""
    from components.planner.service import metric_sum, parse_prometheus

    while not stop.is_set():
        try:
            started = metric_sum(parse_prometheus(srv.http.get("/metrics", timeout=2).text), STARTED)
            if started:
                return time.time()
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    return None


def watch_operations(srv: Server, stop: threading.Event, marks: list[dict]) -> None:
    """Every scale operation the router ran, as a mark (its start, commit and end)."""
    seen = set()
    while not stop.wait(0.5):
        try:
            ops = srv.control("GET", "/operations", timeout=5).json()
        except (httpx.HTTPError, ValueError):
            continue
        for op in ops:
            if op["id"] in seen or op.get("total_s") is None:
                continue
            seen.add(op["id"])
            marks.append(
                {
                    "what": f"{op['kind']} {op['from_size']}->{op['to_size']} ({op['phase']})",
                    "abs_t": op["started_at"],
                    "abs_t_end": op["started_at"] + op["total_s"],
                    "downtime_s": op.get("downtime_s"),
                    "joined_from": op.get("joined_from", {}),
                }
            )


def serve_opts(args, n: int, planner: bool, snapshot_root: Path | None) -> list[str]:
    opts = [
        f"--Worker.dp_size={n}",
        f"--Worker.max_ranks={args.start + args.grow}",
        f"--Worker.max_seqs={args.max_seqs}",
        f"--Worker.device={args.device}",
        f"--Planner.enabled={'true' if planner else 'false'}",
        *([f"--Worker.model={args.model}"] if args.model else []),
        *([f"--Worker.dtype={args.dtype}"] if args.dtype else []),
        *([f"--Worker.max_len={args.max_len}"] if args.max_len else []),
        *([f"--Worker.snapshot_root={snapshot_root}"] if snapshot_root else []),
    ]
    if planner:
        opts += [
            f"--Planner.min_dp={args.start}",
            f"--Planner.max_dp={args.start + args.grow}",
            f"--Planner.step={args.grow}",
            f"--Planner.interval_s={args.planner_interval_s}",
            "--Planner.up_intervals=2",
            f"--Planner.ttft_p95_slo_s={args.slo_s / 2}",
            "--Planner.down_intervals=1000000",  # the experiment grows; shrinking is not its subject
        ]
    return opts + args.graph_args


def run(kind: str, args, rows: list[dict], tokenizer: Path, snapshot_root: Path | None, work: Path) -> dict:
    n, grown = args.start, args.start + args.grow
    srv = Server(serve_opts(args, n, kind == "elastic", snapshot_root if kind == "elastic" else None), model=None)
    marks: list[dict] = []
    stop = threading.Event()
    t0_box: list[float] = []
    servers = [srv]

    def restarter() -> None:
        t0 = first_request(srv, stop)
        if t0 is None:
            return
        t0_box.append(t0)
        if kind != "restart":
            return
        at = t0 + args.restart_at * args.duration_s
        while time.time() < at:
            if stop.wait(0.05):
                return
        mark = {"what": f"restart {n}->{grown}", "abs_t": time.time()}
        srv.stop()
        new = Server(serve_opts(args, grown, False, None), ports=(srv.http_port, srv.router_port), model=None)
        servers.append(new)
        mark["abs_t_end"] = time.time()
        marks.append(mark)

    watcher = threading.Thread(target=restarter, daemon=True)
    watcher.start()
    ops = threading.Thread(target=watch_operations, args=(srv, stop, marks), daemon=True)
    if kind == "elastic":
        ops.start()
    try:
        url = f"http://127.0.0.1:{srv.http_port}"
        records, _ = aiperf.replay(args.aiperf_cmd, url, srv.model, tokenizer, rows, work / kind, args.seed, PENALTY_S)
        time.sleep(1.0 if kind == "elastic" else 0.0)  # the last operation's record
    finally:
        stop.set()
        watcher.join(timeout=300)
        for s in servers:
            s.stop()
    reqs = aiperf.requests(records)
    t0 = t0_box[0] if t0_box else (reqs[0]["start"] if reqs else 0.0)
    for m in marks:
        m["t"], m["t_end"] = m.pop("abs_t") - t0, m.pop("abs_t_end") - t0
    return {"kind": kind, "marks": marks, **summary(reqs, t0, marks, args.slo_s, args.window_s)}


def bake_snapshot(args, work: Path) -> tuple[Path | None, str]:
    """A snapshot store holding one image for the elastic deployment's joiners, or why none."""
    if os.geteuid() != 0:
        return None, "not root: CRIU cannot dump or restore, joiners start cold"
    from snapshot.bake import bake

    root = work / "store"
    root.mkdir()
    try:
        bake(
            root / "snap",
            args.model or None,
            tier="criu",
            device=args.device,
            dtype=args.dtype,
            max_ranks=args.start + args.grow,
            max_len=args.max_len,
            max_seqs=args.max_seqs,
            progress=True,
        )
    except Exception as e:  # reported, and the joiners start cold
        return None, f"bake failed: {e}"
    return root, "joiners restored from a CRIU snapshot"


def table(rows: list[dict], slo_s: float) -> str:
    def f(v, fmt="{:.3f}"):
        return "-" if v is None else fmt.format(v)

    head = (
        "| deployment | requests | completed | failed | TTFT p50 / p95 / p99 s | ITL p50 / p95 s | "
        f"tok/s before / during / after | rolling p95 max s | s over {slo_s:g} s SLO | events |"
    )
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        ev = "; ".join(f"{m['what']} at {m['t']:.1f}-{m['t_end']:.1f} s" for m in r["marks"]) or "-"
        lines.append(
            f"| {r['kind']} | {r['requests']} | {r['completed']} | {r['failed']} | "
            f"{f(r['ttft_p50_s'])} / {f(r['ttft_p95_s'])} / {f(r['ttft_p99_s'])} | "
            f"{f(r['itl_p50_s'], '{:.4f}')} / {f(r['itl_p95_s'], '{:.4f}')} | "
            f"{f(r['tok_s_before'], '{:.0f}')} / {f(r['tok_s_during'], '{:.0f}')} / {f(r['tok_s_after'], '{:.0f}')} | "
            f"{f(r['rolling_p95_max_s'])} | {r['seconds_over_slo']} | {ev} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    aiperf.add_args(p)
    p.add_argument("--start", type=int, default=1, help="N: ranks at the start (default 1)")
    p.add_argument("--grow", type=int, default=1, help="k: ranks the restart and the planner add (default 1)")
    p.add_argument("--max-seqs", type=int, default=2, help="Worker.max_seqs, each rank's batch (default 2)")
    p.add_argument("--max-len", type=int, default=1024, help="Worker.max_len (default 1024)")
    p.add_argument("--rate", type=float, default=4.0, help="requests/s at the start; the ramp doubles it (default 4)")
    p.add_argument("--duration-s", type=float, default=60.0, help="length of the trace (default 60 s)")
    p.add_argument("--isl", type=int, default=32, help="mean prompt tokens (default 32)")
    p.add_argument("--osl", type=int, default=16, help="mean output tokens (default 16)")
    p.add_argument("--slo-s", type=float, default=1.0, help="the TTFT SLO the plot draws (default 1 s)")
    p.add_argument(
        "--window-s",
        type=float,
        default=15.0,
        help="rolling p95 window (default 15 s; the post's 30 s over a longer trace)",
    )
    p.add_argument("--restart-at", type=float, default=0.4, help="share of the ramp where the restart begins")
    p.add_argument("--planner-interval-s", type=float, default=2.0, help="Planner.interval_s (default 2)")
    p.add_argument("--deployments", default=",".join(DEPLOYMENTS), help="which to run, in order")
    p.add_argument("--no-snapshot", action="store_true", help="elastic joiners start cold")
    p.add_argument("--out", type=Path, default=None, help="JSON (default bench/results/slo_{cpu,cuda}.json)")
    p.add_argument("--plot", type=Path, default=None, help="PNG (default beside the JSON)")
    p.add_argument("graph_args", nargs="*", help="more `dynamo serve` options, after --")
    args = p.parse_args()
    kinds = [k for k in args.deployments.split(",") if k]
    bad = [k for k in kinds if k not in DEPLOYMENTS]
    if bad or not kinds:
        p.error(f"--deployments: {', '.join(bad) or 'none given'} (choose from {', '.join(DEPLOYMENTS)})")
    args.aiperf_cmd = aiperf.command(args.aiperf)
    out = args.out or ROOT / "bench" / "results" / f"slo_{args.device}.json"
    plot = args.plot or out.with_suffix(".png")

    from components.engine.models.builtin import builtin_model_dir
    from components.engine.models.registry import read_config

    model_dir = Path(args.model) if args.model else builtin_model_dir()
    vocab = read_config(model_dir / "config.json").vocab_size
    rows = trace(args.seed, args.duration_s, args.rate, 2 * args.rate, args.isl, args.osl, vocab)
    work = Path(tempfile.mkdtemp(prefix="bench-slo-"))
    try:
        snap_root, snap_why = (None, "--no-snapshot") if args.no_snapshot else (None, "")
        if "elastic" in kinds and not args.no_snapshot:
            snap_root, snap_why = bake_snapshot(args, work)
        results = []
        for kind in kinds:
            print(f"== {kind}: {len(rows)} requests over {args.duration_s:.0f} s", file=sys.stderr)
            results.append(run(kind, args, json.loads(json.dumps(rows)), model_dir, snap_root, work))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = {
        "command": " ".join([sys.executable, "-m", "bench.slo", *sys.argv[1:]]),
        "trace": {
            "requests": len(rows),
            "seed": args.seed,
            "duration_s": args.duration_s,
            "rate_from": args.rate,
            "rate_to": 2 * args.rate,
            "isl_mean": args.isl,
            "osl_mean": args.osl,
        },
        "deployment": {"start": args.start, "grow": args.grow, "max_seqs": args.max_seqs, "device": args.device},
        "slo_s": args.slo_s,
        "window_s": args.window_s,
        "penalty_s": PENALTY_S,
        "elastic_joiners": snap_why,
        "dynamo_planner": "not run: dynamo.planner cannot be installed here (aisimulate downloads from outside "
        "PyPI); Planner.kind=dynamo is exercised with the runtime's VirtualConnectorCoordinator in "
        "tests/test_planner_dynamo.py",
        "deployments": results,
    }
    write_results(out, result)
    print(table(results, args.slo_s))
    # matplotlib comes with make bench-tools' venv; elsewhere (the GPU machine) plot the JSON later.
    py = aiperf.VENV / "python" if (aiperf.VENV / "python").is_file() else Path(sys.executable)
    r = subprocess.run([str(py), "-m", "bench.slo_plot", str(out), str(plot)], cwd=ROOT)
    print(
        f"wrote {plot}" if r.returncode == 0 else f"the plot failed (exit {r.returncode}): bench.slo_plot {out} {plot}"
    )


if __name__ == "__main__":
    main()
