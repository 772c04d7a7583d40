"""Which control message a rank accepts in which lifecycle state, and the transitions it may make:
one table (`RULES`), filled by the `handles` decorator on each handler."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import NamedTuple

from components.protocol.lifecycle import RankState
from components.protocol.messages import (
    ControlReply,
)


class StateError(RuntimeError):
    """A control message that the rank's lifecycle state does not allow; nothing was applied."""


class Rule(NamedTuple):
    handler: Callable[..., Awaitable[ControlReply | None]]  # a RankServer method
    valid: frozenset[RankState]  # the states the message is accepted in; any other refuses it
    moves: dict[RankState, RankState]  # the lifecycle transitions it may make, from -> to


RULES: dict[type, Rule] = {}  # control message type -> its rule, filled once by `handles`

ANY_STATE = frozenset(RankState)
# Weights in place, and the rank in a serving group, or joining or leaving one. The messages valid
# in all of these are sent to some of them only (a joiner, or serving ranks): where in doubt a state
# is allowed, since with weights in place they do no harm.
HOLDING_WEIGHTS = frozenset({RankState.LOADED, RankState.WARMED, RankState.STAGED, RankState.ACTIVE, RankState.LEAVING})
# A commit (Pause, Configure, Resume) reaches every rank its operation involves: a parked one too,
# in the follow-up rebalance of the scale-down that parked it.
IN_COMMITS = HOLDING_WEIGHTS | {RankState.PARKED}


def handles(message: type, valid: Iterable[RankState], moves: Mapping[RankState, RankState] | None = None):
    """Make the decorated RankServer method the handler of `message`, accepted in the `valid`
    states only and making no lifecycle transition but `moves` (through RankServer.advance)."""

    def register(fn):
        RULES[message] = Rule(fn, frozenset(valid), dict(moves or {}))
        return fn

    return register


def allowed(message: type, state: RankState) -> bool:
    return state in RULES[message].valid


def refusal(message: type, state: RankState) -> StateError:
    valid = ", ".join(s.name for s in RankState if s in RULES[message].valid)
    return StateError(f"{message.__name__} is not valid in state {state.name} (only in {valid})")
