"""The placement algebra of components/protocol/placement.py on its own: exact results for small
cases, the exact errors, and the invariants the scale protocol relies on (docs/design.md,
"Expert placement") checked over many random configurations. Torch-free and fast."""

from __future__ import annotations

import copy
import random
import re

import msgspec
import pytest

from components.protocol.placement import (
    Placement,
    balanced_placement,
    changed_slots,
    grow,
    hot_order,
    interim,
    rebalance,
    shrink,
    slots_needed,
)

_ = -1  # an empty slot, so rows read as pictures


def P(S: int, *rows: list[int]) -> Placement:
    return Placement(slots_per_rank=S, slots=[list(r) for r in rows])


def serving_experts(p: Placement, ranks, layer: int) -> set[int]:
    return {e for r in ranks for e in p.experts_on(r, layer) if e >= 0}


def replicas(p: Placement, ranks, layer: int, num_experts: int) -> list[int]:
    counts = [0] * num_experts
    for r in ranks:
        for e in p.experts_on(r, layer):
            if e >= 0:
                counts[e] += 1
    return counts


def apply(current: Placement, target: Placement) -> Placement:
    """What the ranks' slots hold once every changed slot was pulled."""
    rows = [list(r) for r in current.slots]
    for layer, slot in changed_slots(current, target):
        rows[layer][slot] = target.slots[layer][slot]
    return Placement(slots_per_rank=current.slots_per_rank, slots=rows)


# ---- Placement, slots_needed, hot_order -------------------------------------------------------


def test_placement_views_and_wire_format():
    p = P(2, [0, 1, _, _, 1, 0], [_, _, _, _, 2, _])
    assert p.experts_on(0, 0) == [0, 1]
    assert p.experts_on(1, 0) == [_, _]
    assert p.experts_on(2, 1) == [2, _]
    assert p.ranks_used() == {0, 2}
    assert msgspec.json.decode(msgspec.json.encode(p), type=Placement) == p


def test_slots_needed():
    assert slots_needed(8, 2) == 4
    assert slots_needed(8, 3) == 3
    assert slots_needed(8, 3, redundant=1) == 3
    assert slots_needed(8, 3, redundant=2) == 4
    assert slots_needed(8, 1) == 8
    assert slots_needed(8, 0) == 8  # no rank minimum: one rank must hold them all


def test_hot_order():
    assert hot_order(4, None) == [0, 1, 2, 3]
    assert hot_order(4, [1, 5, 5, 0]) == [1, 2, 0, 3]  # by load, ties by id
    assert hot_order(3, [0, 0, 0]) == [0, 1, 2]


# ---- balanced_placement -----------------------------------------------------------------------


def test_balanced_placement_spreads_then_replicates():
    p = balanced_placement(num_layers=2, num_experts=4, max_ranks=4, slots_per_rank=3, active=[1, 0])
    # expert i % 4 on active rank i % 2, a replica on the rank without it: ranks 2 and 3 stay empty
    row = [0, 2, 1, 1, 3, 0, _, _, _, _, _, _]
    assert p == P(3, row, row)


def test_balanced_placement_never_puts_two_copies_on_one_rank():
    # 2 ranks of 8 slots (the default deployment) each hold all 8 experts, not 4 of them twice.
    assert balanced_placement(1, 8, 4, 8, [0, 1]).slots[0][:16] == [0, 2, 4, 6, 1, 3, 5, 7, 1, 3, 5, 7, 0, 2, 4, 6]
    # 12 experts, 3 ranks of 5: the last copy left, of expert 2, is rank 2's already: it takes
    # rank 0's expert 0 instead, and rank 0 the 2.
    p = balanced_placement(1, 12, 3, 5, [0, 1, 2])
    assert p.slots[0] == [2, 3, 6, 9, 1] + [1, 4, 7, 10, 0] + [2, 5, 8, 11, 0]


def test_balanced_placement_on_later_ranks():
    p = balanced_placement(num_layers=1, num_experts=3, max_ranks=3, slots_per_rank=2, active=[2, 1])
    assert p == P(2, [_, _, 0, 2, 1, 0])


