"""Where one rank's decode step goes: the engine's whole step, phase by phase, beside the replay of
its CUDA graph alone and the floor the weight bytes set.

One rank in this process (every expert local, `harness.reference.single_rank`), its real step loop
running. For each `--batch` size, that many sequences of `--prompt-len` random tokens are submitted
at once and generate `--gen-len` tokens each (ignore_eos); only steps that decode every sequence
are kept. The step's phases are timed on the host by wrapping the engine's own methods, so the
engine code is what a server runs:

  header     the per-step all-to-all of (has_work, wants_pause) among the active ranks
  schedule   picking the step's sequences (Scheduler.schedule)
  inputs     the step's rows on the host (Scheduler.rows) and the sampling parameters on the device
  launch     queueing the forward: the rows copied into the graph's inputs (one copy) and the graph
             replayed (or the rows on the device and eager kernels)
  wait       until the device finished the step queued before this one (EngineRank._settle): a
             step is queued before the one before it is read back, so the host's work overlaps
             the device's, and a step's time is the interval between steps
  update     appending that step's tokens and emitting them (Scheduler.update)

With `--beside N`, a second pass times the steps that carry a prompt of N tokens beside the
batch's decodes (a new prompt, one token out, whenever the last is done) against the decode steps
between them (on CUDA a step's interval on the host ends with the wait for the step queued
before it, so each interval is counted for that step; on the CPU a step computes as it is
queued). In a memory-bound decode step a prompt piece could ride
on the weights the decodes read anyway, and `us a prompt token` (the mixed step's time beyond the
decode step's, per prompt token) says how nearly it does, beside the prompt rate of a whole step
of prompts (bench.burst).

Then `graph ms`: the decode graph of that batch size replayed alone (median of `--replays`, a sync
around each), and `floor ms`: every weight byte read once at `--hbm-gbps` (a decode batch of 32 or
more touches every expert). What a step takes beyond the graph is host work the overlap left exposed.

    python -m bench.step --model DIR --batch 1,8,32,64          # cuda when there is one
"""

from __future__ import annotations

import argparse
import platform
import statistics
import threading
import time
from collections import defaultdict
from pathlib import Path

import torch

from bench.measure import median_ms, write_results

PHASES = ("header", "schedule", "inputs", "launch", "wait", "update")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m bench.step",
        description="One rank's decode step, phase by phase, beside its CUDA graph alone and the weight-bytes "
        "floor. Prints a table and writes JSON.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--model", default=None, help="checkpoint directory; default: the built-in tiny model")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda")
    ap.add_argument("--dtype", default="", help="model dtype; '': the checkpoint's")
    ap.add_argument("--batch", default="1,8,32,64", help="comma-separated decode batch sizes")
    ap.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per sequence")
    ap.add_argument("--gen-len", type=int, default=64, help="tokens generated per sequence")
    ap.add_argument(
        "--max-len",
        type=int,
        default=0,
        help="KV cache length per sequence; 0: the model's context capped by memory, as a deployment gets it "
        "(decode graphs attend over the whole cache)",
    )
    ap.add_argument(
        "--batch-invariant",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the engine's default: every decode batch padded into one graph of the largest --batch rows; "
        "--no-batch-invariant: a graph per batch size, mixed prefill and decode steps",
    )
    ap.add_argument(
        "--beside",
        type=int,
        default=0,
        help="also time steps carrying one prompt of this many tokens beside each batch's decodes; 0: off",
    )
    ap.add_argument("--replays", type=int, default=50, help="graph replays timed per batch size")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="also list the decode graph's kernels (count, device time, the costliest) for each batch size",
    )
    ap.add_argument("--hbm-gbps", type=float, default=4000.0, help="memory bandwidth of the floor (H200: 4000)")
    ap.add_argument("--out", type=Path, default=Path("bench/results/step.json"), help="JSON results file")
    args = ap.parse_args(argv)
    try:
        args.batch = [int(b) for b in args.batch.split(",") if b.strip()]
    except ValueError:
        ap.error(f"--batch must be comma-separated integers, got {args.batch!r}")
    if not args.batch or min(args.batch) < 1 or args.prompt_len < 1 or args.gen_len < 2 or args.replays < 1:
        ap.error("--batch values, --prompt-len and --replays must be >= 1, --gen-len >= 2")
    if args.beside < 0:
        ap.error("--beside must be >= 0")
    return args


