"""The scheduler's two policies: which sequences share a step, and how prompts are cut."""

from __future__ import annotations

from components.engine.request import GenerateRequest
from components.engine.scheduler import Scheduler, Sequence


def add(sched: Scheduler, rid: str, prompt_len: int, max_tokens: int = 50, ignore_eos=True, out=None) -> Sequence:
    prompt = list(range(1, prompt_len + 1))
    seq = Sequence(
        req=GenerateRequest(rid, prompt, max_tokens=max_tokens, ignore_eos=ignore_eos),
        emit=(out.append if out is not None else lambda o: None),
        tokens=list(prompt),
    )
    sched.add(seq)
    return seq


def run(sched: Scheduler, steps: int) -> list[list[tuple[str, int]]]:
    """Each step's (request, tokens) pairs; every sampled token is 7."""
    log = []
    for _ in range(steps):
        work = sched.schedule()
        log.append([(s.req.request_id, n) for s, n in work])
        positions = sched.advance(work)
        sched.update(work, positions, [7] * len(work))
    return log


def prompt_cuts(log, rid: str) -> list[int]:
    return [n for step in log for r, n in step if r == rid and n > 1]


def test_invariant_steps_carry_every_decode_and_whole_prompt_pieces_oldest_first():
    sched = Scheduler(max_seqs=8, max_len=4096, max_batched_tokens=256, eos_token_ids=[0], invariant=True)
    for i in range(3):
        add(sched, f"d{i}", 4)
    assert run(sched, 1) == [[("d0", 4), ("d1", 4), ("d2", 4)]]  # three short prompts share a step
    run(sched, 2)
    add(sched, "long", 600)
    add(sched, "short", 10)
    add(sched, "tiny", 2)
    log = run(sched, 5)
    decodes = [("d0", 1), ("d1", 1), ("d2", 1)]
    # Every step holds every decode; the prompt tokens beside them, up to the budget, in pieces
    # cut at multiples of it: "short" waits behind the older "long" until its last piece leaves
    # room, then "short" and "tiny" join it in one step.
    assert log[0] == [*decodes, ("long", 256)]
    assert log[1] == [*decodes, ("long", 256)]
    assert log[2] == [*decodes, ("long", 88), ("short", 10), ("tiny", 2)]
    assert log[3] == [*decodes, ("long", 1), ("short", 1), ("tiny", 1)]
    assert sched.mixed_steps == 1 + 3  # the first step (three prompts), and the three beside decodes


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


def test_a_step_queued_before_the_last_one_is_read_takes_its_token_from_the_device():
    """The step loop queues a step before reading the one before (EngineRank._step): a decode
    whose token is still being drawn reads it from that step's row on the device, and a
    sequence stops being scheduled once the token in flight is its last."""
    sched = Scheduler(max_seqs=4, max_len=64, max_batched_tokens=16, eos_token_ids=[0], invariant=True)
    out = []
    seq = add(sched, "a", 3, max_tokens=3, out=out)
    prefill = sched.schedule()
    first = sched.advance(prefill)  # the prefill draws token 3
    assert first == [3] and (seq.pending, seq.pending_row) == (1, 0)
    decode = sched.schedule()  # queued before the prefill's token is read
    rows = sched.rows(decode)
    assert rows.ids == [0] and rows.src == [0] and rows.positions == [3] and rows.ctx_lens == [4]
    second = sched.advance(decode)
    assert second == [4] and seq.pending == 2
    sched.update(prefill, first, [9])
    assert seq.tokens == [1, 2, 3, 9] and seq.pending == 1
    third_work = sched.schedule()
    rows = sched.rows(third_work)
    assert rows.src == [0] and rows.positions == [4]
    third = sched.advance(third_work)  # draws the third and last token
    assert sched.schedule() == [] and not sched.has_work()
    sched.update(decode, second, [8])
    sched.update(third_work, third, [7])
    assert seq.generated == [9, 8, 7] and [o.token_ids for o in out] == [[9], [8], [7]]
    assert out[-1].finish_reason == "length" and sched.running == []


def test_a_sequence_ended_by_eos_takes_nothing_from_the_step_queued_behind_it():
    sched = Scheduler(max_seqs=4, max_len=64, max_batched_tokens=16, eos_token_ids=[0], invariant=True)
    out = []
    seq = add(sched, "a", 2, max_tokens=10, ignore_eos=False, out=out)
    prefill = sched.schedule()
    first = sched.advance(prefill)
    decode = sched.schedule()
    second = sched.advance(decode)
    sched.update(prefill, first, [0])  # eos: the decode queued behind it was wasted
    assert out[-1].finish_reason == "eos" and seq.slot == -1
    sched.update(decode, second, [5])
    assert seq.generated == [0] and [o.token_ids for o in out] == [[0]]
    assert len(sched.free_slots) == 4


def test_a_discarded_step_is_retracted():
    """An exchange that gave up discards the step and the one queued behind it: the sequences
    are where they were, and the next step computes the same rows again."""
    sched = Scheduler(max_seqs=4, max_len=64, max_batched_tokens=16, eos_token_ids=[0], invariant=True)
    seq = add(sched, "a", 2)
    prefill = sched.schedule()
    sched.update(prefill, sched.advance(prefill), [5])
    first_work = sched.schedule()
    before = sched.rows(first_work)
    first = sched.advance(first_work)
    second_work = sched.schedule()
    second = sched.advance(second_work)
    sched.retract(second_work, second)
    sched.retract(first_work, first)
    assert (seq.num_computed, seq.pending, seq.pending_row, seq.tokens) == (2, 0, -1, [1, 2, 5])
    assert sched.rows(sched.schedule()) == before
