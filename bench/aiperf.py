"""aiperf, the load generator bench.slo and bench.serve drive the served graph with: the trace
they replay, its invocation and what its exports say.

A trace row is a pre-built completions payload (token-id prompt, `max_tokens`, `ignore_eos`,
greedy), so every run sees the same requests whatever tokenizer aiperf loads; with timestamps the
rows replay on their fixed schedule, without them at a concurrency or a request rate. aiperf runs
as its own process, from its own environment: `make bench-tools` (.venv/aiperf: its
prometheus-client pin conflicts with the project's), or where there is none (the GPU machine)
the command `--aiperf` or $BENCH_AIPERF names, e.g. "env PYTHONPATH=/tmp/aiperf-site python3 -m
aiperf" after bench/pack_aiperf.sh's install.
"""

from __future__ import annotations

import json
import math
import os
import random
import shlex
import statistics
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv" / "aiperf" / "bin"
ENV = "BENCH_AIPERF"


def command(given: str = "") -> list[str]:
    """The aiperf command: `given`, else $BENCH_AIPERF, else make bench-tools' venv."""
    cmd = given or os.environ.get(ENV, "")
    if cmd:
        return shlex.split(cmd)
    if not (VENV / "aiperf").is_file():
        raise SystemExit(
            f"aiperf is not installed in {VENV.parent}: run `make bench-tools`, or name a command "
            f"with --aiperf or ${ENV} (bench/pack_aiperf.sh packs one for a machine without an index)"
        )
    return [str(VENV / "aiperf")]


def add_args(p) -> None:
    """The options of every benchmark that drives the graph with aiperf: what it serves, the
    trace's seed and the aiperf command."""
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--model", default="", help="Worker.model (default: the built-in model)")
    p.add_argument("--dtype", default="", help="Worker.dtype (default: the checkpoint's)")
    p.add_argument("--seed", type=int, default=0, help="the trace's seed (default 0)")
    p.add_argument("--aiperf", default="", help=f"the aiperf command (default ${ENV}, else .venv/aiperf)")


def lengths(rng: random.Random, isl: int, osl: int, sigma: float = 0.5) -> tuple[int, int]:
    """A prompt and an output length, log-normal around `isl` and `osl` (`sigma`, clipped to a
    quarter and four times the mean; sigma 0: exactly isl and osl)."""

    def one(mean: int) -> int:
        return max(1, min(4 * mean, max(mean // 4, round(rng.lognormvariate(math.log(mean), sigma)))))

    return one(isl), one(osl)


def payload(rng: random.Random, n: int, out: int, vocab: int) -> dict:
    return {
        "prompt": [rng.randrange(3, vocab) for _ in range(n)],
        "max_tokens": out,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        # The usage chunk: aiperf counts the server's tokens (--use-server-token-count), not its
        # tokenizer's re-encoding of the text (which for token-id prompts is not the same count).
        "stream_options": {"include_usage": True},
    }


def rows(seed: int, count: int, isl: int, osl: int, vocab: int, sigma: float = 0.5) -> list[dict]:
    """`count` requests without a schedule (for a concurrency or a rate), fixed by `seed`."""
    rng = random.Random(seed)
    return [{"payload": payload(rng, *lengths(rng, isl, osl, sigma), vocab)} for _ in range(count)]


def replay(
    cmd: list[str],
    url: str,
    model: str,
    tokenizer: Path,
    trace: list[dict],
    out: Path,
    seed: int,
    timeout_s: float,
    load: list[str] = (),
) -> tuple[list[dict], dict]:
    """Send `trace` (on its timestamps, or as `load` says: e.g. ["--concurrency", "8"]); the
    per-request records and the aggregate aiperf exports (profile_export.jsonl and
    profile_export_aiperf.json)."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "trace.jsonl"
    path.write_text("".join(json.dumps({**r, "payload": {**r["payload"], "model": model}}) + "\n" for r in trace))
    # On a machine of a few cores aiperf's default worker and record-processor processes would take
    # the CPU the served graph is measured on.
    small = ["--workers-max", "2", "--record-processors", "1"] if (os.cpu_count() or 1) <= 4 else []
    schedule = ["--fixed-schedule"] if trace and "timestamp" in trace[0] else ["--request-count", str(len(trace))]
    argv = [
        *cmd,
        "profile",
        "--model",
        model,
        "--url",
        url,
        "--endpoint-type",
        "completions",
        "--streaming",
        "--use-server-token-count",
        "--input-file",
        str(path),
        "--custom-dataset-type",
        "mooncake_trace",
        *schedule,
        *load,
        *small,
        "--tokenizer",
        str(tokenizer),
        "--request-timeout-seconds",
        str(timeout_s),
        "--random-seed",
        str(seed),
        "--artifact-dir",
        str(out),
        "--ui-type",
        "none",
        "--no-server-metrics",
    ]
    with (out / "aiperf.log").open("w") as log:
        rc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, cwd=out).returncode
    records, aggregate = out / "profile_export.jsonl", out / "profile_export_aiperf.json"
    if rc != 0 or not records.is_file():
        tail = (out / "aiperf.log").read_text(errors="replace")[-3000:]
        raise SystemExit(f"aiperf failed (exit {rc}); its log ends:\n{tail}")
    got = [json.loads(line) for line in records.read_text().splitlines() if line.strip()]
    return got, json.loads(aggregate.read_text()) if aggregate.is_file() else {}


def _ms(metric: dict | None) -> float | None:
    if not metric or metric.get("value") is None:
        return None
    scale = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}.get(metric.get("unit", "ms"), 1.0)
    v = metric["value"]
    return (statistics.mean(v) if isinstance(v, list) else v) * scale


def requests(records: list[dict]) -> list[dict]:
    """One row per request, by start: start and end (unix s), TTFT and mean inter-token latency
    (s), prompt and output tokens, the error if it failed."""
    out = []
    for r in records:
        m, meta = r.get("metrics") or {}, r["metadata"]
        ttft, itl = _ms(m.get("time_to_first_token")), _ms(m.get("inter_token_latency"))
        err = r.get("error")
        out.append(
            {
                "start": meta["request_start_ns"] / 1e9,
                "end": meta["request_end_ns"] / 1e9,
                "ttft_s": None if ttft is None or err else ttft / 1e3,
                "itl_s": None if itl is None or err else itl / 1e3,
                "prompt_tokens": int(m.get("input_sequence_length", {}).get("value") or 0),
                "tokens": 0 if err else int(m.get("output_sequence_length", {}).get("value") or 0),
                "error": (err.get("message") or err.get("type") or "error") if err else "",
            }
        )
    return sorted(out, key=lambda x: x["start"])
