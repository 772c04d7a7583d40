"""Consistency under load: `dynamo serve graphs/elastic:Frontend` (options after `--`) under
`--clients` streaming clients that send a fixed-seed set of `--prompts` prompts of mixed lengths
(log-uniform from 1 to `--max-prompt` tokens), half greedy and half sampled with a seed of their
own, `--max-tokens` out each, while the deployment runs at each of `--sizes` for `--phase-s`
seconds and scales from one size to the next under the same traffic. Every completion is compared
with the same request run alone on the in-process engine configured as the graph's rank 0 (model,
dtype, limits, MoE exchange: the worker's own rank_config of the options after `--`, resolved as
`dynamo serve` resolves them).

Per phase (each size, and each scale between two: the requests that overlap the operation, from
the /scale request to its reply): requests completed and failed, greedy and seeded completions
that differ from the request alone, and for a scale its record's downtime (first pause request to
last resume reply) and that of the rebalance after it. Prints a table, writes JSON (`--out`) and
exits 1 if a completion changed, a request failed, a scale did not end done or a phase completed
nothing.

    python -m bench.consistency                        # CPU, built-in model: bench/results/consistency_cpu.json
    python -m bench.consistency --phase-s 30 -- --Worker.model=/tmp/mxl --Worker.device=cuda \\
        --Worker.dtype=bfloat16 --Worker.max_ranks=2 --Worker.max_seqs=32   # consistency_cuda.json
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from pathlib import Path

import msgspec

from bench.measure import write_results
from components.engine.models.builtin import builtin_model_dir
from components.engine.models.registry import read_config
from components.graph.component import graph_components
from components.graph.serve import UsageError, parse_overrides, resolve_configs
from components.worker.component import rank_config
from graphs.elastic import Frontend
from harness.server import Server, Traffic, engine_reference, failure_reasons, scale

# Not exact in float32, which is what the engine samples with (Sampling's tensors): the reference
# gets these Python floats, the served request the frontend's float32 copy, the same float32 both.
SAMPLED = {"temperature": 0.8, "top_p": 0.9}
ERROR_PAUSE_S = 0.25  # a client's pause after a failed request: an outage costs countable failures
# What the JSON keeps of each scale's record.
OP_FIELDS = (
    "id",
    "kind",
    "from_size",
    "to_size",
    "phase",
    "error",
    "downtime_s",
    "rebalance_downtime_s",
    "total_s",
    "handed_over",
    "joined_from",
    "parked",
)


def worker_config(options: list[str]):
    """The Worker's configuration `dynamo serve graphs/elastic:Frontend` resolves from `options`
    (an unknown component or field is the same usage error it would be there)."""
    return resolve_configs(graph_components(Frontend), {}, parse_overrides(options))["Worker"]


def requests(seed: int, n: int, max_prompt: int, vocab: int) -> tuple[list[list[int]], list[dict]]:
    """`n` prompts of log-uniform lengths in 1..max_prompt (token ids 3.., clear of the special
    ones) and their sampling: the first half greedy, the second sampled, prompt i with seed
    `seed * 1000 + i`. A client sends prompts `clients` apart (Traffic), so with an even count of
    clients each alternates a greedy and a sampled request."""
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(3, vocab) for _ in range(round(math.exp(rng.uniform(0.0, math.log(max_prompt)))))]
        for _ in range(n)
    ]
    sampling = [{} if i < n // 2 else {**SAMPLED, "seed": seed * 1000 + i} for i in range(n)]
    return prompts, sampling


def settle(phases: list[dict], results, errors, reference: list[str], sampling: list[dict]) -> None:
    """Charge each phase its requests. A completion that overlaps a scale's window belongs to that
    scale (the first one it overlaps), any other to the size whose window it ended in (the last
    one if it ended after it, as the traffic stopped); a failure to the phase it failed in
    (`errors_at`: the failures recorded when the phase began)."""
    scales = [ph for ph in phases if "operation" in ph]
    for ph in phases:
        ph |= {"completed": 0, "greedy": 0, "seeded": 0, "greedy_changed": 0, "seeded_changed": 0, "changed": []}
    for p, text, t0, t1 in results:
        ph = next((s for s in scales if t0 < s["t_end"] and t1 > s["t_start"]), None)
        if ph is None:
            ph = next((s for s in phases if "operation" not in s and t1 < s["t_end"]), phases[-1])
        kind = "seeded" if sampling[p] else "greedy"
        ph["completed"] += 1
        ph[kind] += 1
        if text != reference[p]:
            ph[f"{kind}_changed"] += 1
            ph["changed"].append({"prompt": p, "got": text, "alone": reference[p]})
    marks = [ph.pop("errors_at") for ph in phases] + [len(errors)]
    for ph, e0, e1 in zip(phases, marks, marks[1:]):
        ph["failed"], ph["failure_reasons"] = e1 - e0, failure_reasons(errors[e0:e1])


def bad(phases: list[dict]) -> bool:
    return any(
        ph["failed"] or ph["greedy_changed"] or ph["seeded_changed"] or not ph["completed"] for ph in phases
    ) or any(ph["operation"]["phase"] != "done" for ph in phases if "operation" in ph)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1,2,1", help="the sizes in turn, scaling between them (default %(default)s)")
    p.add_argument("--clients", type=int, default=32, help="streaming clients (default %(default)s)")
    p.add_argument("--phase-s", type=float, default=30.0, help="seconds at each size (default %(default)s)")
    p.add_argument("--prompts", type=int, default=64, help="distinct prompts (default %(default)s)")
    p.add_argument(
        "--max-prompt",
        type=int,
        default=0,
        help="longest prompt, tokens (default 1024 on CUDA, 512 on CPU; at most the context less --max-tokens)",
    )
    p.add_argument("--max-tokens", type=int, default=64, help="tokens out per request (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="draws the prompts; the sampled ones' seeds (default 0)")
    p.add_argument("--out", type=Path, default=None, help="JSON (default bench/results/consistency_{cpu,cuda}.json)")
    p.add_argument("graph_args", nargs="*", help="extra `dynamo serve` options after --")
    args = p.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if len(sizes) < 2 or any(a == b for a, b in zip(sizes, sizes[1:])):
        p.error("--sizes: two sizes at least, each different from the one before")
    if args.prompts < 2:
        p.error("--prompts: 2 at least (half greedy, half sampled)")
    options = [f"--Worker.dp_size={sizes[0]}", "--Planner.enabled=false", *args.graph_args]
    try:
        worker = worker_config(options)
    except UsageError as e:
        p.error(str(e))
    if not worker.min_ranks <= min(sizes) <= max(sizes) <= worker.max_ranks:
        p.error(f"--sizes must lie in Worker.min_ranks..max_ranks ({worker.min_ranks}..{worker.max_ranks})")
    out = args.out or Path(f"bench/results/consistency_{worker.device}.json")
    model_dir = Path(worker.model) if worker.model else builtin_model_dir()
    model = read_config(model_dir / "config.json")
    # The model's positions when Worker.max_len is unset (a rank may cap it lower to fit its KV
    # cache in memory; then the graph refuses the longest prompts and says so).
    context, context_from = (
        (worker.max_len, "Worker.max_len") if worker.max_len else (model.max_position_embeddings, "the model's context")
    )
    max_prompt = args.max_prompt or min(1024 if worker.device == "cuda" else 512, context - args.max_tokens)
    if max_prompt < 1 or max_prompt + args.max_tokens > context:
        p.error(f"--max-prompt + --max-tokens ({max_prompt + args.max_tokens}) exceed {context_from} ({context})")
    prompts, sampling = requests(args.seed, args.prompts, max_prompt, model.vocab_size)
    # Alone: one request at a time on the graph's rank 0 as the worker configures it (its dtype
    # matters; its batch limits must not, nor its MoE exchange, which follows max_ranks and the
    # GPUs: a difference is then the load's or the scale's, not the configuration's).
    rank0 = msgspec.structs.asdict(rank_config(worker, 0))
    config = dict(rank0)
    t = time.time()
    reference = engine_reference(
        prompts,
        args.max_tokens,
        max_len=config.pop("max_len"),
        device=config.pop("device"),
        model_dir=model_dir,
        sampling=sampling,
        **config,
    )
    reference_s = time.time() - t
    print(f"consistency: {len(prompts)} requests alone in {reference_s:.1f} s", file=sys.stderr, flush=True)

    srv = Server(options, boot_timeout_s=600, model=None)
    print(f"consistency: the graph's log is {srv.log_path}", file=sys.stderr, flush=True)
    phases: list[dict] = []
    traffic = Traffic(srv, prompts, args.max_tokens, args.clients, error_pause_s=ERROR_PAUSE_S, sampling=sampling)

    def begin(name: str, **kw) -> dict:
        if phases:
            phases[-1]["t_end"] = time.time()
        phases.append({"phase": name, "t_start": time.time(), "errors_at": len(traffic.errors), **kw})
        print(f"consistency: {name}", file=sys.stderr, flush=True)
        return phases[-1]

    try:
        with traffic:
            begin(f"size {sizes[0]}", size=sizes[0])
            time.sleep(args.phase_s)
            for a, b in zip(sizes, sizes[1:]):
                ph = begin(f"scaling {a} -> {b}")
                op = scale(srv, b)
                ph["operation"] = {k: op[k] for k in OP_FIELDS}
                ph["active_after"] = srv.topology()["active"]
                begin(f"size {b}", size=b)
                time.sleep(args.phase_s)
            phases[-1]["t_end"] = time.time()
    finally:
        srv.stop()
    settle(phases, traffic.results, traffic.errors, reference, sampling)
    for ph in phases:
        ph["seconds"] = round(ph.pop("t_end") - ph.pop("t_start"), 2)
    keys = ("completed", "failed", "greedy", "greedy_changed", "seeded", "seeded_changed")
    result = {
        "command": " ".join(["python -m bench.consistency", *sys.argv[1:]]),
        "non_default_options": options,
        "rank0": {"model": str(model_dir), **rank0},  # as the worker configures it, and the reference
        "requests": {
            "clients": args.clients,
            "prompts": len(prompts),
            "prompt_lengths": [len(q) for q in prompts],
            "greedy": sum(1 for s in sampling if not s),
            "seeded": {**SAMPLED, "prompts": sum(1 for s in sampling if s)},
            "max_tokens": args.max_tokens,
            "seed": args.seed,
        },
        "scaling": {"sizes": sizes, "phase_s": args.phase_s},
        "reference_s": round(reference_s, 2),
        "phases": phases,
        "totals": {k: sum(ph[k] for ph in phases) for k in keys},
    }
    write_results(out, result)
    report(result)
    sys.exit(1 if bad(phases) else 0)


def report(result: dict) -> None:
    def ms(op: dict | None, key: str) -> str:
        return "-" if op is None or op[key] is None else f"{op[key] * 1e3:.1f}"

    print(
        "options that differ from `dynamo serve graphs/elastic:Frontend`'s defaults: "
        + " ".join(result["non_default_options"])
    )
    r = result["requests"]
    print(
        f"{r['clients']} clients, {r['prompts']} prompts of {min(r['prompt_lengths'])}-{max(r['prompt_lengths'])} "
        f"tokens ({r['greedy']} greedy, {r['seeded']['prompts']} seeded), {r['max_tokens']} tokens out"
    )
    print(
        "| phase | s | completed | failed | greedy changed | seeded changed | operation | downtime ms | "
        "rebalance ms | handed over |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for ph in result["phases"]:
        op = ph.get("operation")
        what = "-" if op is None else f"{op['kind']} {op['from_size']} -> {op['to_size']}: {op['phase']}"
        print(
            f"| {ph['phase']} | {ph['seconds']:.1f} | {ph['completed']} | {ph['failed']} | "
            f"{ph['greedy_changed']} of {ph['greedy']} | {ph['seeded_changed']} of {ph['seeded']} | {what} | "
            f"{ms(op, 'downtime_s')} | {ms(op, 'rebalance_downtime_s')} | {'-' if op is None else op['handed_over']} |"
        )
    t = result["totals"]
    print(
        f"| total | | {t['completed']} | {t['failed']} | {t['greedy_changed']} of {t['greedy']} | "
        f"{t['seeded_changed']} of {t['seeded']} | | | | |"
    )


if __name__ == "__main__":
    main()
