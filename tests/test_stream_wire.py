"""The wire between a rank and its streaming process: whatever pieces a socket hands either end
(a frame split anywhere, several frames in one read), the messages come out whole, in order, with
the types they were sent as."""

from __future__ import annotations

from components.engine.request import GenerateRequest, TokenOutput
from components.worker import stream_wire as wire

TO_STREAMER = [
    wire.OutputMoved("Worker.1"),
    wire.Start(rank=1, model_dir="/m", model_name="m", max_len=4096),
    wire.Outputs([TokenOutput("a", [1, 2]), TokenOutput("b", [3], "length")]),
    wire.Refused("c", "prompt too long"),
    wire.Handover("a", 0x1234, "op-7"),
    wire.Route(True),
    wire.Stop(),
]
TO_RANK = [
    wire.Ready(0xABC),
    wire.Submit(GenerateRequest("a", [5, 6, 7], 16, seed=3)),
    wire.Cancel("a"),
    wire.Closed("b"),
    wire.Routed(error="RuntimeError: no store"),
]


def test_frames_split_anywhere_decode_whole_and_in_order():
    for sent, kind in ((TO_STREAMER, wire.ToStreamer), (TO_RANK, wire.ToRank)):
        data = b"".join(wire.frame(m) for m in sent)
        for piece in (1, 2, 3, 7, 64, len(data)):
            frames = wire.Frames(kind)
            got = []
            for at in range(0, len(data), piece):
                got += frames.feed(data[at : at + piece])
            assert got == sent, piece
            assert frames.buf == b""  # nothing held back once every frame arrived


def test_a_partial_frame_waits_for_the_rest():
    data = wire.frame(wire.Cancel("a"))
    frames = wire.Frames(wire.ToRank)
    assert frames.feed(data[:-1]) == []
    assert frames.feed(data[-1:]) == [wire.Cancel("a")]
