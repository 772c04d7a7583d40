"""A rank out of routing, or handing a request over, sends it on to another rank's generate
instance: with Dynamo's real runtime and file discovery, past an instance a killed rank left
listed (a file entry outlives its process)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from components.worker.stream_wire import Start
from components.worker.streamer import Streamer
from harness.server import ROOT, free_ports


async def handler(request, context=None):
    yield {"token_ids": [1]}


def scenario(discovery: Path) -> None:
    from dynamo.runtime import DistributedRuntime

    loop = asyncio.new_event_loop()
    rt = DistributedRuntime(loop, "file", "tcp")
    stale = 0x5EED0000DEAD
    port = free_ports(1)[0]  # nothing listens there: what a killed rank's address is

    async def run():
        ep = rt.endpoint("sendon.worker.generate")
        client = await ep.client()
        serving = asyncio.ensure_future(ep.serve_endpoint(handler))
        await client.wait_for_instances()
        entry = {
            "type": "Endpoint",
            "component": "worker",
            "endpoint": "generate",
            "namespace": "sendon",
            "instance_id": stale,
            "transport": {"tcp": f"127.0.0.1:{port}/{stale:x}/sendon/worker/generate"},
            "device_type": "cuda",
            "request_plane_codec": "msgpack",
        }
        (discovery / "v1" / "instances" / f"sendon%2Fworker%2Fgenerate%2F{stale:x}").write_text(json.dumps(entry))
        deadline = time.monotonic() + 10
        while stale not in client.instance_ids():
            assert time.monotonic() < deadline, client.instance_ids()
            await asyncio.sleep(0.01)

        def streamer() -> Streamer:
            s = Streamer(Start(rank=1, model_dir="", model_name="", max_len=64), writer=None)
            s.client, s.presence = client, SimpleNamespace(endpoint=SimpleNamespace(connection_id=lambda: 0))
            return s

        handing_over = streamer()
        to, stream = await handing_over.send_on({"token_ids": [7]}, stale)
        got = [item.data() async for item in stream]
        rerouted = [[c async for c in streamer().reroute({"token_ids": [7]})] for _ in range(8)]
        serving.cancel()
        return to, got, handing_over.unreachable, rerouted

    to, got, unreachable, rerouted = loop.run_until_complete(run())
    live = rt.endpoint("sendon.worker.generate").connection_id()
    print(json.dumps({"to": to == live, "got": got, "unreachable": list(unreachable) == [stale], "rerouted": rerouted}))
    sys.stdout.flush()
    os._exit(0)  # the runtime's threads are not waited for


def test_a_request_sent_on_skips_an_instance_a_killed_rank_left_listed(tmp_path):
    """A request sent on (out of routing, or handed over) to such an instance goes to a live one
    instead of failing, and that instance is not tried again. In a process of its own: a runtime
    built after another one's shutdown in the same process sees no new discovery files."""
    env = {**os.environ, "DYN_FILE_KV": str(tmp_path), "DYN_TCP_RPC_HOST": "127.0.0.1"}
    env["DYN_TCP_RESPONSE_STREAM_HOST"] = "127.0.0.1"
    code = f"from tests.test_send_on import scenario; from pathlib import Path; scenario(Path({str(tmp_path)!r}))"
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result == {
        "to": True,
        "got": [{"token_ids": [1]}],
        "unreachable": True,
        "rerouted": [[{"token_ids": [1]}]] * 8,
    }
