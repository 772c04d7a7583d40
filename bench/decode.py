"""Decode benchmark: tokens/s and step latency of the DP/EP engine on CPU for 1, 2, 4... ranks.

Each rank is a real process (`bench.decode_peer`): data-parallel attention over its own batch,
experts spread over the ranks and exchanged over NIXL (the engine's EP communicator). Per rank
count, every rank submits `--batch` sequences of `--prompt-len` random prompt tokens (seeded,
within the vocabulary) at the same moment and generates `--gen-len` tokens each (ignore_eos),
after a short untimed warmup round.

  prefill ms        submission until every sequence on every rank has its first token
  decode tok/s      tokens generated after that point, all ranks, over the wall time from the
                    earliest rank's end of prefill to the last rank's last token
  step p50/p99 ms   wall time of one engine step (`EngineRank._step`, wrapped in the peer: header
                    all-to-all + forward with EP dispatch/combine + sampling), decode steps only,
                    pooled over ranks

Run: python -m bench.decode [--ranks 1,2,4] [--batch 8] [--prompt-len 32] [--gen-len 64]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HEADER = ("ranks", "seqs/rank", "decode tok/s total", "tok/s per rank", "step p50 ms", "step p99 ms", "prefill ms")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m bench.decode",
        description="Decode tokens/s and engine step latency of the DP/EP MoE engine on CPU, one process per "
        "rank (DP attention, EP MoE over NIXL). Prints a table and writes JSON.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument(
        "--model",
        default=None,
        help="Hugging Face checkpoint directory (Mixtral or Qwen2-MoE layout); default: the built-in "
        "tiny model (components.engine.builtin.builtin_model_dir())",
    )
    ap.add_argument("--ranks", default="1,2,4", help="comma-separated rank counts to run, one configuration each")
    ap.add_argument("--batch", type=int, default=8, help="concurrent sequences per rank")
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
    ap.add_argument("--out", type=Path, default=Path("bench/results/decode.json"), help="JSON results file")
    args = ap.parse_args(argv)
    try:
        args.ranks = [int(x) for x in args.ranks.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--ranks must be comma-separated integers, got {args.ranks!r}")
    if not args.ranks or min(args.ranks) < 1:
        ap.error("--ranks needs at least one rank count, each >= 1")
    for name in ("batch", "prompt_len", "gen_len"):
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


def run_config(args, model: str, world: int) -> dict:
    threads = args.threads or max(1, usable_cpus() // world)
    plan = {
        "world": world,
        "model": model,
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "gen_len": args.gen_len,
        "warmup_len": args.warmup_len,
        "seed": args.seed,
        "threads": threads,
        "max_len": args.prompt_len + max(args.gen_len, args.warmup_len),
        "timeout_s": args.timeout,
        "ep_timeout_s": min(args.timeout, 120.0),
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
    start = min(rep["t_prefill_done"] for rep in reports)
    end = max(rep["t_decode_end"] for rep in reports)
    decode_tokens = sum(rep["decode_tokens"] for rep in reports)
    steps = [ms for rep in reports for ms in rep["step_ms"]]
    total = decode_tokens / (end - start)
    return {
        "ranks": world,
        "seqs_per_rank": args.batch,
        "decode_tok_s_total": total,
        "decode_tok_s_per_rank": total / world,
        "step_ms_p50": statistics.median(steps),
        "step_ms_p99": pct(steps, 99),
        "step_ms_mean": statistics.fmean(steps),
        "prefill_ms": (max(rep["t_prefill_done"] for rep in reports) - min(rep["t_submit"] for rep in reports)) * 1e3,
        "decode_s": end - start,
        "decode_tokens": decode_tokens,
        "decode_steps_per_rank": [rep["decode_steps"] for rep in reports],
        "torch_threads_per_rank": threads,
        "process_wall_s": wall,
        "per_rank": [
            {k: v for k, v in rep.items() if k != "step_ms"}
            | {"step_ms_p50": statistics.median(rep["step_ms"]), "step_ms_p99": pct(rep["step_ms"], 99)}
            for rep in reports
        ],
    }


def table(rows: list[dict]) -> str:
    cells = [
        [
            str(r["ranks"]),
            str(r["seqs_per_rank"]),
            f"{r['decode_tok_s_total']:.1f}",
            f"{r['decode_tok_s_per_rank']:.1f}",
            f"{r['step_ms_p50']:.2f}",
            f"{r['step_ms_p99']:.2f}",
            f"{r['prefill_ms']:.1f}",
        ]
        for r in rows
    ]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(HEADER)]
    line = lambda cs: "| " + " | ".join(c.rjust(w) for c, w in zip(cs, widths)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(HEADER), sep, *map(line, cells)])


def machine_info() -> dict:
    info = {
        "cpu_count": os.cpu_count(),
        "usable_cpus": usable_cpus(),
        "torch": torch.__version__,
        "torch_threads_default": torch.get_num_threads(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
    }
    try:
        from importlib.metadata import version

        for dist in ("nixl-cu13", "nixl"):
            try:
                info["nixl"] = f"{dist} {version(dist)}"
                break
            except Exception:
                pass
    except ImportError:
        pass
    try:
        info["cpu_model"] = next(
            line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")
        )
    except (OSError, StopIteration):
        pass
    return info


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.model:
        model = str(Path(args.model).resolve())
    else:
        from components.engine.builtin import builtin_model_dir

        model = str(builtin_model_dir())
    argv_list = sys.argv[1:] if argv is None else list(argv)
    command = shlex.join([Path(sys.executable).name, "-m", "bench.decode", *argv_list])
    print(
        f"bench.decode: model {model}; {args.batch} seqs/rank, prompt {args.prompt_len}, gen {args.gen_len}, "
        f"ranks {args.ranks} on {usable_cpus()} CPUs",
        file=sys.stderr,
        flush=True,
    )
    rows = []
    for world in args.ranks:
        t = time.monotonic()
        print(f"  {world} rank(s): running...", file=sys.stderr, flush=True)
        row = run_config(args, model, world)
        rows.append(row)
        print(
            f"  {world} rank(s): {row['decode_tok_s_total']:.1f} tok/s, step p50 {row['step_ms_p50']:.2f} ms "
            f"({time.monotonic() - t:.1f} s)",
            file=sys.stderr,
            flush=True,
        )
    print(
        "step ms = wall time of one engine step (EngineRank._step: header all-to-all + forward + sampling), "
        "decode steps only, pooled over ranks"
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
            "device": "cpu",
            "ep_backend": "nixl (NixlCommunicator, CPU DRAM over UCX)",
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
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
