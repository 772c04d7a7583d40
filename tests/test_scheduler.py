"""The scheduler's two policies: which sequences share a step, and how prompts are cut."""

from __future__ import annotations

from components.engine.request import GenerateRequest
from components.engine.scheduler import Scheduler, Sequence


def add(sched: Scheduler, rid: str, prompt_len: int) -> Sequence:
    prompt = list(range(1, prompt_len + 1))
    seq = Sequence(
        req=GenerateRequest(rid, prompt, max_tokens=50, ignore_eos=True), emit=lambda o: None, tokens=list(prompt)
    )
    sched.add(seq)
    return seq


def run(sched: Scheduler, steps: int) -> list[list[tuple[str, int]]]:
    """Each step's (request, tokens) pairs; every sampled token is 7."""
    log = []
    for _ in range(steps):
        work = sched.schedule()
        log.append([(s.req.request_id, n) for s, n in work])
        sched.update(work, [7 if s.num_computed + n >= s.sample_from else None for s, n in work])
    return log


def prompt_cuts(log, rid: str) -> list[int]:
    return [n for step in log for r, n in step if r == rid and n > 1]


def test_invariant_steps_are_all_decodes_or_one_prompt_chunk():
    sched = Scheduler(max_seqs=8, max_len=4096, max_batched_tokens=256, eos_token_ids=[0], invariant=True)
    for i in range(3):
        add(sched, f"d{i}", 4)
    run(sched, 6)  # the three short prompts prefilled and decoding
    add(sched, "long", 600)
    add(sched, "short", 10)
    log = run(sched, 12)
    for step in log:
        chunks = [n for _, n in step if n > 1]
        assert chunks == [] or len(step) == 1, f"a prompt chunk shared a step: {step}"
    # Prefill and decode steps take turns while both wait, the oldest prompt first.
    assert [step[0][0] if len(step) == 1 else "decode" for step in log[:8]] == [
        "long", "decode", "long", "decode", "long", "decode", "short", "decode"
    ]  # fmt: skip
    assert prompt_cuts(log, "long") == [256, 256, 88] and prompt_cuts(log, "short") == [10]


def test_invariant_prompt_cuts_do_not_depend_on_the_load():
    def cuts(busy: int) -> list[int]:
        sched = Scheduler(max_seqs=16, max_len=4096, max_batched_tokens=100, eos_token_ids=[0], invariant=True)
        for i in range(busy):
            add(sched, f"d{i}", 3 + i)
        add(sched, "p", 333)
        return prompt_cuts(run(sched, 80), "p")

    assert cuts(0) == cuts(5) == cuts(15) == [100, 100, 100, 33]


def test_mixed_steps_put_decodes_first_and_fill_the_budget_with_prompts():
    sched = Scheduler(max_seqs=8, max_len=4096, max_batched_tokens=256, eos_token_ids=[0], invariant=False)
    for i in range(3):
        add(sched, f"d{i}", 4)
    run(sched, 2)
    add(sched, "long", 600)
    add(sched, "short", 10)
    step = run(sched, 1)[0]
    assert step[:3] == [("d0", 1), ("d1", 1), ("d2", 1)]
    assert step[3:] == [("long", 253)]  # the budget left after the decodes: the cut follows the load
