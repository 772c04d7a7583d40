"""The harness's reading of Dynamo's event streams: a token's text may hold characters that
`str.splitlines` (and so httpx's `iter_lines`) takes for line ends; an event is cut at CR/LF only."""

from __future__ import annotations

import json

import httpx

from harness.server import sse_data

TEXTS = ["a\u2028b", "\x85", "c\x1cd\x1d\x1e", "\u2029", "\x0b\x0c", "plain"]


class Pieces(httpx.SyncByteStream):
    def __init__(self, pieces: list[bytes]):
        self.pieces = pieces

    def __iter__(self):
        yield from self.pieces


def stream_of(pieces: list[bytes]) -> httpx.Response:
    return httpx.Response(200, stream=Pieces(pieces))


def events(line_end: bytes) -> bytes:
    chunks = [json.dumps({"choices": [{"text": t}]}, ensure_ascii=False) for t in TEXTS]
    return b"".join(b"data: " + c.encode() + line_end + line_end for c in chunks) + b"data: [DONE]" + line_end


def test_every_event_parses_whatever_unicode_line_boundary_its_text_holds():
    body = events(b"\n")
    assert len(body.decode().splitlines()) > 2 * len(TEXTS) + 1  # what iter_lines would have cut
    texts = [json.loads(d)["choices"][0]["text"] for d in sse_data(stream_of([body]))]
    assert texts == TEXTS


def test_events_split_across_reads_and_ended_by_crlf_or_cr():
    for end in (b"\r\n", b"\r", b"\n"):
        body = events(end)
        pieces = [body[i : i + 7] for i in range(0, len(body), 7)]  # cuts inside lines, CRLFs and characters
        texts = [json.loads(d)["choices"][0]["text"] for d in sse_data(stream_of(pieces))]
        assert texts == TEXTS, end
