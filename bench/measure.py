"""What the benchmarks share: timing a device call, the machine a run had, and writing results."""

from __future__ import annotations

import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path


def median_ms(fn: Callable[[], object], repeats: int, warmup: int = 3) -> float:
    """Median milliseconds of `fn()` between two syncs of the current CUDA device (where there is
    one: CPU work is done when it returns), after `warmup` calls that are not counted."""
    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None
    times = []
    for _ in range(warmup + repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[warmup:]) * 1e3


def graph_ms(fn: Callable[[], object], replays: int) -> float:
    """Median milliseconds of a CUDA graph replay of `fn()`, captured after three calls outside it
    (where kernels compile and autotune)."""
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return median_ms(g.replay, replays)


def gpus() -> list[str]:
    """This machine's GPUs by name (nvidia-smi's; none without it), for a result's record of
    where it ran: without a CUDA context in a client that only drives the served graph."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    out = subprocess.run([smi, "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
    return [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []


def cpu_model() -> str:
    """The host CPU's model name (Linux's /proc/cpuinfo; else what the platform says)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict:
    """Where a result was measured, for its record: the host's CPUs, whose speed sets the serving
    path's host work (one GPU model on two hosts gave 7.7k and 9.8k output tok/s of the same
    traffic with the same code, bench.serve), its GPUs, the platform, Python, and the load
    average as the record is made."""
    return {
        "cpus": os.cpu_count(),
        "cpu_model": cpu_model(),
        "gpus": gpus(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "load_avg": os.getloadavg(),
    }


def write_results(path: Path, result: dict, *, quiet: bool = False) -> None:
    """Write `result` as JSON to `path`, with the machine it was measured on (`machine`) unless it
    records its own. Values JSON has no form for (an exception, a path) are written as their str.
    `quiet` for a benchmark that saves after every row, so that a run cut short keeps its numbers."""
    if "machine" not in result:
        result = {**result, "machine": machine()}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    if not quiet:
        print(f"wrote {path}", file=sys.stderr)
