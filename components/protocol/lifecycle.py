"""The rank lifecycle as an explicit state machine (docs/design.md, "The rank lifecycle").

BOOTING -> RESTORED -> LOADED -> WARMED -> STAGED -> ACTIVE -> LEAVING -> PARKED | EXITED, and any
state -> FAILED. A cold start skips RESTORED; the first ranks of a deployment are not warmed up
(LOADED -> STAGED -> ACTIVE); the comparison modes A and B stage a joiner before warming it
(LOADED -> STAGED -> WARMED -> ACTIVE); a scale-down that aborts puts its leaving ranks back
(LEAVING -> ACTIVE). Which control message makes which move is declared by the worker's handlers
(components/worker/rules.py, `handles`).

RankState is a str enum whose values are its names: RankStatus carries it as that name, and it
compares and formats as that name, so /topology and the router's logs read as they did.
"""

from __future__ import annotations

import enum
import logging

log = logging.getLogger(__name__)


class RankState(enum.StrEnum):
    BOOTING = "BOOTING"
    RESTORED = "RESTORED"
    LOADED = "LOADED"
    WARMED = "WARMED"  # warmed up with remote peers masked
    STAGED = "STAGED"  # connected to the serving group, still masked
    ACTIVE = "ACTIVE"
    LEAVING = "LEAVING"
    PARKED = "PARKED"
    EXITED = "EXITED"
    FAILED = "FAILED"


_NEXT: dict[RankState, set[RankState]] = {
    RankState.BOOTING: {RankState.RESTORED, RankState.LOADED},
    RankState.RESTORED: {RankState.LOADED},
    RankState.LOADED: {RankState.WARMED, RankState.STAGED, RankState.ACTIVE},
    RankState.WARMED: {RankState.STAGED, RankState.ACTIVE},
    # Modes A and B connect a joiner first and warm it up inside the commit's pause.
    RankState.STAGED: {RankState.WARMED, RankState.ACTIVE, RankState.EXITED},
    RankState.ACTIVE: {RankState.LEAVING},
    # Back to ACTIVE: a scale-down that aborts puts its leaving ranks back into routing.
    RankState.LEAVING: {RankState.PARKED, RankState.EXITED, RankState.ACTIVE},
    RankState.PARKED: {RankState.RESTORED},
    RankState.EXITED: set(),
    RankState.FAILED: set(),
}


class Lifecycle:
    def __init__(self, rank: int):
        self.rank = rank
        self.state = RankState.BOOTING

    def transition(self, new: RankState, reason: str = "", op: str = "-") -> None:
        """The one way a rank changes state; `op` is the scale operation's id, if any."""
        if new is not RankState.FAILED and new not in _NEXT[self.state]:
            raise RuntimeError(f"rank {self.rank}: illegal transition {self.state.name} -> {new.name}")
        log.info(
            "[op %s] rank %d: %s -> %s%s", op, self.rank, self.state.name, new.name, f" ({reason})" if reason else ""
        )
        self.state = new
