"""Router -> worker control messages (msgspec, tagged union) and the worker's replies.

They travel as plain JSON-able dicts over a Dynamo endpoint (`<ns>.worker.control`), addressed
to one worker instance; `bytes` fields become base64 on the way, which msgspec restores.
"""

from __future__ import annotations

from typing import Union

import msgspec

from components.engine.expert_map import Placement


class Describe(msgspec.Struct, tag="describe"):
    pass


class Connect(msgspec.Struct, tag="connect"):
    peers: dict[int, bytes]  # rank -> communicator metadata
    activate: bool = False


class Disconnect(msgspec.Struct, tag="disconnect"):
    ranks: list[int]


class Pause(msgspec.Struct, tag="pause"):
    pass


class Configure(msgspec.Struct, tag="configure"):
    """Install an active set and expert placement; only valid while paused (or not active)."""

    epoch: int
    active: list[int]
    placement: Placement


class Resume(msgspec.Struct, tag="resume"):
    pass


class SetRoutable(msgspec.Struct, tag="set_routable"):
    routable: bool


ControlRequest = Union[Describe, Connect, Disconnect, Pause, Configure, Resume, SetRoutable]


class RankStatus(msgspec.Struct):
    rank: int
    instance_id: int
    metadata: bytes
    model_identity: str
    num_experts: int
    num_moe_layers: int
    slots_per_rank: int
    epoch: int
    active: list[int]
    connected: list[int]
    paused: bool
    routable: bool
    steps: int
    running: int
    waiting: int
    requests_total: int
    expert_rows: int  # (token, expert) pairs computed here, for any rank


class ControlReply(msgspec.Struct):
    ok: bool
    error: str = ""
    status: RankStatus | None = None


def encode(msg: msgspec.Struct) -> dict:
    return msgspec.to_builtins(msg)


def decode_request(raw: dict) -> ControlRequest:
    return msgspec.convert(raw, ControlRequest)


def decode_reply(raw: dict) -> ControlReply:
    return msgspec.convert(raw, ControlReply)
