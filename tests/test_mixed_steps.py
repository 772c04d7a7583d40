"""Batch-invariant mixed steps: prompts of many lengths arriving while others decode share steps
with those decodes and with each other (Scheduler.mixed_steps counts such steps), and every
completion, greedy or seeded, is the one the same request gets alone on one rank, on 1 rank and on
2 and 4 (EP). On CUDA the same through the mixed graph (cuda_graphs.py)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from components.engine.request import GenerateRequest
from harness.reference import generate, make_checkpoint, single_rank
from tests.test_engine import ARCHS, run_peers

MAX_NEW = 12
LIMITS = dict(max_seqs=8, max_batched_tokens=64, max_len=256)  # prompts past the budget, slots to wait for
SEEDED = {"temperature": 0.8, "top_p": 0.9, "top_k": 20}


def workload() -> tuple[list[list[int]], list[dict]]:
    """24 prompts of 1..200 tokens (the budget is 64), every other one seeded."""
    g = torch.Generator().manual_seed(3)
    lengths = [1, 200, 2, 64, 65, 130, 3, 17, 128, 5, 190, 1, 40, 63, 9, 150, 2, 33, 71, 4, 100, 1, 12, 199]
    prompts = [torch.randint(1, 128, (n,), generator=g).tolist() for n in lengths]
    sampling = [{**SEEDED, "seed": 1000 + i} if i % 2 else {} for i in range(len(prompts))]
    return prompts, sampling


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """The checkpoint and each request's completion alone on one rank."""
    path = make_checkpoint("mixtral", tmp_path_factory.mktemp("mixtral"))
    prompts, sampling = workload()
    eng = single_rank(path, "cpu", **LIMITS)
    eng.start()
    try:
        alone = [generate(eng, [p], MAX_NEW, ignore_eos=True, **kw)[0][0] for p, kw in zip(prompts, sampling)]
        assert eng.sched.mixed_steps == 0  # nothing ever shared a step
    finally:
        eng.stop()
    return path, prompts, sampling, alone


def submit_staggered(eng, prompts, sampling, gap_s: float) -> dict[str, list[int]]:
    """Each prompt `gap_s` after the one before, so they arrive while earlier ones decode."""
    outs, ends, done = {}, set(), threading.Event()

    def emit(o):
        outs.setdefault(o.request_id, []).extend(o.token_ids)
        if o.finish_reason:
            ends.add(o.request_id)
            if len(ends) == len(prompts):
                done.set()

    for i, (p, kw) in enumerate(zip(prompts, sampling)):
        eng.submit(GenerateRequest(str(i), p, MAX_NEW, ignore_eos=True, **kw), emit)
        time.sleep(gap_s)
    assert done.wait(120), f"only {len(ends)} of {len(prompts)} requests finished"
    return outs


@pytest.mark.parametrize(
    "device,piece",
    [("cpu", 64), pytest.param("cuda", 64, marks=pytest.mark.gpu), pytest.param("cuda", 16, marks=pytest.mark.gpu)],
)
def test_mixed_steps_on_one_rank_match_each_request_alone(case, device, piece):
    """On CUDA with the budget in one piece (one mixed graph), and in four (a mixed step runs in
    the smallest of four graphs that holds its prompt rows, each prompt row in a GEMM of 16)."""
    path, prompts, sampling, alone = case
    eng = single_rank(path, device, prompt_piece=piece, **LIMITS)
    eng.start()
    try:
        eng.pause().result(30)  # the first eight enter one step together
        for i in range(8):
            eng.submit(GenerateRequest(f"b{i}", prompts[i], MAX_NEW, ignore_eos=True, **sampling[i]), lambda o: None)
        eng.resume().result(30)
        outs = submit_staggered(eng, prompts, sampling, 0.005)
        if device == "cuda":
            again = generate(eng, prompts, MAX_NEW, ignore_eos=True)[0]  # all at once, greedy
    finally:
        eng.stop()
    assert eng.sched.mixed_steps > 0  # prompt tokens did share steps with decodes and other prompts
    assert [i for i in range(len(prompts)) if outs[str(i)] != alone[i]] == []
    if device == "cuda":
        assert eng.graphs.sizes == [8, *range(8 + piece, 8 + 64 + 1, piece)]
        greedy = [i for i, kw in enumerate(sampling) if not kw]
        assert [i for i in greedy if again[i] != alone[i]] == []


@pytest.mark.parametrize("world", [2, 4])
def test_mixed_steps_on_ranks_match_each_request_alone(case, world, tmp_path):
    path, prompts, sampling, alone = case
    plan = {
        "world": world,
        "model": str(path),
        "prompts": prompts,
        "sampling": sampling,
        "max_tokens": MAX_NEW,
        **LIMITS,
        "phases": [{"active": list(range(world)), "stagger_s": 0.005}],
    }
    reports = run_peers(tmp_path, plan)
    tokens = {k: v for rep in reports for k, v in rep[0]["tokens"].items()}
    assert sum(rep[0]["mixed_steps"] for rep in reports) > 0
    assert [i for i in range(len(prompts)) if tokens[str(i)] != alone[i]] == []


def test_a_split_projection_computes_each_part_as_a_call_of_its_own():
    """Under rows_split_at(n) (a mixed graph's capture) a projection's first n rows are what a
    call over those n rows alone gives (a decode-only step's), and the rest what a call over them
    alone gives (the prompt capacity's), bit for bit; outside it one call over every row."""
    from components.engine.models.layers import SplitLinear, rows_split_at

    torch.manual_seed(0)
    lin = SplitLinear(48, 80)
    x = torch.randn(8 + 64, 48)
    with rows_split_at(8):
        got = lin(x)
        assert torch.equal(lin(x[:5]), torch.nn.functional.linear(x[:5], lin.weight, lin.bias))  # no split below n
    assert torch.equal(got[:8], lin(x[:8])) and torch.equal(got[8:], lin(x[8:]))
    assert torch.equal(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_every_family_in_bf16_completes_each_request_as_alone_whatever_shares_its_steps(arch, device, tmp_path):
    """bf16, where a rounding a step apart flips tokens: prompts of 1 to 300 tokens all at once
    (decode-only steps whose rows' contexts differ by hundreds, mixed steps), each greedy
    completion against the same prompt alone. A decode's attention over keys padded to the step's
    longest context changed completions of the per-head q/k-norm families here (Qwen3, GLM)."""
    path = make_checkpoint(arch, tmp_path / arch, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    lengths = [1, 300, 7, 180, 2, 250, 33, 90, 1, 270, 15, 140, 3, 220, 60, 5]
    prompts = [torch.randint(3, 120, (n,), generator=g).tolist() for n in lengths]
    eng = single_rank(path, device, max_len=512, max_seqs=16, dtype="bfloat16")
    eng.start()
    try:
        alone = [generate(eng, [p], 40, ignore_eos=True)[0][0] for p in prompts]
        together = generate(eng, prompts, 40, ignore_eos=True)[0]
    finally:
        eng.stop()
    assert [i for i in range(len(prompts)) if together[i] != alone[i]] == []
