"""Join time: a joiner restored from a snapshot's CRIU image beside a cold and a parked joiner, by phase.

Bakes a criu-tier snapshot of the deployment's worker (`snapshot-bake bake`, timed), serves the
graph (`dynamo serve graphs/elastic:Frontend`, options after `--`) at one rank with an empty
snapshot store and scales 1 -> 2 (rank 1 starts cold), then serves it again with the snapshot in
the store, as a user would (the router chooses it and verifies its checksums as it starts), and
scales 1 -> 2 (rank 1 is restored from it), 2 -> 1 (rank 1 parks: a warm process) and 1 -> 2
(rank 1 unparks); then once more with `Router.standby_copies=1`, where the joiner is a copy the
router restored before the scale-up (CUDA: its CUDA state is restored in the scale-up), and on CUDA
with `Router.checkpoint_parked=true` 2 -> 1 and 1 -> 2 again: a parked joiner whose CUDA state was
checkpointed while parked (it held no GPU memory). Per join: the
operation's phases from the router's record, "starting" being the joiner's process start (or
restore) until it registered, and its total, start to serving (routable). After each join,
greedy completions must equal the first ones seen.
`--device cuda`: the snapshot is baked on the GPU (VMM arena released, CUDA-checkpointed) and the
deployment runs there (Worker.vmm on); each join's steps (CRIU restore, CUDA restore and unlock,
arena remap, weight pull) are read from the graph's log. Each join also has a timeline from the log's
timestamps: when, after its operation started, the joiner's process was up (or restored), its
NIXL agents were up, it registered, and the router found it, which is what "starting" is made of.
Results: a table and bench/results/join.json (join_cuda.json on CUDA; `--out`).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

from bench.measure import write_results
from harness.server import Server, scale

PHASES = ["starting", "loading", "warming", "connecting", "committing"]
# What a joiner's "starting" and "loading" are made of, from the graph's log.
STEPS = {
    "criu_restore": r"Worker\.{rank}: criu restore took ([0-9.]+) s",
    "cuda_restore": r"Worker\.{rank}:? CUDA state restored in ([0-9.]+) s",
    "cuda_unlock": r"Worker\.{rank}: CUDA state restored in [0-9.]+ s, unlocked in ([0-9.]+) s",
    "arena_remap": r"rank {rank}: VMM arena remapped in ([0-9.]+) s",
    "ep_agent": r"ep-{rank}-\w+: NIXL agent up in ([0-9.]+)s",
    "weights_agent": r"weights-{rank}-[\w-]+: NIXL agent up in ([0-9.]+)s",
    "weight_pull": r"rank {rank}: pulled \d+ tensors, [0-9.]+ MB in ([0-9.]+) s",
    # ... of which: the sources' metadata, the copies or READs (mapping peers' memory and copying
    # from it included), and the checksums still running after them
    "pull_setup": r"rank {rank}: pulled .*; setup ([0-9.]+) s",
    "pull_transfer": r"rank {rank}: pulled .* transfer ([0-9.]+) s",
    "pull_mapping": r"rank {rank}: pulled .* mapping peers ([0-9.]+) s",
    "pull_copying": r"rank {rank}: pulled .* copying ([0-9.]+) s",
    "pull_verify": r"rank {rank}: pulled .* verify ([0-9.]+) s",
}
# What the joiner pulled, in MB: with the pull's seconds, its rate.
PULLED = {"pull_mb": r"rank {rank}: pulled \d+ tensors, ([0-9.]+) MB"}
# Moments of a join, from its operation's start (the first line of each found after it).
TIMELINE = {
    "restored": r"\[op {op}\] Worker\.{rank}: criu restore took",
    "cuda_restored": r"\[op {op}\] Worker\.{rank}: CUDA state restored in",
    "process_up": r"\[op {op}\] rank {rank}: (?:joiner up|BOOTING -> RESTORED)",
    "agents_up": r"weights-{rank}-[\w-]+: NIXL agent up",
    "registered": r"\[op {op}\] rank {rank}: serving .* waiting for the router",
    "found_by_router": r"found rank {rank} \(",
    "loading": r"\[op {op}\] starting -> loading",
}
STAMP = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def join_steps(log: str, rank: int, op: str, steps: dict[str, str] = STEPS) -> dict[str, float]:
    """Seconds of each step of `steps` the log shows for `rank` from operation `op`'s start on."""
    start = log.find(f"[op {op}] queued -> ")
    out = {}
    for step, pattern in steps.items():
        found = re.search(pattern.format(rank=rank), log[max(start, 0) :])
        if found:
            out[step] = float(found.group(1))
    return out


