"""Where each expert lives, as data: `Placement` and the pure functions that compute new ones.

Physical slots are fixed at launch: every rank owns `slots_per_rank` of them, whether it is active
or not, so a placement has `max_ranks * slots_per_rank` entries per MoE layer and never changes
shape. Slots beyond one copy of every expert hold redundant replicas. The scale protocol moves
between placements (docs/design.md, "Scale-up" and "Scale-down"): `grow` for joiners, `shrink`
for leavers, `interim` while slots are refilled, `rebalance` for EPLB. Torch-free: the router
computes them; ranks install them into device tables (engine/exchange/expert_map.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import msgspec


class Placement(msgspec.Struct, frozen=True):
    """A serialisable expert map: `slots[layer][physical_slot]` = logical expert, or -1."""

    slots_per_rank: int
    slots: list[list[int]]

    def experts_on(self, rank: int, layer: int) -> list[int]:
        base = rank * self.slots_per_rank
        return self.slots[layer][base : base + self.slots_per_rank]

    def ranks_used(self) -> set[int]:
        return {s // self.slots_per_rank for row in self.slots for s, e in enumerate(row) if e >= 0}


def slots_needed(num_experts: int, min_ranks: int, redundant: int = 0) -> int:
    """Slots each rank must own so that `min_ranks` active ranks can hold every expert."""
    return math.ceil((num_experts + redundant) / max(1, min_ranks))


def balanced_placement(
    num_layers: int, num_experts: int, max_ranks: int, slots_per_rank: int, active: Sequence[int]
) -> Placement:
    """Spread experts over the active ranks' slots; fill the remaining active slots with replicas.

    Expert e goes to active rank e % n (so every rank gets a share), and spare slots cycle through
    the experts again, which gives each expert at most ceil(slots/E) copies; a rank takes the
    next copy of an expert it does not hold yet, so that a rank that fails leaves a copy of its
    experts on the others wherever the slots allow."""
    active = sorted(active)
    n = len(active)
    if n == 0:
        raise ValueError("an expert placement needs at least one active rank")
    capacity = n * slots_per_rank
    if capacity < num_experts:
        raise ValueError(
            f"{n} active ranks x {slots_per_rank} slots = {capacity} slots cannot hold "
            f"{num_experts} experts; launch with more slots per rank or keep more ranks active"
        )
    row = [-1] * (max_ranks * slots_per_rank)
    fill = [0] * n  # next free slot index on each active rank
    held: list[set[int]] = [set() for _ in range(n)]
    copies = [i % num_experts for i in range(capacity)]  # in the order they are handed out
    for i in range(capacity):
        r = i % n
        slot = active[r] * slots_per_rank + fill[r]
        expert = copies.pop(next((j for j, e in enumerate(copies) if e not in held[r]), 0))
        if expert in held[r]:  # the copies left are all here already: trade with a rank filled before
            filled = ((o, active[o] * slots_per_rank + s) for o in range(n) if o != r for s in range(fill[o]))
            trade = next(((o, s) for o, s in filled if row[s] not in held[r] and expert not in held[o]), None)
            if trade:
                o, other = trade
                held[o].symmetric_difference_update({row[other], expert})
                row[other], expert = expert, row[other]
        row[slot] = expert
        held[r].add(expert)
        fill[r] += 1
    return Placement(slots_per_rank=slots_per_rank, slots=[list(row) for _ in range(num_layers)])


def hot_order(num_experts: int, load: Sequence[int] | None) -> list[int]:
    """Experts by descending load (ties by id), the order extra replicas are handed out in."""
    load = list(load) if load is not None else [0] * num_experts
    return sorted(range(num_experts), key=lambda e: (-load[e], e))


def grow(
    current: Placement, new_ranks: Sequence[int], num_experts: int, load: Sequence[Sequence[int]] | None = None
) -> Placement:
    """Scale-up target: every slot that serves now keeps its expert (so retained ranks move no
    weights and their graphs stay valid); the joiners' slots get replicas, of the experts held by
    the fewest ranks first (a failover's replacement gets back the copies the failed rank took),
    hottest first among those, never two copies on one joiner while another expert lacks one."""
    S = current.slots_per_rank
    new_ranks = sorted(new_ranks)
    rows = []
    for layer, row in enumerate(current.slots):
        row = list(row)
        heat = [0] * num_experts  # each expert's place in hot_order (list.index would make this quadratic)
        for i, e in enumerate(hot_order(num_experts, load[layer] if load else None)):
            heat[e] = i
        holders = [set() for _ in range(num_experts)]
        for slot, e in enumerate(row):
            if e >= 0 and slot // S not in new_ranks:
                holders[e].add(slot // S)
        for r in new_ranks:
            for s in range(S):
                e = min(range(num_experts), key=lambda x: (r in holders[x], len(holders[x]), heat[x]))
                row[r * S + s] = e
                holders[e].add(r)
        rows.append(row)
    return Placement(slots_per_rank=S, slots=rows)


def shrink(current: Placement, leaving: Sequence[int], num_experts: int) -> Placement:
    """Scale-down target over the remaining ranks: keep one slot of every expert they already
    hold, and put the experts that only the leaving ranks hold into empty or duplicate slots."""
    S = current.slots_per_rank
    leaving = set(leaving)
    rows = []
    for layer, row in enumerate(current.slots):
        row = list(row)
        kept: set[int] = set()
        spare = []
        for slot, e in enumerate(row):
            r = slot // S
            if r in leaving:
                row[slot] = -1
            elif e >= 0 and e not in kept:
                kept.add(e)
            else:  # empty, or a duplicate replica
                spare.append(slot)
        # Only slots of ranks that hold anything now are eligible (inactive ranks stay empty).
        serving = {slot // S for slot, e in enumerate(current.slots[layer]) if e >= 0} - leaving
        spare = [s for s in spare if s // S in serving]
        missing = [e for e in range(num_experts) if e not in kept]
        if len(missing) > len(spare):
            raise ValueError(
                f"layer {layer}: {len(missing)} experts would be left without a slot; "
                f"the remaining ranks have {len(spare)} free slots (raise Worker.min_ranks' slots)"
            )
        for e, slot in zip(missing, spare):
            row[slot] = e
        rows.append(row)
    return Placement(slots_per_rank=S, slots=rows)


def rebalance(current: Placement, active: Sequence[int], num_experts: int, load: Sequence[Sequence[int]]) -> Placement:
    """EPLB: give each expert replicas in proportion to its load (at least one), keeping every
    slot whose expert still has a replica to fill, so as few slots as possible change."""
    S = current.slots_per_rank
    slots = [r * S + s for r in sorted(active) for s in range(S)]
    rows = []
    for layer, row in enumerate(current.slots):
        want = [1] * num_experts
        for _ in range(len(slots) - num_experts):
            # The next replica goes to the expert with the most load per replica.
            e = max(range(num_experts), key=lambda x: (load[layer][x] / want[x], -x))
            want[e] += 1
        new = list(row)
        free = []
        for slot in slots:
            e = row[slot]
            if e >= 0 and want[e] > 0:
                want[e] -= 1
            else:
                free.append(slot)
        fill = [e for e in range(num_experts) for _ in range(want[e])]
        for slot, e in zip(free, fill):
            new[slot] = e
        rows.append(new)
    return Placement(slots_per_rank=S, slots=rows)


def changed_slots(current: Placement, target: Placement) -> list[tuple[int, int]]:
    """(layer, slot) whose expert differs and must be filled before `target` serves."""
    return [
        (layer, slot)
        for layer, (a, b) in enumerate(zip(current.slots, target.slots))
        for slot, (x, y) in enumerate(zip(a, b))
        if x != y and y >= 0
    ]


def interim(current: Placement, target: Placement) -> Placement:
    """`current` minus the slots about to be overwritten: safe to serve while they are refilled."""
    rows = [[-1 if (x != y and y >= 0) else x for x, y in zip(a, b)] for a, b in zip(current.slots, target.slots)]
    return Placement(slots_per_rank=current.slots_per_rank, slots=rows)
