"""The elastic flow on a GPU, as a user runs it: ranks as processes sharing the device, weights and
KV in the VMM arena, leaving ranks parked with their CUDA state checkpointed (no GPU memory held),
restored by the next scale-up, which pulls their weights from peers.

Greedy outputs under traffic equal the single-rank engine on the same GPU across 2 -> 4 -> 2 -> 4;
every joining rank serves requests after its commit; no rank recaptures a CUDA graph, including
the restored ones (their graphs replay over weights remapped at the same addresses)."""

from __future__ import annotations

import time

import pytest

from harness.server import Server, Traffic, engine_reference, scale

pytestmark = pytest.mark.gpu

MAX_TOKENS = 24
PROMPTS = [[5 + i, 17, 42 + i, 99, 7 * i + 3, 250] for i in range(8)]


def ranks(srv: Server) -> dict[int, dict]:
    return {v["rank"]: v for v in srv.topology()["ranks"]}


@pytest.mark.parametrize(
    "transport,small,large",
    [
        ("nixl", 2, 4),  # ranks sharing the GPU(s): the host-driven exchange
        ("window", 1, 2),  # one rank per GPU: the exchange through peer windows inside the graph
    ],
)
def test_scale_cycle_with_parked_ranks_checkpointed(transport, small, large):
    """`window` also shows a parked rank's mailbox unmapped by its peers before its CUDA
    checkpoint, and mapped again when it returns."""
    import torch

    from snapshot import cuda_checkpoint

    ok, why = cuda_checkpoint.available()
    if not ok:
        pytest.skip(why)
    if transport == "window" and torch.cuda.device_count() < large:
        pytest.skip(f"needs {large} GPUs, one per rank")
    reference = dict(enumerate(engine_reference(PROMPTS, MAX_TOKENS, device="cuda")))
    srv = Server(
        [
            "--Worker.device=cuda",
            "--Worker.vmm=true",
            f"--Worker.max_ranks={large}",
            f"--Worker.ep_transport={transport}",
            f"--Worker.dp_size={small}",
            "--Worker.max_seqs=8",
            "--Router.checkpoint_parked=true",
            "--Router.rebalance=false",
            "--Planner.enabled=false",
        ],
        boot_timeout_s=600,
    )
    try:
        with Traffic(srv, PROMPTS, MAX_TOKENS, clients=4) as traffic:
            time.sleep(2)
            first = ranks(srv)
            up = scale(srv, large)
            time.sleep(3)
            after_up = ranks(srv)
            down = scale(srv, small)
            parked = {r: after_up[r]["pid"] for r in down["parked"]}
            states = {r: cuda_checkpoint.state(pid) for r, pid in parked.items()}
            again = scale(srv, large)
            time.sleep(3)
            last = ranks(srv)
        log = srv.tail(3000)
    finally:
        srv.stop()
    assert [op["phase"] for op in (up, down, again)] == ["done"] * 3, (up, down, again, log)
    joiners = list(range(small, large))
    assert up["joined_from"] == {str(r): "cold" for r in joiners}
    assert sorted(parked) == joiners and set(states.values()) == {"checkpointed"}, states
    assert again["joined_from"] == {str(r): "parked" for r in joiners}, log
    assert "CUDA state restored" in log
    assert again["phases"]["starting"] < up["phases"]["starting"]
    assert again["pull_bytes"] > 0  # the restored ranks' weights came from peers
    # Same processes, same graphs: nothing recaptured on any rank.
    assert {r: last[r]["pid"] for r in parked} == parked
    for r in range(small):
        assert last[r]["graph_captures"] == first[r]["graph_captures"] > 0
    for r in joiners:
        assert last[r]["graph_captures"] == after_up[r]["graph_captures"] > 0
        # each joiner served after each of its commits
        assert after_up[r]["requests_total"] > 0 and last[r]["requests_total"] > after_up[r]["requests_total"]
    assert traffic.errors == []
    assert len(traffic.results) > 20
    for p, text, _, _ in traffic.results:
        assert text == reference[p], f"prompt {p}"


def test_every_serving_rank_killed_is_rebuilt_from_parked_ranks_on_the_gpu():
    """Ranks 2 and 3 park (CUDA state checkpointed) after 2 -> 4 -> 2; then ranks 0 and 1 are
    SIGKILLed. The rebuild takes the parked ranks back (CUDA restore, weights loaded from the
    checkpoint into their remapped arenas, graphs replayed, not recaptured), they serve the
    reference, and a scale-up then pulls from them."""
    import os
    import signal

    from snapshot import cuda_checkpoint

    ok, why = cuda_checkpoint.available()
    if not ok:
        pytest.skip(why)
    reference = dict(enumerate(engine_reference(PROMPTS, MAX_TOKENS, device="cuda")))
    srv = Server(
        [
            "--Worker.device=cuda",
            "--Worker.vmm=true",
            "--Worker.max_ranks=4",
            "--Worker.dp_size=2",
            "--Worker.max_seqs=8",
            "--Router.checkpoint_parked=true",
            "--Planner.enabled=false",
        ],
        boot_timeout_s=600,
    )
    try:
        assert scale(srv, 4)["phase"] == "done"
        assert scale(srv, 2)["parked"] == [2, 3]
        before = ranks(srv)
        os.kill(before[0]["pid"], signal.SIGKILL)
        os.kill(before[1]["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 300
        while True:
            ops = srv.control("GET", "/operations").json()
            rebuild = next((op for op in ops if op["kind"] == "rebuild" and op["total_s"] is not None), None)
            if rebuild and not srv.topology()["scaling"]:
                break
            assert time.monotonic() < deadline, srv.tail(200)
            time.sleep(0.5)
        assert rebuild["phase"] == "done" and rebuild["joined_from"] == {"2": "parked", "3": "parked"}, rebuild
        after = ranks(srv)
        assert srv.topology()["active"] == [2, 3]
        for r in (2, 3):
            assert after[r]["pid"] == before[r]["pid"]
            assert after[r]["graph_captures"] == before[r]["graph_captures"] > 0
        for p in range(len(PROMPTS)):
            assert srv.stream_text(PROMPTS[p], MAX_TOKENS) == reference[p], f"prompt {p}"
        up = scale(srv, 3)
        assert up["phase"] == "done" and up["pull_bytes"] > 0, up
        for p in range(len(PROMPTS)):
            assert srv.stream_text(PROMPTS[p], MAX_TOKENS) == reference[p], f"prompt {p} at 3 ranks"
    finally:
        srv.stop()
