"""Decode attention of one layer: the CPU path's gather of the whole cache length with a length
mask (layers.gathered_decode, what CUDA graphs ran before decode_attention.py) beside the Triton
kernel that reads each row's cache in place up to its context length, each captured in a CUDA
graph, beside the floor of reading the rows' K and V once at `--hbm-gbps`.

Every row of a `--max-seqs` batch has `--ctx` tokens in its own slot of a cache of `--max-len`
positions (and a scratch slot, as the engine allocates).

    python -m bench.attention          # Mixtral shapes: 32 q heads, 8 kv heads, head dim 128, bf16

On the CPU (no graphs; the kernel under Triton's interpreter, which this sets up) it only shows
that it runs; keep the sizes tiny:

    python -m bench.attention --device cpu --max-seqs 2 --max-len 128 --ctx 16,100 --heads 4 --kv-heads 2
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

import torch

from bench.measure import graph_ms, median_ms, write_results


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m bench.attention",
        description="One layer's decode attention: gather + SDPA against the Triton kernel. Prints a table and "
        "writes JSON.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda")
    ap.add_argument("--max-seqs", default="32,64", help="comma-separated batch sizes (every row real)")
    ap.add_argument("--max-len", type=int, default=4096, help="cache positions per sequence")
    ap.add_argument("--ctx", default="256,2048", help="comma-separated context lengths of every row")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--hbm-gbps", type=float, default=4000.0, help="memory bandwidth of the floor (H200: 4000)")
    ap.add_argument("--out", type=Path, default=Path("bench/results/attention.json"), help="JSON results file")
    args = ap.parse_args(argv)
    try:
        args.max_seqs = [int(b) for b in args.max_seqs.split(",") if b.strip()]
        args.ctx = [int(c) for c in args.ctx.split(",") if c.strip()]
    except ValueError:
        ap.error("--max-seqs and --ctx must be comma-separated integers")
    if not args.max_seqs or min(args.max_seqs) < 1 or not args.ctx or min(args.ctx) < 1:
        ap.error("--max-seqs and --ctx values must be >= 1")
    if max(args.ctx) > args.max_len or args.heads % args.kv_heads or args.replays < 1:
        ap.error("--ctx values must be <= --max-len, --heads a multiple of --kv-heads, --replays >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA GPU here")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        from harness.triton_interpreter import enable

        enable()  # before the kernel's module is imported
    from components.engine.kernels.decode_attention import decode_attention
    from components.engine.models.layers import gathered_decode

    timed = (lambda fn: graph_ms(fn, args.replays)) if args.device == "cuda" else (lambda fn: median_ms(fn, 1, 1))
    dev, dt = args.device, getattr(torch, args.dtype)
    nh, nkv, hd, L = args.heads, args.kv_heads, args.head_dim, args.max_len
    torch.manual_seed(0)
    rows = []
    for B in args.max_seqs:
        kc, vc = (torch.randn(B + 1, L, nkv, hd, device=dev, dtype=dt) for _ in range(2))
        q = torch.randn(B, nh, hd, device=dev, dtype=dt)
        slots = torch.arange(B, device=dev)
        for n in args.ctx:
            lens = torch.full((B,), n, device=dev)
            row = {"max_seqs": B, "ctx": n, "max_len": L}
            row["gather_sdpa_ms"] = timed(lambda: gathered_decode(q, kc, vc, slots, lens, L))
            row["kernel_ms"] = timed(lambda: decode_attention(q, kc, vc, slots, lens))
            row["floor_ms"] = 2 * B * n * nkv * hd * dt.itemsize / (args.hbm_gbps * 1e9) * 1e3
            diff = decode_attention(q, kc, vc, slots, lens).float() - gathered_decode(q, kc, vc, slots, lens, L).float()
            row["max_abs_diff"] = diff.abs().max().item()
            rows.append(row)
    head = ["max_seqs", "ctx", "max_len", "gather+SDPA ms", "kernel ms", "speedup", "K/V floor ms", "kernel/floor"]
    print(" | ".join(head + ["max abs diff"]))
    print(" | ".join("---" for _ in range(len(head) + 1)))
    for r in rows:
        print(
            f"{r['max_seqs']} | {r['ctx']} | {r['max_len']} | {r['gather_sdpa_ms']:.3f} | {r['kernel_ms']:.3f} | "
            f"{r['gather_sdpa_ms'] / r['kernel_ms']:.1f}x | {r['floor_ms']:.3f} | {r['kernel_ms'] / r['floor_ms']:.2f}x"
            f" | {r['max_abs_diff']:.1e}"
        )
    result = {
        "benchmark": "bench.attention",
        "command": "python -m bench.attention " + " ".join(sys.argv[1:] if argv is None else argv),
        "device": torch.cuda.get_device_name() if dev == "cuda" else platform.processor() or platform.machine(),
        "timing": "CUDA graph replay, median" if dev == "cuda" else "one call (Triton interpreter): a smoke run",
        "shapes": {"heads": nh, "kv_heads": nkv, "head_dim": hd, "dtype": args.dtype},
        "hbm_gbps": args.hbm_gbps,
        "rows": rows,
    }
    write_results(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
