"""The router's control API in process (aiohttp's test server), without ranks behind it: who may
call it, and what a bad request gets."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp.test_utils import TestClient, TestServer

from components.control.router import ElasticEPBody, RouterService, ScaleBody
from components.protocol.config import RouterConfig, WorkerConfig
from components.protocol.topology import ScaleMode

AUTH = {"Authorization": "Bearer s3cret"}


def call(requests: list[tuple[str, str, dict]], token: str = "s3cret") -> list[tuple[int, str]]:
    """(status, body) of each request against a router with no ranks."""

    async def run():
        svc = RouterService(None, None, RouterConfig(token=token), WorkerConfig())
        async with TestClient(TestServer(svc.app())) as client:
            out = []
            for method, path, kw in requests:
                r = await client.request(method, path, **kw)
                out.append((r.status, await r.text()))
            return out

    return asyncio.run(run())


def test_probes_and_scrapers_need_no_token():
    (health, metrics) = call([("GET", "/health", {}), ("GET", "/metrics", {})])
    assert health == (503, '{"status": "starting", "epoch": 0}')  # not 401: the probe sends no token
    assert metrics[0] == 200 and "elastic_router_epoch 0" in metrics[1]


def test_everything_else_needs_the_token():
    denied = [
        ("GET", "/topology", {}),
        ("POST", "/scale", {}),
        ("POST", "/health", {}),
        ("POST", "/is_scaling_elastic_ep", {}),
        ("GET", "/topology", {"headers": {"Authorization": "Bearer wrong"}}),
        ("GET", "/topology", {"headers": {"Authorization": "Bearer s3crét"}}),  # not ASCII: refused, not a 500
        ("GET", "/topology", {"headers": {"Authorization": b"Bearer \xff\xfe".decode("latin-1")}}),
    ]
    replies = call([*denied, ("GET", "/topology", {"headers": AUTH})])
    assert replies[:-1] == [(401, '{"error": "missing or wrong bearer token"}')] * len(denied)
    assert replies[-1][0] == 200 and '"epoch":0' in replies[-1][1]


def test_a_token_that_cannot_be_sent_is_refused_at_start():
    with pytest.raises(ValueError, match="token must be printable ASCII"):
        RouterConfig(token="s3crét")
    with pytest.raises(ValueError, match="token must be printable ASCII"):
        RouterConfig(token="two words")


def test_browsers_cannot_drive_the_api():
    """CSRF from a page on this machine (a foreign Origin, a form's content type) and DNS
    rebinding (a foreign Host) are refused before anything is parsed."""
    replies = call(
        [
            ("POST", "/scale", {"json": {"dp_size": 3}, "headers": {"Origin": "http://evil.example"}}),
            ("POST", "/scale", {"data": '{"dp_size": 3}', "headers": {"Content-Type": "text/plain"}}),
            ("GET", "/topology", {"headers": {"Host": "evil.example:8001"}}),
            ("GET", "/topology", {"headers": {"Origin": "http://127.0.0.1:8001"}}),
        ],
        token="",
    )
    assert replies[0] == (
        403,
        '{"error": {"message": "cross-origin request from \'http://evil.example\' refused", "code": 403}}',
    )
    assert replies[1] == (
        415,
        '{"error": {"message": "expected content-type application/json, got \'text/plain\'", "code": 415}}',
    )
    assert replies[2] == (
        403,
        '{"error": {"message": "Host \'evil.example:8001\' is not this control API", "code": 403}}',
    )
    assert replies[3][0] == 200


@pytest.mark.parametrize(
    "body,message",
    [
        (b"", "request body is not valid JSON: Input data was truncated"),
        (b"[3]", 'expected a JSON object like {"dp_size": 4}'),
        (
            b'{"dp_size": 3, "mode": "D"}',
            "mode must be one of A (blocking), B (prepare_async), C (prepare_async_reuse_graphs), got 'D'",
        ),
        (b'{"dp_size": 3, "fault": "corrupt_pull"}', "fault injection is off (Router.allow_fault_injection)"),
        (b'{"dp_size": 3, "drain_timeout": 1e9}', "drain_timeout must be in 0..86400 seconds, got 1000000000.0"),
        (b"[" * 100000 + b"]" * 100000, "request body nests deeper than 8 levels"),
    ],
)
def test_scale_bodies_are_decoded_strictly(body, message):
    svc = RouterService(None, None, RouterConfig(), WorkerConfig())
    with pytest.raises(ValueError) as e:
        svc.parse_scale(body, ScaleBody)
    assert str(e.value) == message


def test_scale_modes_by_letter_or_name():
    svc = RouterService(None, None, RouterConfig(), WorkerConfig())
    for text, mode in [
        ("A", ScaleMode.BLOCKING),
        ("prepare_async", ScaleMode.PREPARE_ASYNC),
        ("C", ScaleMode.PREPARE_ASYNC_REUSE_GRAPHS),
    ]:
        assert svc.parse_scale(b'{"dp_size": 3, "mode": "%s"}' % text.encode(), ScaleBody).mode is mode
    req = svc.parse_scale(b'{"new_data_parallel_size": 3, "drain_timeout": 5}', ElasticEPBody)
    assert (req.dp_size, req.mode, req.drain_timeout_s) == (3, ScaleMode.PREPARE_ASYNC_REUSE_GRAPHS, 5.0)
