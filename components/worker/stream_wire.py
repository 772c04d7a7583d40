"""The wire between a rank's process and its streaming process (streamer.py): msgspec messages in
length-prefixed msgpack frames over a Unix socket pair, decoded with the same types on both ends."""

from __future__ import annotations

import struct
from typing import Any

import msgspec

from components.engine.request import GenerateRequest, TokenOutput

HEADER = struct.Struct(">I")  # the frame's length


# ---- rank -> streamer ---------------------------------------------------------------------------
class Start(msgspec.Struct, tag=True):
    """What the generate endpoint needs from the loaded rank: the model it registers."""

    rank: int
    model_dir: str
    model_name: str
    max_len: int


class Outputs(msgspec.Struct, tag=True):
    """Everything one step emitted, for the streams it belongs to."""

    outputs: list[TokenOutput]


class Refused(msgspec.Struct, tag=True):
    """The engine cannot serve request `request_id` as given: the client's 400."""

    request_id: str
    error: str


class Handover(msgspec.Struct, tag=True):
    """Continue request `request_id` on the generate instance `instance_id` (a rank leaving in
    scale operation `op`)."""

    request_id: str
    instance_id: int
    op: str


class Route(msgspec.Struct, tag=True):
    """Enter (True) or leave routing: the generate endpoint listed in discovery, or not."""

    routable: bool


class Stop(msgspec.Struct, tag=True):
    """The rank is ending: unregister and exit."""


class OutputMoved(msgspec.Struct, tag=True):
    """The rank's output goes elsewhere now (the router that relayed it is gone): write where the
    rank's stdout does, labelled as it is. May come before Start."""

    label: str


# ---- streamer -> rank ---------------------------------------------------------------------------
class Ready(msgspec.Struct, tag=True):
    """Serving's set up (the model registered): the generate instance the router routes to."""

    instance_id: int


class Submit(msgspec.Struct, tag=True):
    req: GenerateRequest


class Cancel(msgspec.Struct, tag=True):
    """Stop generating `request_id` (handed over: its stream goes on, relayed)."""

    request_id: str


class Closed(msgspec.Struct, tag=True):
    """The stream of `request_id` ended (finished, relayed to its end, or its client gone)."""

    request_id: str


class Routed(msgspec.Struct, tag=True):
    """The Route asked for is seen in discovery (error: it could not be)."""

    error: str = ""


ToStreamer = Start | Outputs | Refused | Handover | Route | Stop | OutputMoved
ToRank = Ready | Submit | Cancel | Closed | Routed

_encoder = msgspec.msgpack.Encoder()
READ_SIZE = 1 << 16  # what either end asks its socket for at a time: every frame it holds


def frame(msg: msgspec.Struct) -> bytes:
    payload = _encoder.encode(msg)
    return HEADER.pack(len(payload)) + payload


class Frames:
    """The messages of one direction, decoded as the bytes arrive, whatever their pieces: the
    rank's reader thread and the streamer's loop both feed it what their socket gave them."""

    def __init__(self, type: Any):
        self.decoder = msgspec.msgpack.Decoder(type)
        self.buf = bytearray()

    def feed(self, data: bytes) -> list[Any]:
        self.buf += data
        msgs, at = [], 0
        with memoryview(self.buf) as view:
            while len(view) - at >= HEADER.size:
                (n,) = HEADER.unpack_from(view, at)
                end = at + HEADER.size + n
                if end > len(view):
                    break
                msgs.append(self.decoder.decode(view[at + HEADER.size : end]))
                at = end
        del self.buf[:at]
        return msgs
