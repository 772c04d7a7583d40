"""The rank lifecycle as an explicit state machine (docs/design.md, "The rank lifecycle").

BOOTING -> RESTORED -> LOADED -> WARMED -> STAGED -> ACTIVE -> LEAVING -> PARKED | EXITED, and any
state -> FAILED. A cold start skips RESTORED; the first ranks of a deployment go LOADED -> ACTIVE
because there is no serving group to stage into yet; the comparison modes A and B stage a joiner
before warming it (LOADED -> STAGED -> WARMED -> ACTIVE).
"""

from __future__ import annotations

import enum
import logging

log = logging.getLogger(__name__)


class RankState(enum.IntEnum):
    BOOTING = 0
    RESTORED = 1
    LOADED = 2
    WARMED = 3  # warmed up with remote peers masked
    STAGED = 4  # connected to the serving group, still masked
    ACTIVE = 5
    LEAVING = 6
    PARKED = 7
    EXITED = 8
    FAILED = 9


_NEXT: dict[RankState, set[RankState]] = {
    RankState.BOOTING: {RankState.RESTORED, RankState.LOADED},
    RankState.RESTORED: {RankState.LOADED},
    RankState.LOADED: {RankState.WARMED, RankState.STAGED, RankState.ACTIVE},
    RankState.WARMED: {RankState.STAGED, RankState.ACTIVE},
    # Modes A and B connect a joiner first and warm it up inside the commit's pause.
    RankState.STAGED: {RankState.WARMED, RankState.ACTIVE, RankState.EXITED},
    RankState.ACTIVE: {RankState.LEAVING},
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
