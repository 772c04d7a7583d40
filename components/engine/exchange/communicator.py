"""The EP communicator interface: fixed-capacity all-to-all among a changeable set of ranks.

Membership changes in place: buffers are sized for `max_ranks` and registered once, and the
active set is a mask. A rank may be connected to a peer without the peer being active (a joiner
being prepared), which is what lets a running group prepare a scale-up while it keeps serving.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

import torch


class EPError(RuntimeError):
    """A collective could not complete: a peer is gone, timed out, or the input is invalid.
    `peers`: the ranks it failed on (silent, unreachable or declared gone), when that is known."""

    def __init__(self, message: str, peers: Iterable[int] = ()):
        super().__init__(message)
        self.peers = sorted(peers)


class DeviceExchange(Protocol):
    """The MoE exchange as device work a CUDA graph can hold (same-node peer windows,
    windows.PeerWindows): what the MoE layer and the step loop need of it."""

    # The EP mask the dispatch and the exchange's kernels read, at a fixed address.
    mask: torch.Tensor

    def exchange(
        self,
        rows: torch.Tensor,
        local: torch.Tensor,
        counts: torch.Tensor,
        out: torch.Tensor,
        experts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> None:
        """Send `rows` (sorted by destination, `counts` per destination, `local` their slots there),
        compute the rows sent here with `experts(rows, slots)`, write each row's result into `out`."""

    def check(self) -> None:
        """After the step's sync: raise EPError naming the peers a wait gave up on."""

    def declare_gone(self) -> None:
        """Waits for failed peers give up at once instead of at their timeout."""


class EPCommunicator(Protocol):
    rank: int
    max_ranks: int
    capacity_bytes: int  # most bytes one rank may send to one peer in one all_to_all
    # Same-node CUDA ranks: the MoE exchange as device work through peers' mailboxes
    # (windows.PeerWindows); None: the MoE exchange goes through all_to_all.
    windows: DeviceExchange | None

    def metadata(self) -> bytes:
        """What a peer needs to connect to this rank (opaque, stable until suspend())."""

    def connect(self, peers: Mapping[int, bytes], activate: bool = False) -> None:
        """Connect peers (rank -> metadata). Connected peers stay masked unless `activate`."""

    def disconnect(self, ranks: Iterable[int]) -> None:
        """Forget peers; they are masked first."""

    def set_active(self, ranks: Iterable[int], epoch: int) -> None:
        """Install the active set for `epoch`. Collectives are tagged with the epoch, so every rank
        of the new set must install the same set with the same epoch before its next collective."""

    def declare_gone(self, ranks: Iterable[int]) -> None:
        """The router found these peers dead: a collective in flight is abandoned now (EPError
        naming them), whichever peer it waits for, instead of at its timeout; the router installs
        a new epoch next. Safe from any thread, also during a collective; cleared by set_active."""

    def mask_remote(self) -> None:
        """Only this rank is active (a joiner warming up alone). Collectives become local."""

    @property
    def active(self) -> tuple[int, ...]:
        """Active ranks, ascending. Always contains `rank` unless this rank was masked out."""

    @property
    def connected(self) -> tuple[int, ...]:
        """Connected ranks (including this one), ascending."""

    def all_to_all(self, send: Mapping[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Variable-size all-to-all among the active ranks.

        `send` maps destination rank -> contiguous 1-D uint8 tensor of at most `capacity_bytes`;
        a missing destination sends zero bytes. Every active rank must make the same sequence of
        calls. Returns source rank -> uint8 tensor (owned by the caller) for every active rank,
        this one included. Raises EPError on timeout or a dead peer."""

    def suspend(self) -> None:
        """Parking: drop every peer and all transport state, keeping buffers at their addresses.
        Until resume() only this rank may be active, and metadata() is empty."""

    def assume_rank(self, rank: int, name: str) -> None:
        """While suspended: become `rank`, the next transport state named after `name` (a process
        restored from a snapshot image learns its rank only then)."""

    def resume(self) -> None:
        """After parking: transport state back (new metadata), same buffers."""

    def close(self) -> None: ...