def test_balanced_placement_errors():
    with pytest.raises(ValueError, match="^an expert placement needs at least one active rank$"):
        balanced_placement(1, 4, 4, 2, [])
    msg = (
        "2 active ranks x 3 slots = 6 slots cannot hold 7 experts; "
        "launch with more slots per rank or keep more ranks active"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(msg)}$"):
        balanced_placement(1, 7, 4, 3, [0, 1])


# ---- grow -------------------------------------------------------------------------------------


def test_grow_keeps_serving_slots_and_fills_joiners_hottest_first():
    row = [0, 2, 0, 1, 3, 1, _, _, _, _, _, _]  # every expert on one rank
    current = P(3, row, row)
    before = copy.deepcopy(current.slots)
    load = [[1, 5, 5, 0], [0, 0, 0, 9]]
    target = grow(current, [3, 2], 4, load)
    assert target == P(
        3,
        [0, 2, 0, 1, 3, 1] + [1, 2, 0] + [3, 1, 2],  # hot order 1, 2, 0, 3 over joiners 2 then 3
        [0, 2, 0, 1, 3, 1] + [3, 0, 1] + [2, 3, 0],  # hot order 3, 0, 1, 2
    )
    assert current.slots == before
    # Only the joiners' slots change, so only they pull experts.
    assert {slot // 3 for _, slot in changed_slots(current, target)} == {2, 3}
    assert interim(current, target) == current  # nothing that serves is overwritten


def test_grow_without_load_goes_by_holders_then_expert_id():
    current = balanced_placement(1, 3, 4, 2, [0, 1])
    assert current == P(2, [0, 2, 1, 0, _, _, _, _])
    # Experts 1 and 2 have one holder, 0 two: they go first; joiner 3 then starts again at 0.
    assert grow(current, [3, 2], 3) == P(2, [0, 2, 1, 0] + [1, 2] + [0, 1])


def test_a_failover_replacement_gets_back_the_replicas_the_failed_rank_held():
    """3 ranks of 6 slots hold 8 experts on at least two ranks each; rank 1 fails: the survivors
    serve every expert without a load (`shrink` changes no slot), and its replacement's slots get
    the experts left on one rank, so each is on two ranks again."""
    current = balanced_placement(1, 8, 3, 6, [0, 1, 2])
    holders = lambda p: [len({s // 6 for s, x in enumerate(p.slots[0]) if x == e}) for e in range(8)]  # noqa: E731
    assert min(holders(current)) == 2
    survivors = shrink(current, [1], 8)
    assert changed_slots(current, survivors) == []
    assert holders(survivors) == [2, 2, 1, 2, 1, 1, 2, 1]
    target = grow(survivors, [1], 8)
    assert target.experts_on(1, 0) == [2, 4, 5, 7, 0, 1] and min(holders(target)) == 2


# ---- shrink -----------------------------------------------------------------------------------


def test_shrink_keeps_one_slot_per_expert_and_refills_duplicates():
    current = P(3, [0, 3, 0, 1, 4, 1, 2, 5, 2, _, _, _])
    target = shrink(current, [2], 6)
    # Rank 2's experts 2 and 5 take the duplicate slots of 0 and 1; rank 3 (inactive) stays empty.
    assert target == P(3, [0, 3, 2, 1, 4, 5, _, _, _, _, _, _])
    assert changed_slots(current, target) == [(0, 2), (0, 5)]
    # The leaving rank keeps serving its experts until the commit; only the slots refilled go dark.
    assert interim(current, target) == P(3, [0, 3, _, 1, 4, _, 2, 5, 2, _, _, _])


def test_shrink_never_uses_inactive_ranks_slots():
    current = P(3, [_, _, _, 0, 3, 0, 1, 4, 1, 2, 5, 2])
    # Rank 0's empty slots come first in slot order, but rank 0 is not serving.
    assert shrink(current, [3], 6) == P(3, [_, _, _, 0, 3, 2, 1, 4, 5, _, _, _])


def test_shrink_without_enough_slots_raises():
    current = balanced_placement(1, 6, 4, 2, [0, 1, 2])
    assert current == P(2, [0, 3, 1, 4, 2, 5, _, _])
    # Rank 3's two empty slots would fit, but it is inactive: they do not count.
    msg = (
        "layer 0: 2 experts would be left without a slot; "
        "the remaining ranks have 0 free slots (raise Worker.min_ranks' slots)"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(msg)}$"):
        shrink(current, [2], 6)


# ---- rebalance --------------------------------------------------------------------------------


def test_rebalance_follows_load_and_changes_few_slots():
    current = P(3, [0, 2, 0, 1, 3, 1, _, _, _])
    target = rebalance(current, [0, 1], 4, [[10, 0, 0, 30]])
    # Expert 3 gets both extra replicas; the duplicates of 0 and 1 make room, nothing else moves.
    assert target == P(3, [0, 2, 3, 1, 3, 3, _, _, _])
    assert changed_slots(current, target) == [(0, 2), (0, 5)]
    assert interim(current, target) == P(3, [0, 2, _, 1, 3, _, _, _, _])


def test_rebalance_replicas_in_proportion_to_load():
    current = balanced_placement(2, 4, 2, 4, [0, 1])
    target = rebalance(current, [0, 1], 4, [[60, 20, 20, 0], [5, 5, 5, 5]])
    # The next replica goes to the most load per replica, ties to the lower id.
    assert replicas(target, [0, 1], 0, 4) == [4, 2, 1, 1]
    assert replicas(target, [0, 1], 1, 4) == [2, 2, 2, 2]
    assert target.slots[1] == current.slots[1]  # already what it wants: nothing moves


def test_rebalance_touches_only_active_ranks():
    # Rank 2 is active and empty, rank 1 inactive with stale contents that must stay as they are.
    current = P(2, [0, 1, 3, 2, _, _])
    target = rebalance(current, [0, 2], 4, [[0, 0, 9, 9]])
    assert target == P(2, [0, 1, 3, 2, 2, 3])


# ---- changed_slots and interim ----------------------------------------------------------------


def test_changed_slots_and_interim_exactly():
    current = P(2, [0, 1, 2, 3], [3, 2, 1, 0])
    target = P(2, [0, 2, _, _], [3, 2, 0, 1])
    # A slot that becomes empty needs no pull, so it is not "changed" and keeps serving meanwhile.
    assert changed_slots(current, target) == [(0, 1), (1, 2), (1, 3)]
    assert interim(current, target) == P(2, [0, _, 2, 3], [3, 2, _, _])
    assert changed_slots(current, current) == []
    assert interim(current, current) == current


# ---- invariants over random configurations ----------------------------------------------------


def check_reachable(p: Placement, serving, num_experts: int, what: str) -> None:
    """Every expert has a slot on a serving rank in every layer, and nothing sits elsewhere."""
    assert p.ranks_used() <= set(serving), f"{what}: experts on ranks {p.ranks_used() - set(serving)}"
    for layer in range(len(p.slots)):
        missing = set(range(num_experts)) - serving_experts(p, serving, layer)
        assert not missing, f"{what}: layer {layer} has no slot for experts {sorted(missing)}"


def check_transition(current: Placement, target: Placement, old_active, new_active, num_experts, what) -> None:
    assert target.slots_per_rank == current.slots_per_rank
    assert [len(r) for r in target.slots] == [len(r) for r in current.slots]
    check_reachable(target, new_active, num_experts, what)
    changed = changed_slots(current, target)
    mid = interim(current, target)
    for layer, slot in changed:
        assert mid.slots[layer][slot] == -1, f"{what}: interim routes to changed slot {slot} of layer {layer}"
        assert slot // current.slots_per_rank in new_active, f"{what}: pull into slot {slot} of a rank not serving"
    dark = set(changed)
    for layer, row in enumerate(mid.slots):
        for slot, e in enumerate(row):
            if (layer, slot) not in dark:
                assert e == current.slots[layer][slot]
    # While refilling, the old active set still serves every expert.
    check_reachable(mid, old_active, num_experts, f"{what} (interim)")
    # Pulling the changed slots leaves every slot of the new group holding what the target says.
    filled = apply(current, target)
    S = current.slots_per_rank
    for layer, row in enumerate(target.slots):
        for slot, e in enumerate(row):
            if slot // S in new_active:
                assert filled.slots[layer][slot] == e, f"{what}: slot {slot} of layer {layer} not filled"


def test_invariants_over_random_configurations():
    rng = random.Random(20261130)
    ran = {"grow": 0, "shrink": 0, "rebalance": 0, "shrink refused": 0}
    for case in range(200):
        E = rng.randint(1, 12)
        max_ranks = rng.randint(1, 6)
        min_ranks = rng.randint(1, max_ranks)
        S = min(E, slots_needed(E, min_ranks, rng.randint(0, 3)))  # as EngineRank sizes its slots
        layers = rng.randint(1, 3)
        n0 = rng.randint(min_ranks, max_ranks)
        active = sorted(rng.sample(range(max_ranks), n0))
        p = balanced_placement(layers, E, max_ranks, S, active)
        check_reachable(p, active, E, f"case {case}: balanced over {active}")
        assert p.ranks_used() == set(active)
        for layer in range(layers):
            counts = replicas(p, active, layer, E)
            assert max(counts) - min(counts) <= 1  # replicas spread evenly
            for r in active:  # never two copies on one rank (S <= E): a failed rank leaves the others
                assert len(set(p.experts_on(r, layer))) == S, f"case {case}: rank {r} of {p}"
        for step in range(8):
            what = f"case {case} step {step} (E={E}, S={S}, max_ranks={max_ranks}, active={active})"
            before = copy.deepcopy(p.slots)
            free = [r for r in range(max_ranks) if r not in active]
            op = rng.choice(["grow", "shrink", "rebalance"])
            load = [[rng.choice([0, rng.randint(0, 100)]) for _ in range(E)] for _ in range(layers)]
            if op == "grow" and free:
                joiners = sorted(rng.sample(free, rng.randint(1, len(free))))
                target = grow(p, joiners, E, load)
                new_active = sorted(active + joiners)
                check_transition(p, target, active, new_active, E, f"{what} grow {joiners}")
                assert target.ranks_used() == set(new_active)
                for layer in range(layers):
                    for r in active:  # serving slots keep their experts
                        assert target.experts_on(r, layer) == p.experts_on(r, layer)
                    held = [len({r for r in active if e in p.experts_on(r, layer)}) for e in range(E)]
                    for r in joiners:  # one copy of an expert per joiner
                        assert len(set(target.experts_on(r, layer))) == S
                    # The first joiner takes the experts the fewest ranks hold.
                    first = target.experts_on(joiners[0], layer)
                    assert all(held[e] >= max(held[x] for x in first) for e in range(E) if e not in first)
            elif op == "shrink" and len(active) > 1:
                leaving = sorted(rng.sample(active, rng.randint(1, len(active) - 1)))
                remaining = [r for r in active if r not in leaving]
                # Fewer than min_ranks remaining may not fit: exactly then shrink refuses.
                if len(remaining) * S < E:
                    with pytest.raises(ValueError, match="experts would be left without a slot"):
                        shrink(p, leaving, E)
                    ran["shrink refused"] += 1
                    continue
                target = shrink(p, leaving, E)
                new_active = remaining
                check_transition(p, target, active, new_active, E, f"{what} shrink {leaving}")
                for layer in range(layers):
                    held = serving_experts(p, remaining, layer)
                    for e in held:  # an expert the remaining ranks hold keeps a slot it has now
                        kept = [
                            s
                            for s, x in enumerate(target.slots[layer])
                            if x == e and p.slots[layer][s] == e and s // S in remaining
                        ]
                        assert kept, f"{what}: expert {e} of layer {layer} moved although rank-local"
                    for r in leaving:
                        assert target.experts_on(r, layer) == [-1] * S
            else:
                op = "rebalance"
                target = rebalance(p, active, E, load)
                new_active = active
                check_transition(p, target, active, new_active, E, f"{what} rebalance")
                assert target.ranks_used() == set(active)
                for layer in range(layers):
                    old = replicas(p, active, layer, E)
                    new = replicas(target, active, layer, E)
                    assert min(new) >= 1 and sum(new) == len(active) * S
                    # As few slots change as the new replica counts allow.
                    least = sum(max(0, n - o) for n, o in zip(new, old))
                    assert sum(1 for lay, _s in changed_slots(p, target) if lay == layer) == least
                    # More load never means fewer replicas.
                    for a in range(E):
                        for b in range(E):
                            if load[layer][a] > load[layer][b]:
                                assert new[a] >= new[b], f"{what}: expert {a} hotter than {b} but fewer replicas"
            assert p.slots == before, f"{what}: {op} changed its input"
            ran[op] += 1
            p, active = target, new_active
    assert min(ran.values()) > 0, ran  # every path ran, the refusal included