def timeline(log: str, rank: int, op: str) -> dict[str, float]:
    """Seconds from operation `op`'s start to each moment of TIMELINE the log shows for `rank`."""

    def stamp(line: str) -> float | None:
        m = STAMP.search(line)
        return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() if m else None

    lines = log.splitlines()
    start = next((i for i, line in enumerate(lines) if f"[op {op}] queued -> " in line), None)
    t0 = stamp(lines[start]) if start is not None else None
    if t0 is None:
        return {}
    out = {}
    for moment, pattern in TIMELINE.items():
        rx = re.compile(pattern.format(rank=rank, op=re.escape(op)))
        at = next((stamp(line) for line in lines[start:] if rx.search(line)), None)
        if at is not None:
            out[moment] = round(at - t0, 3)
    return out


PROMPTS = [[5 + i, 17, 42 + i, 99, 7 * i + 3, 250] for i in range(4)]


def join(
    opts: list[str], max_tokens: int, restored: bool, park: bool = False, standby: int = 0, checkpoint: bool = False
) -> list[dict]:
    """Serve one rank, scale 1 -> 2: the join's row (`restored`: once the router has chosen the
    snapshot to restore joiners from, and restored `standby` copies of it ahead). With `park`,
    then 2 -> 1 (rank 1 parks; CUDA-checkpointed with `checkpoint`) and 1 -> 2 again: a parked
    joiner's row too."""
    checkpoint = checkpoint or "--Router.checkpoint_parked=true" in opts  # or the user asked for it after --
    extra = [f"--Router.standby_copies={standby}", *(["--Router.checkpoint_parked=true"] if checkpoint else [])]
    srv = Server([*opts, *extra], boot_timeout_s=600, model=None)
    try:
        deadline = time.monotonic() + 600
        while restored and not (
            (snap := srv.topology()["snapshot"])["state"] == "chosen" and snap["standby"] >= standby
        ):
            if snap["state"] == "none":  # a snapshot baked for another configuration: say so, do not wait
                raise SystemExit(f"the router will not restore joiners from the baked snapshot: {snap['why']}")
            if time.monotonic() > deadline:
                raise SystemExit(f"the router did not choose a snapshot within 600 s:\n{srv.tail(40)}")
            time.sleep(0.1)
        first = [srv.stream_text(q, max_tokens) for q in PROMPTS]

        def to(n: int) -> dict:
            op = scale(srv, n)
            if op["phase"] != "done":
                raise SystemExit(f"scale to {n} failed: {op}")
            return op

        rows = []
        for _ in range(2 if park else 1):
            op = to(2)
            joiner = op["joined_from"]["1"]
            if standby and not rows:
                joiner = "standby copy"
            elif joiner == "parked" and checkpoint:
                joiner = "parked, CUDA-checkpointed"
            rows.append(
                {
                    "joined_from": op["joined_from"]["1"],
                    "joiner": joiner,
                    "scale": "1 -> 2",
                    "phases": {k: op["phases"].get(k, 0.0) for k in PHASES},
                    "total_s": op["total_s"],
                    "steps": join_steps(srv.output, 1, op["id"]),
                    "pulled_mb": join_steps(srv.output, 1, op["id"], PULLED).get("pull_mb"),
                    "timeline": timeline(srv.output, 1, op["id"]),
                    "snapshot_refused": op["snapshot_refused"],
                    "greedy_equal": [srv.stream_text(q, max_tokens) for q in PROMPTS] == first,
                }
            )
            if park and len(rows) == 1 and to(1)["parked"] != [1]:
                raise SystemExit("rank 1 did not park on 2 -> 1 (Router.park_leaving=false?)")
        return rows
    finally:
        srv.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-ranks", type=int, default=4, help="Worker.max_ranks, baked and served (default: 4)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="Worker.device, baked and served")
    p.add_argument(
        "--max-len",
        type=int,
        default=1024,
        help="Worker.max_len, baked and served (given: not computed from free memory, which differs "
        "between the baker and the router; default: %(default)s)",
    )
    p.add_argument("--max-seqs", type=int, default=None, help="Worker.max_seqs, baked and served")
    p.add_argument("--model", default="", help="Worker.model, baked and served (default: the built-in model)")
    p.add_argument("--dtype", default="", help="Worker.dtype, baked and served (default: the checkpoint's)")
    p.add_argument("--out", type=Path, default=None, help="default bench/results/join.json (join_cuda.json on cuda)")
    p.add_argument(
        "graph_args",
        nargs="*",
        help="more `dynamo serve` options (after --), e.g. --Router.prepare_timeout_s=300; not the worker's "
        "options a snapshot records (the options above are baked and served alike)",
    )
    args = p.parse_args()
    from snapshot.bake import bake

    tmp = Path(tempfile.mkdtemp(prefix="bench-join-"))
    root = tmp / "store"
    root.mkdir()
    t0 = time.perf_counter()
    snap, m = bake(
        tmp / "snap",
        args.model or None,
        tier="criu",
        device=args.device,
        dtype=args.dtype,
        max_ranks=args.max_ranks,
        max_len=args.max_len,
        **({"max_seqs": args.max_seqs} if args.max_seqs else {}),
        progress=True,
    )
    baked = {"wall_s": time.perf_counter() - t0, "image_bytes": m.image_bytes, "snapshot_id": m.snapshot_id}
    if args.device == "cuda":
        baked["warmup"] = json.loads((snap / "warmup.json").read_text())
    opts = [
        "--Planner.enabled=false",
        "--Worker.dp_size=1",
        f"--Worker.max_ranks={args.max_ranks}",
        f"--Worker.snapshot_root={root}",
        f"--Worker.max_len={args.max_len}",
        *([f"--Worker.max_seqs={args.max_seqs}"] if args.max_seqs else []),
        *([f"--Worker.device={args.device}", "--Worker.vmm=true"] if args.device == "cuda" else []),
        *([f"--Worker.model={args.model}"] if args.model else []),
        *([f"--Worker.dtype={args.dtype}"] if args.dtype else []),
        *args.graph_args,
    ]
    out = args.out or Path("bench/results/join_cuda.json" if args.device == "cuda" else "bench/results/join.json")
    rows = []
    try:
        rows += join(opts, args.max_tokens, restored=False)  # an empty store: a cold joiner
        snap.rename(root / snap.name)
        # As a user serves it: the snapshot in the store from the start, chosen (and its
        # checksums verified) by the router as it starts, before any scale-up.
        # Then 2 -> 1 parks rank 1, and 1 -> 2 restores it: the parked joiner.
        rows += join(opts, args.max_tokens, restored=True, park=True)
        # With Router.standby_copies=1: a copy restored before the scale-up becomes the joiner. On
        # CUDA, with Router.checkpoint_parked, 2 -> 1 and 1 -> 2 again: a parked joiner whose CUDA
        # state was checkpointed (holding no GPU memory while parked).
        cuda = args.device == "cuda"
        rows += join(opts, args.max_tokens, restored=True, standby=1, park=cuda, checkpoint=cuda)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    result = {
        "command": " ".join([sys.executable, "-m", "bench.join", *sys.argv[1:]]),
        "serve_options": opts[:3] + opts[4:],  # not the temporary store
        "device": args.device,
        "bake": baked,
        "joins": rows,
    }
    write_results(out, result)
    print(f"baked in {baked['wall_s']:.1f} s, image {m.image_bytes / 2**20:.0f} MiB")
    print("| joined from | scale | " + " | ".join(f"{k} s" for k in PHASES) + " | start to serving s | greedy equal |")
    print("|---|---|" + "---|" * len(PHASES) + "---|---|")
    for r in rows:
        print(
            f"| {r['joiner']} | {r['scale']} | "
            + " | ".join(f"{r['phases'][k]:.3f}" for k in PHASES)
            + f" | {r['total_s']:.3f} | {r['greedy_equal']} |"
        )
    for r in rows:
        print(
            f"{r['joiner']} joiner steps (s): "
            + ", ".join(f"{k} {v:.3f}" for k, v in r["steps"].items())
            + (f"; pulled {r['pulled_mb']:.0f} MB" if r["pulled_mb"] is not None else "")
        )
    print("\nseconds from the operation's start:")
    print("| joined from | " + " | ".join(TIMELINE) + " |")
    print("|---|" + "---|" * len(TIMELINE))
    for r in rows:
        print(f"| {r['joiner']} | " + " | ".join(f"{r['timeline'].get(k, '-')}" for k in TIMELINE) + " |")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
