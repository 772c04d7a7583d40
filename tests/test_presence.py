"""A rank enters and leaves routing through Presence, with Dynamo's real runtime and file
discovery: each call returns once discovery agrees, and a leave right behind the first enter
(whose registration serve_endpoint makes from a task of its own) is not overtaken by it."""

from __future__ import annotations

import asyncio
import time

import pytest

from components.worker.presence import Presence


async def handler(request, context=None):
    yield {"token_ids": [1]}


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    from dynamo.runtime import DistributedRuntime

    with pytest.MonkeyPatch.context() as env:  # read once, as the runtime is built
        env.setenv("DYN_FILE_KV", str(tmp_path_factory.mktemp("discovery")))
        env.setenv("DYN_TCP_RPC_HOST", "127.0.0.1")
        env.setenv("DYN_TCP_RESPONSE_STREAM_HOST", "127.0.0.1")
        loop = asyncio.new_event_loop()
        rt = DistributedRuntime(loop, "file", "tcp")
    try:
        yield loop, rt
    finally:
        rt.shutdown()
        loop.run_until_complete(asyncio.sleep(0.5))  # the runtime's last callbacks land on the loop
        loop.close()


def test_a_leave_right_behind_the_first_enter_stays_out_of_routing(runtime):
    """Sent 0-4 ms behind the enter: Dynamo's own unregister there removes nothing or raises
    (its registration not landed yet), and leaves the instance listed either way."""
    loop, rt = runtime

    async def once(name: str, delay: float) -> tuple[bool, bool]:
        ep = rt.endpoint(f"presence.{name}.generate")
        presence = Presence(ep, await ep.client(), handler)
        frontend = await rt.endpoint(f"presence.{name}.generate").client()
        enter = asyncio.ensure_future(presence.enter())
        t = time.monotonic()
        await asyncio.sleep(0)  # the enter starts serve_endpoint, whose registration runs on
        while time.monotonic() - t < delay:
            await asyncio.sleep(0)
        await presence.leave()
        assert enter.done()
        await asyncio.sleep(0.1)  # long enough for a late registration to land
        return presence.listed, ep.connection_id() in frontend.instance_ids()

    delays = [0.0, 0.0005, 0.001, 0.002, 0.004] * 3

    async def run():
        return [await once(f"leave{i}", d) for i, d in enumerate(delays)]

    seen = loop.run_until_complete(run())
    assert seen == [(False, False)] * len(delays)


def test_enter_and_leave_return_once_discovery_agrees(runtime):
    loop, rt = runtime

    async def run():
        ep = rt.endpoint("presence.agree.generate")
        presence = Presence(ep, await ep.client(), handler)
        seen = []
        for _ in range(3):
            await presence.enter()
            seen.append(presence.listed)
            await presence.leave()
            seen.append(presence.listed)
        return seen

    assert loop.run_until_complete(run()) == [True, False] * 3
