"""The router's control API in process (aiohttp's test server), without ranks behind it."""

from __future__ import annotations

import asyncio

from aiohttp.test_utils import TestClient, TestServer

from components.control.router import Router, RouterService
from components.worker import Worker

AUTH = {"Authorization": "Bearer s3cret"}


def call(requests: list[tuple[str, str, dict]]) -> list[tuple[int, str]]:
    """(status, body) of each request against a router with a token and no ranks."""

    async def run():
        svc = RouterService(None, None, Router.Config(token="s3cret"), Worker.Config())
        async with TestClient(TestServer(svc.app())) as client:
            out = []
            for method, path, headers in requests:
                r = await client.request(method, path, headers=headers)
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
        ("GET", "/topology", {"Authorization": "Bearer wrong"}),
    ]
    replies = call([*denied, ("GET", "/topology", AUTH)])
    assert replies[:-1] == [(401, '{"error": "missing or wrong bearer token"}')] * len(denied)
    assert replies[-1][0] == 200 and '"epoch":0' in replies[-1][1]
