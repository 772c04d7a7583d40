"""Decode benchmark: tokens/s and step latency of the DP/EP engine for 1, 2, 4... ranks, on CPU
or on GPUs (`--device cuda`, `--ranks-per-gpu` ranks sharing each GPU).

Each rank is a real process (`bench.decode_peer`): data-parallel attention over its own batch,
experts spread over the ranks and exchanged over NIXL (the engine's EP communicator). Per rank
count the processes start once; for each `--batch` size every rank submits that many sequences of
`--prompt-len` random prompt tokens (seeded, within the vocabulary) at the same moment and
generates `--gen-len` tokens each (ignore_eos), after a short untimed warmup round.

  prefill ms        submission until every sequence on every rank has its first token
  decode tok/s      tokens generated after that point, all ranks, over the wall time from the
                    earliest rank's end of prefill to the last rank's last token
  step p50/p99 ms   wall time of one engine step (`EngineRank._step`, wrapped in the peer: header
                    all-to-all + forward with EP dispatch/combine + sampling), decode steps only,
                    pooled over ranks
  floor step ms     the weight bytes one decode step reads on the busiest device (each rank's
                    dense weights, plus its experts weighted by the chance that a step's tokens
                    touch them, from the measured routing; all of them once the batch is large)
                    over `--hbm-gbps`; floor tok/s is the tokens of one step over that time

Run: python -m bench.decode [--ranks 1,2,4] [--batch 8] [--prompt-len 32] [--gen-len 64]
     python -m bench.decode --device cuda --model DIR --ranks 1,2 --batch 1,8,32,64
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

import torch

from bench.measure import machine, write_results

HEADER = (
    "ranks",
    "devices",
    "seqs/rank",
    "decode tok/s total",
    "tok/s per rank",
    "step p50 ms",
    "step p99 ms",
    "floor step ms",
    "floor tok/s",
    "p50 / floor",
    "prefill ms",
)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m bench.decode",
        description="Decode tokens/s and engine step latency of the DP/EP MoE engine on CPU or GPUs, one process "
        "per rank (DP attention, EP MoE over NIXL), beside the floor the weight bytes read per step set. Prints a "
        "table and writes JSON.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument(
        "--model",
        default=None,
        help="Hugging Face checkpoint directory (any family the README's Models table lists); default: the built-in "
        "tiny model (components.engine.models.builtin.builtin_model_dir())",
    )
    ap.add_argument("--ranks", default="1,2,4", help="comma-separated rank counts to run, one configuration each")
    ap.add_argument("--batch", default="8", help="comma-separated concurrent sequences per rank, one measurement each")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the ranks run")
    ap.add_argument(
        "--ranks-per-gpu", type=int, default=1, help="cuda: ranks sharing one GPU (rank r on GPU r // this)"
    )
    ap.add_argument(
        "--hbm-gbps",
        type=float,
        default=4000.0,
        help="memory bandwidth (GB/s) the floor divides the weight bytes by (4000: measured on an H200)",
    )
    ap.add_argument(
        "--min-ranks",
        type=int,
        default=0,
        help="RankConfig.min_ranks (sizes the expert slots); 0: the rank count, so the experts are split "
        "over the ranks without replicas",
    )
    ap.add_argument("--dtype", default="", help="model dtype (float32, bfloat16, float16); '': the checkpoint's")
    ap.add_argument("--eager", action="store_true", help="cuda: no decode CUDA graphs")
    ap.add_argument(
        "--ep-transport",
        choices=("auto", "window", "nixl"),
        default="auto",
        help="RankConfig.ep_transport: the MoE exchange through same-node peer windows or over NIXL; auto: "
        "windows where no two ranks share a GPU (set window for ranks sharing GPUs under MPS)",
    )
    ap.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per sequence (random ids, seeded)")
    ap.add_argument("--gen-len", type=int, default=64, help="tokens generated per sequence (ignore_eos)")
    ap.add_argument(
        "--warmup-len",
        type=int,
        default=4,
        help="tokens per sequence of the untimed warmup round before the measured one (0: none)",
    )
    ap.add_argument(
        "--threads", type=int, default=0, help="torch threads per rank process; 0: max(1, usable CPUs // ranks)"
    )
    ap.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    ap.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds one configuration may take before its processes are killed",
    )
    ap.add_argument(
        "--out", type=Path, default=None, help="JSON results file; default bench/results/decode[_cuda].json"
    )
    args = ap.parse_args(argv)
    for name in ("ranks", "batch"):
        try:
            values = [int(x) for x in getattr(args, name).split(",") if x.strip()]
        except ValueError:
            ap.error(f"--{name} must be comma-separated integers, got {getattr(args, name)!r}")
        if not values or min(values) < 1:
            ap.error(f"--{name} needs at least one value, each >= 1")
        setattr(args, name, values)
    if args.ranks_per_gpu < 1 or args.hbm_gbps <= 0 or args.min_ranks < 0:
        ap.error("--ranks-per-gpu must be >= 1, --hbm-gbps > 0 and --min-ranks >= 0")
    if args.out is None:
        args.out = Path("bench/results/decode.json" if args.device == "cpu" else "bench/results/decode_cuda.json")
    for name in ("prompt_len", "gen_len"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.gen_len < 2:
        ap.error("--gen-len must be >= 2: the first token belongs to prefill, decode starts after it")
    return args


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def pct(xs: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(round(q / 100 * len(s) + 0.5)) - 1))]


def devices(args, world: int) -> list[str]:
    if args.device == "cpu":
        return ["cpu"] * world
    gpus = math.ceil(world / args.ranks_per_gpu)
    if torch.cuda.device_count() < gpus:
        raise RuntimeError(
            f"{world} ranks at {args.ranks_per_gpu} per GPU need {gpus} GPUs; {torch.cuda.device_count()} visible"
        )
    return [f"cuda:{r // args.ranks_per_gpu}" for r in range(world)]


def graph_sizes(args) -> list[int]:
    """Every measured batch runs through a graph of its own size; powers of two fill in below."""
    if args.device == "cpu" or args.eager:
        return []
    top = max(args.batch)
    return sorted({1 << i for i in range(top.bit_length()) if 1 << i <= top} | set(args.batch))


def run_config(args, model: str, world: int) -> list[dict]:
    """One set of rank processes; a result row per batch size."""
    threads = args.threads or max(1, usable_cpus() // world)
    plan = {
        "world": world,
        "model": model,
        "batches": args.batch,
        "devices": devices(args, world),
        "dtype": args.dtype,
        "min_ranks": args.min_ranks or world,
        "graph_sizes": graph_sizes(args),
        "prompt_len": args.prompt_len,
        "gen_len": args.gen_len,
        "warmup_len": args.warmup_len,
        "seed": args.seed,
        "threads": threads,
        "max_len": args.prompt_len + max(args.gen_len, args.warmup_len),
        "timeout_s": args.timeout,
        "ep_timeout_s": min(args.timeout, 120.0),
        "ep_transport": args.ep_transport,
    }
    with tempfile.TemporaryDirectory(prefix=f"bench-decode-{world}-") as tmp:
        d = Path(tmp)
        (d / "plan.json").write_text(json.dumps(plan))
        logs = [open(d / f"peer{r}.log", "wb") for r in range(world)]
        t0 = time.monotonic()
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "bench.decode_peer", "--rank", str(r), "--dir", str(d)],
                stdout=logs[r],
                stderr=subprocess.STDOUT,
            )
            for r in range(world)
        ]
        try:
            deadline = t0 + args.timeout + 60
            failed = None
            for r, p in enumerate(procs):
                try:
                    rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    rc = "timeout"
                if rc != 0 and failed is None:
                    failed = (r, rc)
                    break
            if failed:
                r, rc = failed
                tail = (d / f"peer{r}.log").read_text(errors="replace")[-4000:]
                raise RuntimeError(f"{world} ranks: rank {r} failed ({rc}); its log ends with:\n{tail}")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            for f in logs:
                f.close()
        reports = [json.loads((d / f"report{r}.json").read_text()) for r in range(world)]
    wall = time.monotonic() - t0
    rows = []
    for batch in args.batch:
        runs = [next(run for run in rep["runs"] if run["batch"] == batch) for rep in reports]
        start = min(run["t_prefill_done"] for run in runs)
        end = max(run["t_decode_end"] for run in runs)
        decode_tokens = sum(run["decode_tokens"] for run in runs)
        steps = [ms for run in runs for ms in run["step_ms"]]
        total = decode_tokens / (end - start)
        floor = weight_floor(reports, runs, batch, args.hbm_gbps)
        rows.append(
            {
                "ranks": world,
                "devices": sorted({rep["device"] for rep in reports}),
                "device_names": sorted({rep["device_name"] for rep in reports}),
                "seqs_per_rank": batch,
                "decode_tok_s_total": total,
                "decode_tok_s_per_rank": total / world,
                "step_ms_p50": statistics.median(steps),
                "step_ms_p99": pct(steps, 99),
                "step_ms_mean": statistics.fmean(steps),
                **floor,
                "p50_over_floor": statistics.median(steps) / floor["floor_step_ms"],
                "prefill_ms": (max(run["t_prefill_done"] for run in runs) - min(run["t_submit"] for run in runs)) * 1e3,
                "decode_s": end - start,
                "decode_tokens": decode_tokens,
                "decode_steps_per_rank": [run["decode_steps"] for run in runs],
                "graph_sizes": reports[0]["graph_sizes"],
                "torch_threads_per_rank": threads,
                "process_wall_s": wall,
                "per_rank": [
                    {k: v for k, v in run.items() if k not in ("step_ms", "load")}
                    | {"step_ms_p50": statistics.median(run["step_ms"]), "step_ms_p99": pct(run["step_ms"], 99)}
                    for run in runs
                ],
            }
        )
    return rows


def weight_floor(reports: list[dict], runs: list[dict], batch: int, hbm_gbps: float) -> dict:
    """The step time below which memory cannot stream the weights one decode step reads.

    A step reads each rank's dense weights whole, and each expert slot that at least one of the
    step's tokens (every rank's `batch`) is routed to. Expert e of a layer is chosen by a share q of
    the tokens (measured: `SparseMoE.load` over the measured phase, all ranks) and its r replicas
    split the tokens between them, so a slot is touched with probability 1 - (1 - q)^(tokens / r):
    a few experts at batch 1, all of them at large batches. Ranks on one device add up; the
    busiest device sets the step."""
    tokens = len(reports) * batch
    k = reports[0]["top_k"]
    touched = [0.0] * len(reports)
    for layer in range(len(reports[0]["local_experts"])):
        load = [sum(col) for col in zip(*(run["load"][layer] for run in runs))]
        routed = sum(load) / k  # tokens through this layer
        replicas = Counter(e for rep in reports for e in rep["local_experts"][layer] if e >= 0)
        for r, rep in enumerate(reports):
            for e in rep["local_experts"][layer]:
                if e >= 0:
                    share = min(1.0, load[e] / routed) if routed else 1.0
                    touched[r] += 1 - (1 - share) ** (tokens / replicas[e])
    per_device: dict[str, float] = defaultdict(float)
    for rep, t in zip(reports, touched):
        per_device[rep["device"]] += rep["dense_bytes"] + t * rep["expert_bytes"]
    step_s = max(per_device.values()) / (hbm_gbps * 1e9)
    return {
        "floor_step_ms": step_s * 1e3,
        "floor_tok_s": tokens / step_s,
        "weight_bytes_per_step": sum(per_device.values()),
        "experts_touched_per_rank": touched,
        "hbm_gbps": hbm_gbps,
    }


def table(rows: list[dict]) -> str:
    cells = [
        [
            str(r["ranks"]),
            ",".join(r["devices"]),
            str(r["seqs_per_rank"]),
            f"{r['decode_tok_s_total']:.1f}",
            f"{r['decode_tok_s_per_rank']:.1f}",
            f"{r['step_ms_p50']:.2f}",
            f"{r['step_ms_p99']:.2f}",
            f"{r['floor_step_ms']:.3f}",
            f"{r['floor_tok_s']:.0f}",
            f"{r['p50_over_floor']:.1f}x",
            f"{r['prefill_ms']:.1f}",
        ]
        for r in rows
    ]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(HEADER)]
    line = lambda cs: "| " + " | ".join(c.rjust(w) for c, w in zip(cs, widths)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(HEADER), sep, *map(line, cells)])


def machine_info() -> dict:
    """bench.measure.machine, and what sizes this benchmark's CPU runs: usable CPUs, torch's
    threads, torch's and NIXL's versions."""
    info = {
        **machine(),
        "usable_cpus": usable_cpus(),
        "torch": torch.__version__,
        "torch_threads_default": torch.get_num_threads(),
    }
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("nixl-cu13", "nixl"):
        try:
            info["nixl"] = f"{dist} {version(dist)}"
            break
        except PackageNotFoundError:
            pass
    return info


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.model:
        model = str(Path(args.model).resolve())
    else:
        from components.engine.models.builtin import builtin_model_dir

        model = str(builtin_model_dir())
    argv_list = sys.argv[1:] if argv is None else list(argv)
    command = shlex.join([Path(sys.executable).name, "-m", "bench.decode", *argv_list])
    print(
        f"bench.decode: model {model}; {args.batch} seqs/rank, prompt {args.prompt_len}, gen {args.gen_len}, "
        f"ranks {args.ranks} on {args.device}"
        + (f" ({args.ranks_per_gpu} per GPU)" if args.device == "cuda" else "")
        + f", {usable_cpus()} CPUs",
        file=sys.stderr,
        flush=True,
    )
    rows = []
    for world in args.ranks:
        t = time.monotonic()
        print(f"  {world} rank(s): running...", file=sys.stderr, flush=True)
        got = run_config(args, model, world)
        rows += got
        for row in got:
            print(
                f"  {world} rank(s), {row['seqs_per_rank']} seqs/rank: {row['decode_tok_s_total']:.1f} tok/s, "
                f"step p50 {row['step_ms_p50']:.2f} ms, floor {row['floor_step_ms']:.3f} ms",
                file=sys.stderr,
                flush=True,
            )
        print(f"  {world} rank(s): {time.monotonic() - t:.1f} s", file=sys.stderr, flush=True)
    print(
        "step ms = wall time of one engine step (EngineRank._step: header all-to-all + forward + sampling), "
        "decode steps only, pooled over ranks; floor = weight bytes read per step on the busiest device "
        f"/ {args.hbm_gbps:g} GB/s"
    )
    print(table(rows))
    result = {
        "command": command,
        "argv": [sys.executable, "-m", "bench.decode", *argv_list],
        "cwd": os.getcwd(),
        "model": model,
        "machine": machine_info(),
        "config": {
            "batch": args.batch,
            "prompt_len": args.prompt_len,
            "gen_len": args.gen_len,
            "warmup_len": args.warmup_len,
            "seed": args.seed,
            "threads": args.threads,
            "device": args.device,
            "ranks_per_gpu": args.ranks_per_gpu if args.device == "cuda" else None,
            "hbm_gbps": args.hbm_gbps,
            "min_ranks": args.min_ranks or "the rank count",
            "dtype": args.dtype or "the checkpoint's",
            "cuda_graph_sizes": graph_sizes(args),
            "ep_transport": args.ep_transport,
            "mps": bool(os.environ.get("CUDA_MPS_PIPE_DIRECTORY")),
        },
        "step_latency": "EngineRank._step wall time per forward step in the decode phase, pooled over ranks",
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "results": rows,
    }
    try:
        result["git_commit"] = (
            subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        pass
    write_results(args.out, result)


if __name__ == "__main__":
    main()
