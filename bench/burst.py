"""Prompts sent at once to one rank in this process, one token out each: prompt tokens a second for
each step budget and prompt piece (`--configs`), and on CUDA where the burst's device time goes
(experts, dense GEMMs, attention, the rest; torch.profiler over one burst).

One rank with every expert local (`harness.reference.single_rank`), its real step loop. For each
config the engine is built with `max_batched_tokens` and `prompt_piece` as given, warmed up by one
burst, then `--repeats` bursts of `--prompts` distinct random prompts of `--prompt-len` tokens are
timed from submission to the last token. The first tokens of every config are compared: the
budget and the piece decide how a prompt is cut into steps, never what it draws.

    python -m bench.burst --model /tmp/mxl --configs 2048:256,4096:256,8192:256,8192:512
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from bench.measure import write_results

CATEGORIES = (
    ("experts", ("_expert_kernel",)),
    ("grouping", ("_count_kernel", "_place_kernel")),
    ("attention", ("_decode_kernel",)),
    ("gemm", ("gemm", "cutlass", "xmma", "nvjet")),
)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m bench.burst",
        description="Prompts sent at once to one rank in process: prompt tok/s per step budget and prompt piece.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--model", default=None, help="checkpoint directory; default: the built-in tiny model")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda")
    ap.add_argument("--configs", default="2048:256,8192:512", help="comma-separated BUDGET:PIECE (prompt tokens)")
    ap.add_argument("--prompts", type=int, default=32, help="prompts in a burst")
    ap.add_argument("--prompt-len", type=int, default=1024, help="tokens of each prompt")
    ap.add_argument("--repeats", type=int, default=4, help="timed bursts per config")
    ap.add_argument("--out", type=Path, default=Path("bench/results/burst.json"), help="JSON results file")
    args = ap.parse_args(argv)
    try:
        args.configs = [tuple(int(v) for v in c.split(":")) for c in args.configs.split(",") if c.strip()]
    except ValueError:
        ap.error(f"--configs must be comma-separated BUDGET:PIECE integers, got {args.configs!r}")
    if not args.configs or any(len(c) != 2 or min(c) < 1 for c in args.configs):
        ap.error("--configs: each is BUDGET:PIECE, both >= 1")
    if min(args.prompts, args.prompt_len, args.repeats) < 1:
        ap.error("--prompts, --prompt-len and --repeats must be >= 1")
    return args


def category(kernel: str) -> str:
    low = kernel.lower()
    return next((name for name, keys in CATEGORIES if any(k.lower() in low for k in keys)), "other")


def main(argv=None) -> int:
    args = parse_args(argv)
    from components.engine.models.builtin import builtin_model_dir
    from harness.reference import single_rank, submit_all

    model = args.model or str(builtin_model_dir())
    cuda = args.device.startswith("cuda")
    n, length = args.prompts, args.prompt_len
    rows = []
    for budget, piece in args.configs:
        eng = single_rank(
            model,
            device=args.device,
            max_len=length + 8,
            max_seqs=n,
            max_batched_tokens=budget,
            prompt_piece=piece,
        )
        eng.start()
        vocab = eng.model_config.vocab_size

        def burst(seed: int, eng=eng) -> tuple[float, list[list[int]]]:
            g = torch.Generator().manual_seed(seed)
            prompts = [torch.randint(10, vocab - 10, (length,), generator=g).tolist() for _ in range(n)]
            t0 = time.perf_counter()
            tokens, _ = submit_all(eng, prompts, 1, ignore_eos=True)(600)
            return time.perf_counter() - t0, tokens

        try:
            burst(1)  # warmup: first kernels, allocator
            walls = [burst(2 + i)[0] for i in range(args.repeats)]
            device_ms: dict[str, float] = {}
            if cuda:
                from torch.profiler import ProfilerActivity, profile

                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    _, first = burst(2)
                    torch.cuda.synchronize(eng.device)
                for e in prof.key_averages():
                    if e.device_type.name == "CUDA" and e.device_time_total > 0:
                        cat = category(e.key)
                        device_ms[cat] = device_ms.get(cat, 0.0) + e.device_time_total / 1e3
            else:
                _, first = burst(2)
        finally:
            eng.stop()
        del eng
        if cuda:
            torch.cuda.empty_cache()
        rows.append(
            {
                "budget": budget,
                "piece": piece,
                "walls_s": walls,
                "prompt_tok_s": n * length / min(walls),
                "prompt_tok_s_median": n * length / statistics.median(walls),
                "device_ms": device_ms,
                "first_tokens": [t[0] for t in first],
            }
        )
    same = all(r["first_tokens"] == rows[0]["first_tokens"] for r in rows)
    cats = [name for name, _ in CATEGORIES] + ["other"]
    head = ["budget:piece", "prompt tok/s (best)", "median", *(f"{c} ms" for c in cats)]
    print(f"{n} prompts of {length} tokens at once, 1 token out, one rank ({args.device})")
    print(" | ".join(head))
    print(" | ".join("---" for _ in head))
    for r in rows:
        d = r["device_ms"]
        cells = [f"{d[c]:.1f}" if c in d else "-" for c in cats]
        print(
            f"{r['budget']}:{r['piece']} | {r['prompt_tok_s']:,.0f} | {r['prompt_tok_s_median']:,.0f} | "
            + " | ".join(cells)
        )
    print(f"first tokens the same under every config: {'yes' if same else 'NO'}")
    write_results(
        args.out,
        {
            "benchmark": "bench.burst",
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "model": model,
            "prompts": n,
            "prompt_len": length,
            "first_tokens_same": same,
            "rows": rows,
        },
    )
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
