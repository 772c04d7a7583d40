"""Real traffic through the served graph, beside what its step could do: aiperf sends a fixed-seed
synthetic trace (prompt and output lengths log-normal around `--isl` / `--osl`, bench.aiperf) at
each point of a concurrency sweep (or a request-rate sweep), and each point reports what aiperf's
JSON export says: TTFT p50/p95/p99, inter-token p50/p95, output and prompt tok/s, and goodput (the
requests/s that met both `--slo-ttft-ms` and `--slo-itl-ms`). Beside them, from the same run:

- decode only: a run of near-empty prompts (mean 4 tokens) and `--decode-tokens` outputs at
  every slot's worth of concurrency (dp_size x max_seqs), its output tok/s and the step rate its
  inter-token p50 implies (slots / ITL p50);
- the prefill compute floor: the model's matmul FLOPs per token (2 x the weights a token meets:
  attention, the router, top-k of each layer's experts, shared experts, lm_head; read from the
  checkpoint's safetensors headers; attention's context term left out) over a dense GEMM rate
  measured here with torch.matmul in the model's dtype, before the graph starts.

    make bench-tools && .venv/bin/python -m bench.serve                      # CPU, built-in model
    python -m bench.serve --device cuda --model DIR --concurrency 1,8,32 --isl 512 --osl 64
"""

from __future__ import annotations

import argparse
import json
import re
import struct
import sys
import tempfile
import time
from pathlib import Path

from bench import aiperf
from bench.measure import write_results
from harness.server import Server

ROOT = Path(__file__).resolve().parents[1]
EXPERT = re.compile(r"\.experts\.(\d+)\.")


def flops_per_token(model_dir: Path) -> dict:
    """2 x the matmul weights one token meets, from the safetensors headers (no weight read)."""
    from components.engine.models.registry import read_config

    cfg = read_config(model_dir / "config.json")
    top_k = cfg.top_k
    dense, experts = 0, {}  # experts: layer prefix -> (expert ids, one expert's weights by name)
    for f in sorted(model_dir.glob("*.safetensors")):
        with f.open("rb") as fh:
            header = json.loads(fh.read(struct.unpack("<Q", fh.read(8))[0]))
        for name, t in header.items():
            shape = t.get("shape", []) if isinstance(t, dict) else []
            # Matrices only (norms and biases are no GEMM); the embedding is a lookup; FP8 scales.
            if len(shape) != 2 or "embed_tokens" in name or name.endswith(("scale_inv", "scale")):
                continue
            m = EXPERT.search(name)
            if m is None:
                dense += shape[0] * shape[1]
                continue
            ids, per = experts.setdefault(name[: m.start()], (set(), {}))
            ids.add(m.group(1))
            per[EXPERT.sub(".experts.N.", name)] = shape[0] * shape[1]
    routed = sum(top_k * sum(per.values()) for _, per in experts.values())
    active = dense + routed
    return {"flops_per_token": 2 * active, "active_matmul_weights": active, "top_k": top_k}


