"""One engine rank in its own process, for the multi-rank engine tests.

The test writes a plan (JSON); peers exchange communicator metadata through files, then run each
phase: install the phase's active set and expert placement while paused, generate the phase's
prompts for this rank, and report tokens, the logits of every generated position and how many
expert rows this rank computed. Files, not pipes of pickles, carry everything."""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

from components.engine.rank import EngineRank, RankConfig, rank_device
from components.engine.request import GenerateRequest
from harness.peers import wait_for, write


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--dir", type=Path, required=True)
    args = ap.parse_args()
    plan = json.loads((args.dir / "plan.json").read_text())
    rank, world, d = args.rank, plan["world"], args.dir
    eng = EngineRank(
        RankConfig(
            rank=rank,
            max_ranks=world,
            device=rank_device(plan.get("device", "cpu"), rank),
            max_len=plan.get("max_len", 256),
            max_seqs=plan.get("max_seqs", 16),
            max_batched_tokens=plan.get("max_batched_tokens", 256),
            min_ranks=plan.get("min_ranks", 1),
            ep_timeout_s=60,
            # The peer-window exchange wherever it exists (CUDA), ranks sharing a GPU included:
            # slow there without MPS, but these tests are about the tokens.
            ep_transport="window",
        ),
        plan["model"],
    )
    write(d / f"meta{rank}", eng.comm.metadata())
    wait_for([d / f"meta{r}" for r in range(world)])
    eng.comm.connect({r: (d / f"meta{r}").read_bytes() for r in range(world) if r != rank})

    # Logits of each position a sequence finishes, captured where the engine computes them:
    # the model for prefill and eager decode, the decode graphs on CUDA (test-only wrapping).
    logits: dict[str, list] = {}

    def recording(fn, host):
        """`host(batch)`: the step's sequence slots and context lengths, as lists."""

        def run(batch, *args):
            out = fn(batch, *args)
            by_slot = {s.slot: s for s in eng.sched.running}
            decodes = args[1] if len(args) > 1 else None  # a mixed graph's step (DecodeGraphs.run)
            for i, (slot, ctx) in enumerate(zip(*host(batch))):
                seq = by_slot[slot]
                if ctx == len(seq.tokens) + seq.pending:  # it draws a token not yet known
                    row = eng.graphs.logits_row(i, decodes) if decodes is not None else i
                    logits.setdefault(seq.req.request_id, []).append(out[row].tolist())
            return out

        return run

    eng.model.forward = recording(eng.model.forward, lambda b: (b.slots_list, b.ctx_lens_list))
    if eng.graphs is not None:
        eng.graphs.run = recording(eng.graphs.run, lambda rows: (rows.slots, rows.ctx_lens))
    eng.comm.set_active([], 0)
    eng.start()
    report = []
    for epoch, phase in enumerate(plan["phases"], start=1):
        eng.pause().result(timeout=60)
        placement = eng.default_placement(phase["active"])

        def install():
            eng.configure(epoch, phase["active"], placement)
            eng.load_experts(placement)

        eng.call(install).result(timeout=60)
        eng.resume().result(timeout=60)
        rows0 = eng.expert_rows
        outs: dict[str, list[int]] = {}
        done = threading.Event()
        mine = (
            [(i, p) for i, p in enumerate(plan["prompts"]) if i % len(phase["active"]) == phase["active"].index(rank)]
            if rank in phase["active"]
            else []
        )

        def emit(o, n=len(mine)):
            outs.setdefault(o.request_id, []).extend(o.token_ids)
            if o.finish_reason:
                outs[o.request_id + "/end"] = o.finish_reason
                if sum(k.endswith("/end") for k in outs) == n:
                    done.set()

        sampling = plan.get("sampling") or [{}] * len(plan["prompts"])
        for i, p in mine:  # `stagger_s` apart: prompts arriving while others decode
            eng.submit(GenerateRequest(str(i), p, max_tokens=plan["max_tokens"], ignore_eos=True, **sampling[i]), emit)
            time.sleep(phase.get("stagger_s", 0))
        if mine:
            done.wait(timeout=120)
        write(d / f"done{epoch}.{rank}", b"")
        # Keep stepping (dummy steps) until every rank is done with this phase.
        wait_for([d / f"done{epoch}.{r}" for r in range(world)])
        report.append(
            {
                "tokens": {k: v for k, v in outs.items() if not k.endswith("/end")},
                "logits": {k: logits.pop(k) for k in list(logits)},
                "rows": eng.expert_rows - rows0,
                "mixed_steps": eng.sched.mixed_steps,
                "captures": eng.graphs.captures if eng.graphs else 0,
                "captures_sizes": eng.graphs.sizes if eng.graphs else [],
                "replays": eng.graphs.replays if eng.graphs else 0,
                "experts": [placement.experts_on(rank, layer) for layer in range(len(placement.slots))],
            }
        )
    eng.pause().result(timeout=60)
    write(d / f"report{rank}.json", json.dumps(report).encode())
    wait_for([d / f"report{r}.json" for r in range(world)])
    eng.stop()


if __name__ == "__main__":
    main()