class PhaseClock:
    """Wraps the engine's methods (instance attributes) to time each phase of every step."""

    def __init__(self, eng):
        self.eng, self.steps = eng, []
        # Every step's (decodes, prompt pieces, seconds): what `beside` reads.
        self.shapes: list[tuple[int, int, float]] = []
        self._cur: dict[str, float] | None = None  # the step's seconds by phase, while one runs
        self._decode = False  # whether the running step is a decode step
        self._shape = (0, 0)
        step, sched = eng._step, eng.sched
        schedule = sched.schedule

        def timed_step(has_work):
            self._cur, self._decode = defaultdict(float), False
            t0 = time.perf_counter()
            step(has_work)
            total = time.perf_counter() - t0
            cur, self._cur = self._cur, None
            self.shapes.append((*self._shape, total))
            if self._decode:
                self.steps.append({"total": total, **{p: cur[p] for p in PHASES}})

        def timed_schedule():
            work = self._time("schedule", schedule)
            self._decode = bool(work) and all(n == 1 for _, n in work)
            prompts = sum(1 for _, n in work if n > 1)
            self._shape = (len(work) - prompts, prompts)
            return work

        eng._step = timed_step
        sched.schedule = timed_schedule
        self._wrap(eng.comm, "all_to_all", "header", first_only=True)
        self._wrap(sched, "rows", "inputs")
        self._wrap(eng, "_sample_params", "inputs")
        if eng.graphs is not None:
            self._wrap(eng.graphs, "run", "launch")
        self._wrap(eng.model, "forward", "launch")
        self._wrap(eng, "_settle", "wait")
        self._wrap(sched, "update", "update")

    def _time(self, phase, fn, *a, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            if self._cur is not None:
                self._cur[phase] += time.perf_counter() - t0

    def _wrap(self, obj, name, phase, first_only=False):
        fn = getattr(obj, name)

        def timed(*a, **kw):
            if first_only and self._cur is not None and self._cur.get(phase):
                return fn(*a, **kw)  # the MoE exchange of an eager step, not the header
            return self._time(phase, fn, *a, **kw)

        setattr(obj, name, timed)


def beside(eng, clock: PhaseClock, prompts: list[list[int]], gen_len: int, prompt: list[int]) -> dict:
    """`prompts` decoding while one `prompt` at a time (one token out) joins them; the steps of
    every decode and one prompt piece against those of every decode alone."""
    from harness.reference import submit_all

    clock.shapes.clear()
    done = submit_all(eng, prompts, gen_len, ignore_eos=True)
    finished = threading.Event()
    feeder = threading.Thread(target=lambda: [submit_all(eng, [prompt], 1)(600) for _ in iter(finished.is_set, True)])
    feeder.start()
    try:
        done(600)
    finally:
        finished.set()
        feeder.join()
    # On CUDA a step's wait is for the step queued before it; on the CPU a step computes as it is
    # queued, so its interval is its own.
    lag = 1 if eng.device.type == "cuda" else 0
    b, shapes = len(prompts), clock.shapes
    pairs = [((d, p), t) for (d, p, _), (*_, t) in zip(shapes, shapes[lag:])]
    mixed = [t for shape, t in pairs if shape == (b, 1)]
    decode = [t for shape, t in pairs if shape == (b, 0)]
    if not mixed or not decode:
        return {"prompt_tokens": len(prompt), "mixed_steps": len(mixed), "decode_steps": len(decode)}
    m, d = statistics.median(mixed) * 1e3, statistics.median(decode) * 1e3
    return {
        "prompt_tokens": len(prompt),
        "mixed_steps": len(mixed),
        "decode_steps": len(decode),
        "mixed_ms_p50": m,
        "decode_ms_p50": d,
        "us_per_prompt_token": (m - d) * 1e3 / len(prompt),
    }


def graph_ms(eng, batch: int, replays: int) -> float | None:
    """The decode graph of `batch` replayed alone: median ms, a sync around each replay."""
    if eng.graphs is None or batch > eng.graphs.sizes[-1]:
        return None
    fb = graph_rows(eng, batch)
    return median_ms(lambda: eng.graphs.run(fb), replays)  # on the loop thread: its device is current


def graph_rows(eng, batch: int):
    from components.engine.models.layers import StepRows

    slots = list(range(batch))
    # Distinct tokens, so that rows spread over the experts as a real batch's do (one token
    # repeated routes every row to the same two).
    ids = torch.randint(0, eng.model_config.vocab_size, (batch,), generator=torch.Generator().manual_seed(batch))
    return StepRows(ids.tolist(), [100] * batch, slots, slots, [101] * batch, slots, [1] * batch)


def kernel_profile(eng, batch: int, replays: int, top: int = 12) -> dict:
    """The kernels of one replay of the decode graph (CUPTI through torch.profiler): how many,
    their device time, and the `top` kernels by device time."""
    from torch.profiler import ProfilerActivity, profile

    step = graph_rows(eng, batch)
    eng.graphs.run(step)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            eng.graphs.run(step)
            torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA" and e.device_time_total > 0]
    per = sorted(
        ((e.key, e.device_time_total / replays / 1e3, e.count / replays) for e in kernels), key=lambda k: -k[1]
    )
    return {
        "kernels": sum(c for _, _, c in per),
        "device_ms": sum(t for _, t, _ in per),
        "top": [{"kernel": k[:90], "ms": t, "launches": c} for k, t, c in per[:top]],
    }


def weight_bytes(eng) -> int:
    return sum(p.numel() * p.element_size() for p in eng.model.parameters()) + sum(
        b.numel() * b.element_size() for _, moe in eng.model.moe_layers for b in (moe.w_gate, moe.w_up, moe.w_down)
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    from components.engine.models.builtin import builtin_model_dir
    from harness.reference import single_rank, submit_all

    model = args.model or str(builtin_model_dir())
    top = max(args.batch)
    # Mixed: a graph for every measured batch, each step timed through its own size.
    sizes = None if args.batch_invariant else tuple(sorted({*(1, 8, 16, 32, 64), *args.batch} & set(range(1, top + 1))))
    eng = single_rank(
        model,
        device=args.device,
        max_len=args.max_len,
        max_seqs=top + (args.beside > 0),
        max_batched_tokens=max(256, args.prompt_len, args.beside),
        dtype=args.dtype,
        batch_invariant=args.batch_invariant,
        cuda_graph_sizes=sizes,
    )
    if max(args.prompt_len + args.gen_len, args.beside + 1) > eng.max_len:
        raise SystemExit(
            f"--prompt-len + --gen-len (or --beside) exceed the KV cache's {eng.max_len} tokens: raise --max-len"
        )
    clock = PhaseClock(eng)
    eng.start()
    vocab, g = eng.model_config.vocab_size, torch.Generator().manual_seed(0)
    floor_ms = weight_bytes(eng) / (args.hbm_gbps * 1e9) * 1e3
    rows = []
    try:
        submit_all(eng, [[1, 2, 3]], 4, ignore_eos=True)(600)  # warmup: first kernels, allocator
        for b in args.batch:
            prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(b)]
            clock.steps.clear()
            t0 = time.perf_counter()
            submit_all(eng, prompts, args.gen_len, ignore_eos=True)(600)
            wall = time.perf_counter() - t0
            full = list(clock.steps)
            p50 = {k: statistics.median(s[k] for s in full) * 1e3 for k in ("total", *PHASES)}
            totals = sorted(s["total"] for s in full)
            gms = eng.call(lambda b=b: graph_ms(eng, b, args.replays)).result(600) if eng.graphs else None
            prof = None
            if args.profile and eng.graphs:
                prof = eng.call(lambda b=b: kernel_profile(eng, b, args.replays)).result(600)
                print(f"batch {b}: {prof['kernels']:.0f} kernels, {prof['device_ms']:.3f} ms of device time a replay")
                for k in prof["top"]:
                    print(f"  {k['ms']:.4f} ms  x{k['launches']:.0f}  {k['kernel']}")
            side = None
            if args.beside:
                prompt = torch.randint(0, vocab, (args.beside,), generator=g).tolist()
                side = beside(eng, clock, prompts, args.gen_len, prompt)
            rows.append(
                {
                    "batch": b,
                    "decode_steps": len(full),
                    "step_ms_p50": p50["total"],
                    "step_ms_p99": totals[min(len(totals) - 1, int(0.99 * len(totals)))] * 1e3,
                    "phase_ms_p50": {p: p50[p] for p in PHASES},
                    "graph_ms": gms,
                    "floor_ms": floor_ms,
                    "tok_s": b * len(full) / sum(totals) if totals else None,
                    "wall_s": wall,
                    **({"profile": prof} if prof else {}),
                    **({"beside": side} if side else {}),
                }
            )
    finally:
        eng.stop()
    print(table(rows, args))
    for r in rows:
        if "mixed_ms_p50" in r.get("beside", {}):
            x = r["beside"]
            print(
                f"batch {r['batch']} beside one {x['prompt_tokens']}-token prompt: {x['mixed_ms_p50']:.2f} ms a step "
                f"({x['mixed_steps']}) against {x['decode_ms_p50']:.2f} ms decoding alone ({x['decode_steps']}): "
                f"{x['us_per_prompt_token']:.2f} us a prompt token"
            )
    result = {
        "benchmark": "bench.step",
        "command": "python -m bench.step " + " ".join(argv if argv is not None else __import__("sys").argv[1:]),
        "model": model,
        "device": torch.cuda.get_device_name(eng.device) if eng.device.type == "cuda" else platform.processor(),
        "dtype": str(eng.dtype),
        "max_len": eng.max_len,
        "batch_invariant": args.batch_invariant,
        "graph_sizes": eng.graphs.sizes if eng.graphs else [],
        "weight_bytes": weight_bytes(eng),
        "hbm_gbps": args.hbm_gbps,
        "rows": rows,
    }
    result["kv_bytes_per_token"] = kv_bytes(eng)
    print(
        "KV cache bytes per token (all layers): "
        + ", ".join(f"{k} {v:,}" for k, v in result["kv_bytes_per_token"].items())
    )
    write_results(args.out, result)
    return 0


def kv_bytes(eng) -> dict[str, int]:
    """What the cache keeps a token, and for MLA what expanded per-head keys and values would."""
    from components.engine.models.deepseek_v3 import DeepseekParams, expanded_kv_layout
    from components.engine.models.registry import family

    mc, size = eng.model_config, eng.dtype.itemsize
    out = {"cache": family(mc).kv_layout(mc).bytes_per_token(mc.num_layers, size)}
    if isinstance(mc.params, DeepseekParams):
        out["expanded_heads"] = expanded_kv_layout(mc).bytes_per_token(mc.num_layers, size)
    return out


def table(rows, args) -> str:
    head = ["batch", "step p50 ms", "step p99 ms", *PHASES, "graph ms", "floor ms", "step/floor", "graph/floor"]
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in rows:
        ph, g, f = r["phase_ms_p50"], r["graph_ms"], r["floor_ms"]
        cells = [str(r["batch"]), f"{r['step_ms_p50']:.2f}", f"{r['step_ms_p99']:.2f}"]
        cells += [f"{ph[p]:.3f}" for p in PHASES]
        cells += [f"{g:.2f}" if g else "-", f"{f:.2f}", f"{r['step_ms_p50'] / f:.2f}x", f"{g / f:.2f}x" if g else "-"]
        lines.append(" | ".join(cells))
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
