"""The experts of one MoE layer at decode sizes on one GPU: the engine's Triton kernels
(components/engine/kernels/expert_gemm.py) beside torch._grouped_mm over rows sorted by slot and every
expert applied to every row as batched matmuls, each captured in a CUDA graph, beside the floor of
reading every expert's weights once at `--hbm-gbps` or the rows' FLOPs at the dense bf16 GEMM
rate measured in the same run, whichever is longer. The engine's two tilings (decode steps' and
prompt steps') and any `--tiles` are each checked against the all-experts form, and for the same
bits as the decode tiling (the engine relies on it: a decode row may share a step with prompts).

Rows are routed to uniformly random slots; `rows` is how many the layer computes, `capacity` the
fixed row count it is handed (the rest marked as no slot, as the peer-window exchange hands its
mailbox over). Needs CUDA (Triton).

    python -m bench.experts                       # Mixtral shapes: 8 slots, hidden 4096, ffn 14336, bf16
    python -m bench.experts --capacity 4096 --rows 2,64,256,1024,4096 --tiles 64x128x64:4:4,128x128x64:8:3
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

from bench.measure import graph_ms, write_results


def parse_tiles(text: str):
    """MxNxK[:warps[:stages[:group]]] -> expert_gemm.Tiles (ValueError saying what is wrong)."""
    from components.engine.kernels.expert_gemm import Tiles

    shape, *rest = text.strip().split(":")
    try:
        m, n, k = (int(v) for v in shape.split("x"))
        extra = [int(v) for v in rest]
    except ValueError:
        raise ValueError(f"{text!r} is not MxNxK[:warps[:stages[:group]]] in integers") from None
    if len(extra) > 3 or min(m, n, k, *extra) < 1 or any(v & (v - 1) for v in (m, n, k, *extra[:1])):
        raise ValueError(f"{text!r}: M, N, K and warps must be powers of two, stages and group >= 1")
    return Tiles(m, n, k, *extra)


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
    ap.add_argument(
        "--tiles",
        default="",
        help="comma-separated tilings to time beside the engine's, each MxNxK[:warps[:stages[:group]]] "
        "(e.g. 128x128x64:8; group: blocks of rows taken column tile by column tile)",
    )
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument("--hbm-gbps", type=float, default=4000.0)
    ap.add_argument("--out", type=Path, default=Path("bench/results/experts.json"))
    args = ap.parse_args(argv)
    try:
        args.rows = [int(r) for r in args.rows.split(",") if r.strip()]
    except ValueError:
        ap.error(f"--rows must be comma-separated integers, got {args.rows!r}")
    try:
        args.tiles = [parse_tiles(t) for t in args.tiles.split(",") if t.strip()]
    except ValueError as e:
        ap.error(f"--tiles: {e}")
    if not args.rows or min(args.rows) < 1 or args.capacity < 0:
        ap.error("--rows values must be >= 1 and --capacity >= 0")
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (the kernels are Triton)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from components.engine.kernels.expert_gemm import PROMPT_TILES, TILES, expert_tiles, swiglu_experts

    def run(x, key, t, n):
        """The kernels in tiling t with the grid the engine gives it: a decode step's for TILES,
        a step of n rows' for a tiling of prompt steps."""
        with expert_tiles(t, 0 if t == TILES else n):
            return swiglu_experts(x, key, wg, wu, wd)

    torch.manual_seed(0)
    S, H, I, dt = args.slots, args.hidden, args.ffn, torch.bfloat16
    wg, wu = (torch.randn(S, I, H, device="cuda", dtype=dt) * 0.02 for _ in range(2))
    wd = torch.randn(S, H, I, device="cuda", dtype=dt) * 0.02
    weight_ms = 3 * S * I * H * 2 / (args.hbm_gbps * 1e9) * 1e3
    gemm_flop_s = dense_flop_s(dt)
    # The engine's two: decode steps', and steps with prompt rows'.
    tilings = [TILES, PROMPT_TILES, *(t for t in args.tiles if t not in (TILES, PROMPT_TILES))]

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
        # The floor: every touched expert's weights read once, or the rows' FLOPs at the dense
        # GEMM rate measured here, whichever is longer.
        floor_ms = max(weight_ms, 6 * n * H * I / gemm_flop_s * 1e3)
        row = {"rows": n, "capacity": m, "floor_ms": floor_ms, "weight_floor_ms": weight_ms}
        want = all_experts(x[:n], key[:n]).float()
        row["triton"] = []
        engine = run(x, key, TILES, n)[:n]
        for t in tilings:
            try:
                got = run(x, key, t, n)[:n]
            except triton.runtime.errors.OutOfResources as e:  # a tiling this GPU cannot hold
                row["triton"].append({"tiles": t._asdict(), "ms": None, "error": str(e)})
                continue
            ms = graph_ms(lambda t=t: run(x, key, t, n), args.replays)
            err = ((got.float() - want).abs().max() / want.abs().max()).item()
            # Whether a row's bits are the engine's tiling's: a tiling that keeps them can serve
            # some steps without a row's result changing with the step it ran in.
            same = bool(torch.equal(got, engine))
            row["triton"].append({"tiles": t._asdict(), "ms": ms, "max_rel_err": err, "bits_equal_engine": same})
        row["grouped_mm_ms"] = graph_ms(lambda: grouped(x, key), args.replays)
        row["bmm_all_ms"] = graph_ms(lambda: all_experts(x, key), args.replays) if m <= 256 else None
        rows.append(row)
    names = [
        "x".join(map(str, t[:3])) + f":{t.warps}:{t.stages}" + (f":{t.group}" if t.group < 1 << 16 else "")
        for t in tilings
    ]
    head = ["rows", "capacity", *(f"triton {n} ms" for n in names), "grouped_mm ms", "bmm all ms", "floor ms"]
    head += ["best triton/floor", "rel err (engine's)", "bits equal the engine's"]
    print(" | ".join(head))
    print(" | ".join("---" for _ in head))
    for r in rows:
        bmm = f"{r['bmm_all_ms']:.3f}" if r["bmm_all_ms"] else "-"
        best = min(t["ms"] for t in r["triton"] if t["ms"] is not None)
        print(
            f"{r['rows']} | {r['capacity']} | "
            + " | ".join(f"{t['ms']:.3f}" if t["ms"] is not None else "too large" for t in r["triton"])
            + f" | {r['grouped_mm_ms']:.3f} | {bmm} | {r['floor_ms']:.3f} | {best / r['floor_ms']:.2f}x | "
            + f"{r['triton'][0]['max_rel_err']:.1e} | "
            + "".join({True: "y", False: "n", None: "-"}[t.get("bits_equal_engine")] for t in r["triton"])
        )  # fmt: skip
    result = {
        "benchmark": "bench.experts",
        "device": torch.cuda.get_device_name(),
        "shapes": {"slots": S, "hidden": H, "ffn": I, "dtype": "bfloat16"},
        "hbm_gbps": args.hbm_gbps,
        "dense_gemm_flop_s": gemm_flop_s,
        "engine_tiles": TILES._asdict(),
        "rows": rows,
    }
    write_results(args.out, result)
    return 0


def dense_flop_s(dtype: torch.dtype, n: int = 8192) -> float:
    """torch.matmul's rate on an n x n x n GEMM in `dtype` on this GPU (a CUDA graph of it)."""
    a, b = (torch.randn(n, n, device="cuda", dtype=dtype) for _ in range(2))
    return 2 * n**3 / (graph_ms(lambda: a @ b, 10) * 1e-3)


if __name__ == "__main__":
    raise SystemExit(main())
