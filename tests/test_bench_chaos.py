"""bench.chaos's bookkeeping: a fault is drawn only where the deployment can take it and a seed
draws the same ones; each fault is charged the requests that ended from it to the next fault."""

from __future__ import annotations

import random
from types import SimpleNamespace

from bench import chaos


def soak(seed: int, size: int, planner_alive: bool = True) -> SimpleNamespace:
    args = SimpleNamespace(min_size=2, max_size=4, faults=list(chaos.MATRIX))
    return SimpleNamespace(rng=random.Random(seed), target=size, args=args, planner_alive=planner_alive)


def draws(s: SimpleNamespace, n: int = 400) -> list[str]:
    return [chaos.pick(s) for _ in range(n)]


def test_a_fault_is_drawn_only_where_the_deployment_can_take_it():
    at_min, mid, at_max = set(draws(soak(1, 2))), set(draws(soak(1, 3))), set(draws(soak(1, 4)))
    joiners = {f"joiner killed in {p}" for p in chaos.JOINER_PHASES} | {"pull source killed"}
    # Two ranks killed leaves one rank at least; no scale-up past the largest size, no scale-down
    # below the smallest.
    assert "two ranks killed" not in at_min and "leaving rank killed" not in at_min and joiners <= at_min
    assert mid == set(chaos.MATRIX)
    assert not joiners & at_max and {"two ranks killed", "leaving rank killed"} <= at_max
    # The planner is not restarted: killed once, it is not drawn again.
    assert "planner killed" not in set(draws(soak(1, 3, planner_alive=False)))


def test_a_seed_draws_the_same_faults():
    assert draws(soak(7, 3), 50) == draws(soak(7, 3), 50)
    assert draws(soak(7, 3), 50) != draws(soak(8, 3), 50)


def test_each_fault_is_charged_what_ended_from_it_to_the_next():
    reference = ["a", "b"]
    traffic = SimpleNamespace(
        results=[(0, "a", 0, 1), (1, "b", 0, 1), (1, "x", 0, 1), (0, "a", 0, 1)],
        errors=[(0, "RuntimeError('HTTP 503: no serving rank (operation op-3)')")],
    )
    rows = [{"kind": "serving rank killed", "window": (0, 0)}, {"kind": "router killed", "window": (2, 1)}]
    chaos.settle_windows(rows, traffic, reference)
    assert [(r["sent"], r["lost"], r["wrong_tokens"], r["wrong_requests"]) for r in rows] == [
        (3, 1, 0, []),
        (2, 0, 1, [1]),
    ]
    assert rows[0]["failure_reasons"] == {"RuntimeError('HTTP 503: no serving rank')": 1}
    assert all("window" not in r for r in rows)
    ok = {"recovered_s": 1.0, "next_scale": "3 -> 2: done", "next_scale_whole": True}
    assert chaos.bad(rows[0] | ok) and chaos.bad(rows[1] | ok)  # one lost, one wrong
    clean = rows[0] | ok | {"lost": 0}
    assert not chaos.bad(clean)
    assert chaos.bad(clean | {"recovered_s": None}) and chaos.bad(clean | {"next_scale": "3 -> 2: aborted"})
