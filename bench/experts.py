"""The experts of one MoE layer at decode sizes on one GPU: the engine's Triton kernels
(components/engine/kernels/expert_gemm.py) beside torch._grouped_mm over rows sorted by slot and every
expert applied to every row as batched matmuls, each captured in a CUDA graph, beside the floor of
reading every expert's weights once at `--hbm-gbps`.

Rows are routed to uniformly random slots; `rows` is how many the layer computes, `capacity` the
fixed row count it is handed (the rest marked as no slot, as the peer-window exchange hands its
mailbox over). Needs CUDA (Triton).

    python -m bench.experts                       # Mixtral shapes: 8 slots, hidden 4096, ffn 14336, bf16
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.measure import graph_ms, write_results


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m bench.experts",
        description="One MoE layer's experts at decode sizes: Triton kernels, torch._grouped_mm, all-experts bmm. "
        "Prints a table and writes JSON.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--slots", type=int, default=8, help="expert slots on the rank")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=14336, help="expert intermediate size")
    ap.add_argument("--rows", default="2,16,64,128,256", help="comma-separated rows computed")
    ap.add_argument("--capacity", type=int, default=512, help="rows handed over (the rest of no slot); 0: = rows")
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument("--hbm-gbps", type=float, default=4000.0)
    ap.add_argument("--out", type=Path, default=Path("bench/results/experts.json"))
    args = ap.parse_args(argv)
    try:
        args.rows = [int(r) for r in args.rows.split(",") if r.strip()]
    except ValueError:
        ap.error(f"--rows must be comma-separated integers, got {args.rows!r}")
    if not args.rows or min(args.rows) < 1 or args.capacity < 0:
        ap.error("--rows values must be >= 1 and --capacity >= 0")
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (the kernels are Triton)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from components.engine.kernels.expert_gemm import swiglu_experts

    torch.manual_seed(0)
    S, H, I, dt = args.slots, args.hidden, args.ffn, torch.bfloat16
    wg, wu = (torch.randn(S, I, H, device="cuda", dtype=dt) * 0.02 for _ in range(2))
    wd = torch.randn(S, H, I, device="cuda", dtype=dt) * 0.02
    floor_ms = 3 * S * I * H * 2 / (args.hbm_gbps * 1e9) * 1e3

    def grouped(x, key):
        order = torch.argsort(key, stable=True)
        ones = torch.ones_like(key, dtype=torch.int32)
        per = torch.zeros(S + 1, dtype=torch.int32, device="cuda").index_add_(0, key, ones)
        ends = torch.cumsum(per[:S], 0, dtype=torch.int32)
        h = x[order]
        g = torch._grouped_mm(h, wg.transpose(1, 2), offs=ends)
        u = torch._grouped_mm(h, wu.transpose(1, 2), offs=ends)
        return torch._grouped_mm(F.silu(g) * u, wd.transpose(1, 2), offs=ends)

    def all_experts(x, key):
        xe = x.unsqueeze(0).expand(S, -1, -1)
        y = torch.bmm(F.silu(torch.bmm(xe, wg.transpose(1, 2))) * torch.bmm(xe, wu.transpose(1, 2)), wd.transpose(1, 2))
        return (y * (key.unsqueeze(0) == torch.arange(S, device="cuda").unsqueeze(1)).unsqueeze(-1)).sum(0)

    rows = []
    for n in args.rows:
        m = max(n, args.capacity) if args.capacity else n
        x = torch.randn(m, H, device="cuda", dtype=dt)
        key = torch.randint(0, S, (m,), device="cuda")
        key[n:] = S
        row = {"rows": n, "capacity": m, "floor_ms": floor_ms}
        row["triton_ms"] = graph_ms(lambda: swiglu_experts(x, key, wg, wu, wd), args.replays)
        row["grouped_mm_ms"] = graph_ms(lambda: grouped(x, key), args.replays)
        row["bmm_all_ms"] = graph_ms(lambda: all_experts(x, key), args.replays) if m <= 256 else None
        want = all_experts(x[:n], key[:n]).float()
        got = swiglu_experts(x, key, wg, wu, wd)[:n].float()
        row["triton_max_rel_err"] = ((got - want).abs().max() / want.abs().max()).item()
        rows.append(row)
    head = ["rows", "capacity", "triton ms", "grouped_mm ms", "bmm all ms", "floor ms", "triton/floor", "rel err"]
    print(" | ".join(head))
    print(" | ".join("---" for _ in head))
    for r in rows:
        bmm = f"{r['bmm_all_ms']:.3f}" if r["bmm_all_ms"] else "-"
        print(
            f"{r['rows']} | {r['capacity']} | {r['triton_ms']:.3f} | {r['grouped_mm_ms']:.3f} | {bmm} | "
            f"{r['floor_ms']:.3f} | {r['triton_ms'] / r['floor_ms']:.2f}x | {r['triton_max_rel_err']:.1e}"
        )
    result = {
        "benchmark": "bench.experts",
        "device": torch.cuda.get_device_name(),
        "shapes": {"slots": S, "hidden": H, "ffn": I, "dtype": "bfloat16"},
        "hbm_gbps": args.hbm_gbps,
        "rows": rows,
    }
    write_results(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
