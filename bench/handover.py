"""Handover exactness: a request continued on another rank after k tokens, by recomputing them
(one prefill over prompt + k) or by replaying them (GenerateRequest.replay: one decode step each,
as the first rank computed them). Counts greedy continuations that differ from the uninterrupted
run, on one rank, for several k. On CPU in fp32 both are exact; in bf16 on a GPU a prefill differs
from decode in the last bits, which flips near-ties (a random-weight model has many)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from bench.measure import write_results
from harness.reference import generate, single_rank


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint directory (default: the built-in model)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", help="float32, bfloat16 or float16 (default %(default)s)")
    p.add_argument("--prompts", type=int, default=16, help="prompts, run four at a time (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per request (default %(default)s)")
    p.add_argument("--cuts", default="10,30,59", help="k: tokens produced before the handover (default %(default)s)")
    p.add_argument("--out", type=Path, default=Path("bench/results/handover.json"))
    args = p.parse_args()
    cuts = [int(c) for c in args.cuts.split(",")]
    if not all(0 < k < args.max_tokens for k in cuts):
        p.error(f"--cuts must lie strictly between 0 and --max-tokens ({args.max_tokens})")
    if args.model is None:
        from components.engine.models.builtin import builtin_model_dir

        args.model = str(builtin_model_dir())

    eng = single_rank(args.model, args.device, dtype=args.dtype, max_seqs=8, max_len=256)
    eng.start()
    prompts = [[5 + k, 17, 42, 99] for k in range(args.prompts)]

    def run(inputs, max_tokens, **kw):
        out = []
        for i in range(0, len(inputs), 4):
            out += generate(eng, inputs[i : i + 4], max_tokens, ignore_eos=True, **kw)[0]
        return out

    try:
        whole = run(prompts, args.max_tokens)
        rows = []
        for how in ("recompute", "replay"):
            for k in cuts:
                rest = run(
                    [q + w[:k] for q, w in zip(prompts, whole)], args.max_tokens - k, replay=k if how == "replay" else 0
                )
                rows.append(
                    {"how": how, "k": k, "differ": sum(r != w[k:] for r, w in zip(rest, whole)), "of": len(prompts)}
                )
        diverged = eng.sched.replays_diverged
    finally:
        eng.stop()
    print(f"{args.model} on {args.device}, {args.dtype}: continuations that differ from the uninterrupted run")
    print("| handover by | after k tokens | differ |")
    print("|---|---|---|")
    for r in rows:
        print(f"| {r['how']} | {r['k']} | {r['differ']} / {r['of']} |")
    print(f"replays that sampled a token other than the first rank's: {diverged}")
    write_results(
        args.out,
        {
            "command": " ".join(["python -m bench.handover", *sys.argv[1:]]),
            "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
            "rows": rows,
            "replays_diverged": diverged,
        },
    )


if __name__ == "__main__":
    main()