def gemm_rate(device: str, dtype: str) -> dict:
    """A dense square GEMM's FLOP/s with torch.matmul (median of several)."""
    import torch

    dt = getattr(torch, dtype)
    n = 8192 if device == "cuda" else 1024
    a, b = torch.randn(n, n, device=device, dtype=dt), torch.randn(n, n, device=device, dtype=dt)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times = []
    for _ in range(12):
        sync()
        t = time.perf_counter()
        for _ in range(4):
            torch.matmul(a, b)
        sync()
        times.append((time.perf_counter() - t) / 4)
    s = sorted(times[2:])[len(times[2:]) // 2]
    return {"n": n, "dtype": dtype, "threads": torch.get_num_threads(), "s": s, "flop_s": 2 * n**3 / s}


def point(agg: dict, reqs: list[dict]) -> dict:
    """What aiperf's aggregate export says of one run (ms and tok/s as it reports them)."""

    def get(tag: str, stat: str = "avg"):
        return (agg.get(tag) or {}).get(stat)

    return {
        "requests": len(reqs),
        "failed": sum(1 for r in reqs if r["error"]),
        "errors": sorted({r["error"] for r in reqs if r["error"]}),
        **{f"ttft_p{q}_ms": get("time_to_first_token", f"p{q}") for q in (50, 95, 99)},
        **{f"itl_p{q}_ms": get("inter_token_latency", f"p{q}") for q in (50, 95)},
        "output_tok_s": get("output_token_throughput"),
        "prompt_tok_s": get("input_token_throughput"),
        "request_s": get("request_throughput"),
        "goodput_request_s": get("goodput"),
    }


def table(res: dict) -> str:
    def f(v, fmt="{:.1f}"):
        return "-" if v is None else fmt.format(v)

    slo = res["slo"]
    lines = [
        f"| load | requests | failed | TTFT p50 / p95 / p99 ms | ITL p50 / p95 ms | output tok/s | prompt tok/s | "
        f"goodput req/s (TTFT <= {slo['ttft_ms']:g} ms, ITL <= {slo['itl_ms']:g} ms) | req/s |",
        "|" + "---|" * 9,
    ]
    for p in [res["decode_only"], *res["points"]]:
        lines.append(
            f"| {p['load']} | {p['requests']} | {p['failed']} | {f(p['ttft_p50_ms'])} / {f(p['ttft_p95_ms'])} / "
            f"{f(p['ttft_p99_ms'])} | {f(p['itl_p50_ms'], '{:.2f}')} / {f(p['itl_p95_ms'], '{:.2f}')} | "
            f"{f(p['output_tok_s'], '{:.0f}')} | {f(p['prompt_tok_s'], '{:.0f}')} | "
            f"{f(p['goodput_request_s'], '{:.2f}')} | {f(p['request_s'], '{:.2f}')} |"
        )
    d, fl = res["decode_only"], res["prefill_floor"]
    lines += [
        "",
        f"decode only: {f(d['output_tok_s'], '{:.0f}')} output tok/s; {d['slots']} slots / ITL p50 = "
        f"{f(d['step_tok_s'], '{:.0f}')} tok/s",
        f"prefill floor: {fl['flops_per_token'] / 1e6:.2f} MFLOP/token over {fl['gemm']['flop_s'] / 1e9:.1f} GFLOP/s "
        f"({fl['gemm']['dtype']} {fl['gemm']['n']}^3 torch.matmul) = {fl['prompt_tok_s']:.0f} prompt tok/s",
    ]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    aiperf.add_args(p)
    p.add_argument("--ranks", type=int, default=1, help="Worker.dp_size (default 1)")
    p.add_argument("--max-seqs", type=int, default=4, help="Worker.max_seqs (default 4)")
    p.add_argument("--isl", type=int, default=64, help="mean prompt tokens (default 64)")
    p.add_argument("--osl", type=int, default=32, help="mean output tokens (default 32)")
    p.add_argument(
        "--sigma", type=float, default=0.5, help="log-normal spread of lengths (default 0.5; 0: exactly --isl/--osl)"
    )
    p.add_argument("--requests", type=int, default=32, help="requests at each point (default 32)")
    sweep = p.add_mutually_exclusive_group()
    sweep.add_argument("--concurrency", default="1,4", help="the concurrency sweep (default 1,4)")
    sweep.add_argument("--rate", default="", help="a request-rate sweep (req/s, Poisson) instead")
    p.add_argument("--decode-tokens", type=int, default=32, help="mean output of the decode-only run (default 32)")
    p.add_argument("--slo-ttft-ms", type=float, default=500.0, help="goodput's TTFT bound (default 500 ms)")
    p.add_argument("--slo-itl-ms", type=float, default=100.0, help="goodput's inter-token bound (default 100 ms)")
    p.add_argument("--out", type=Path, default=None, help="JSON (default bench/results/serve_{cpu,cuda}.json)")
    p.add_argument("graph_args", nargs="*", help="more `dynamo serve` options, after --")
    args = p.parse_args()
    cmd = aiperf.command(args.aiperf)
    out = args.out or ROOT / "bench" / "results" / f"serve_{args.device}.json"

    from components.engine.models.builtin import builtin_model_dir
    from components.engine.models.registry import read_config

    model_dir = Path(args.model) if args.model else builtin_model_dir()
    cfg = read_config(model_dir / "config.json")
    dtype = args.dtype or cfg.dtype or "float32"
    floor = flops_per_token(model_dir)
    floor["gemm"] = gemm_rate(args.device, dtype)
    floor["prompt_tok_s"] = floor["gemm"]["flop_s"] / floor["flops_per_token"]
    opts = [
        f"--Worker.dp_size={args.ranks}",
        f"--Worker.max_ranks={args.ranks}",
        f"--Worker.max_seqs={args.max_seqs}",
        f"--Worker.device={args.device}",
        "--Planner.enabled=false",
        *([f"--Worker.model={args.model}"] if args.model else []),
        *([f"--Worker.dtype={args.dtype}"] if args.dtype else []),
        *args.graph_args,
    ]
    goodput = ["--goodput", f"time_to_first_token:{args.slo_ttft_ms:g} inter_token_latency:{args.slo_itl_ms:g}"]
    slots = args.ranks * args.max_seqs
    loads = (
        [(f"rate {r}/s", ["--request-rate", r, "--arrival-pattern", "poisson"]) for r in args.rate.split(",")]
        if args.rate
        else [(f"concurrency {c}", ["--concurrency", c]) for c in args.concurrency.split(",")]
    )
    work = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    srv = Server(opts, model=None)
    try:
        url = f"http://127.0.0.1:{srv.http_port}"

        def run(name: str, rows: list[dict], load: list[str]) -> dict:
            print(f"== {name}: {len(rows)} requests", file=sys.stderr)
            d = work / re.sub(r"\W+", "_", name)
            records, agg = aiperf.replay(cmd, url, srv.model, model_dir, rows, d, args.seed, 120.0, load + goodput)
            return {"load": name, **point(agg, aiperf.requests(records))}

        vocab = cfg.vocab_size
        dec_rows = aiperf.rows(args.seed + 1, 2 * slots, 4, args.decode_tokens, vocab)
        dec = run(f"decode only, concurrency {slots}", dec_rows, ["--concurrency", str(slots)])
        dec["slots"] = slots
        dec["step_tok_s"] = slots / (dec["itl_p50_ms"] / 1e3) if dec["itl_p50_ms"] else None
        rows = aiperf.rows(args.seed, args.requests, args.isl, args.osl, vocab, args.sigma)
        points = [run(name, rows, load) for name, load in loads]
    finally:
        srv.stop()
    res = {
        "command": " ".join([sys.executable, "-m", "bench.serve", *sys.argv[1:]]),
        "deployment": {"ranks": args.ranks, "max_seqs": args.max_seqs, "device": args.device, "dtype": dtype},
        "trace": {
            "seed": args.seed,
            "requests": args.requests,
            "isl_mean": args.isl,
            "osl_mean": args.osl,
            "sigma": args.sigma,
        },
        "slo": {"ttft_ms": args.slo_ttft_ms, "itl_ms": args.slo_itl_ms},
        "prefill_floor": floor,
        "decode_only": dec,
        "points": points,
    }
    write_results(out, res)
    print(table(res))


if __name__ == "__main__":
    main()
