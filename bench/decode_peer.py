"""One engine rank of the decode benchmark, in its own process (driven by `bench.decode`).

Same protocol as the multi-rank engine tests: the driver writes plan.json into a temp dir; peers
exchange communicator metadata through files there, connect, install the active set and expert
placement while paused, then run, for each batch size of the plan, a warmup phase and a measured
phase. Each phase starts behind a file barrier so that every rank submits its batch at about the
same moment, and ends behind one so that no rank stops stepping (idle ranks run dummy steps) while a
peer still generates. The rank pauses, writes its report, and waits for every report before it exits.

For the floor the driver computes, the report also carries the bytes of the dense weights and of
one expert, the experts in this rank's slots, and the routing counts (`SparseMoE.load`) of each
measured phase.

Step timing wraps this instance's `_step` (the engine code is untouched): the wall time of one
engine step, header all-to-all included, recorded for forward steps only.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import torch

from components.engine.rank import EngineRank, RankConfig
from components.engine.request import GenerateRequest
from harness.peers import wait_for, write


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--dir", type=Path, required=True)
    args = ap.parse_args()
    d = args.dir
    plan = json.loads((d / "plan.json").read_text())
    rank, world, timeout = args.rank, plan["world"], plan["timeout_s"]
    if plan["threads"] > 0:
        torch.set_num_threads(plan["threads"])
    batches = plan["batches"]
    eng = EngineRank(
        RankConfig(
            rank=rank,
            max_ranks=world,
            device=plan["devices"][rank],
            dtype=plan["dtype"],
            max_seqs=max(batches),
            max_len=plan["max_len"],
            min_ranks=plan["min_ranks"],
            cuda_graph_sizes=tuple(plan["graph_sizes"]),
            ep_timeout_s=plan["ep_timeout_s"],
            ep_transport=plan["ep_transport"],
        ),
        plan["model"],
    )
    write(d / f"meta{rank}", eng.comm.metadata())
    wait_for([d / f"meta{r}" for r in range(world)], timeout)
    eng.comm.connect({r: (d / f"meta{r}").read_bytes() for r in range(world) if r != rank})

    # steps[i] = (t0, t1) of forward step i on this rank (eng.steps is bumped before the forward,
    # so tokens emitted during a step carry that step's index).
    steps: dict[int, tuple[float, float]] = {}
    orig_step = eng._step

    def timed_step(has_work: bool) -> None:
        n = eng.steps
        t0 = time.monotonic()
        orig_step(has_work)
        t1 = time.monotonic()
        if eng.steps != n:
            steps[eng.steps] = (t0, t1)

    eng._step = timed_step  # instance attribute: the loop calls self._step
    vocab = eng.model_config.vocab_size
    active = list(range(world))
    eng.comm.set_active([], 0)
    eng.start()
    eng.pause().result(timeout=timeout)
    placement = eng.default_placement(active)

    def install():
        eng.configure(1, active, placement)
        eng.load_experts(placement)

    eng.call(install).result(timeout=timeout)
    eng.resume().result(timeout=timeout)

    moes = eng.model.moe_layers
    measured = {}
    lengths = (("warmup", plan["warmup_len"]), ("measure", plan["gen_len"]))
    phases = [(b, phase, n) for b in batches for phase, n in lengths]
    for batch, phase, gen_len in phases:
        if gen_len <= 0:
            continue
        tag = f"{phase}.{batch}"
        g = torch.Generator().manual_seed(plan["seed"] * 1_000_003 + rank * 7919 + (phase == "measure") + 2 * batch)
        prompts = torch.randint(0, vocab, (batch, plan["prompt_len"]), generator=g).tolist()
        if phase == "measure":
            eng.call(lambda: [m.load.zero_() for _, m in moes]).result(timeout=timeout)
        emissions: list[tuple[int, int, bool]] = []  # (step index, tokens, is the sequence's first token)
        seen: set[str] = set()
        ended: list[str] = []
        done = threading.Event()

        def emit(o, n=len(prompts)):
            first = o.request_id not in seen
            seen.add(o.request_id)
            emissions.append((eng.steps, len(o.token_ids), first))
            if o.finish_reason:
                ended.append(o.finish_reason)
                if len(ended) == n:
                    done.set()

        write(d / f"ready.{tag}.{rank}", b"")
        wait_for([d / f"ready.{tag}.{r}" for r in range(world)], timeout)
        t_submit = time.monotonic()
        for i, p in enumerate(prompts):
            eng.submit(GenerateRequest(f"{rank}.{i}", p, max_tokens=gen_len, ignore_eos=True), emit)
        if not done.wait(timeout):
            raise TimeoutError(f"rank {rank}: {len(ended)} of {len(prompts)} requests finished in {phase}")
        write(d / f"done.{tag}.{rank}", b"")
        wait_for([d / f"done.{tag}.{r}" for r in range(world)], timeout)
        if phase == "measure":
            load = eng.call(lambda: [m.load.tolist() for _, m in moes]).result(timeout=timeout)
            measured[batch] = (emissions, ended, t_submit, load)
    # Pausing parks the loop thread at a step boundary: every step's timing is recorded by now.
    eng.pause().result(timeout=timeout)
    runs = []
    for batch, (emissions, ended, t_submit, load) in measured.items():
        # Decode phase on this rank: the steps after the one that gave the last sequence its first token.
        prefill_step = max(s for s, _, f in emissions if f)
        last_step = max(s for s, _, _ in emissions)
        decode_tokens = sum(n - f for s, n, f in emissions if s > prefill_step)
        decode_steps = [steps[s] for s in range(prefill_step + 1, last_step + 1) if s in steps]
        runs.append(
            {
                "batch": batch,
                "finish_reasons": sorted(set(ended)),
                "t_submit": t_submit,
                "t_prefill_done": steps[prefill_step][1],
                "t_decode_end": steps[last_step][1],
                "decode_tokens": decode_tokens,
                "total_tokens": sum(n for _, n, _ in emissions),
                "decode_steps": len(decode_steps),
                "step_ms": [(t1 - t0) * 1e3 for t0, t1 in decode_steps],
                "load": load,
            }
        )
    mc, (_, moe0) = eng.model_config, moes[0]
    params = dict(eng.model.named_parameters())
    if not mc.tie_word_embeddings:  # a lookup reads batch rows, not the table
        params.pop("model.embed_tokens.weight")
    report = {
        "rank": rank,
        "device": str(eng.device),
        "device_name": torch.cuda.get_device_name(eng.device) if eng.device.type == "cuda" else "cpu",
        "graph_sizes": eng.graphs.sizes if eng.graphs else [],
        "dense_bytes": sum(t.numel() * t.element_size() for t in params.values()),
        "expert_bytes": sum(w[0].numel() * w.element_size() for w in (moe0.w_gate, moe0.w_up, moe0.w_down)),
        "top_k": mc.top_k,
        "local_experts": [placement.experts_on(rank, layer) for layer, _ in moes],
        "torch_threads": torch.get_num_threads(),
        "runs": runs,
    }
    write(d / f"report{rank}.json", json.dumps(report).encode())
    wait_for([d / f"report{r}.json" for r in range(world)], timeout)
    eng.stop()


if __name__ == "__main__":
    main()
