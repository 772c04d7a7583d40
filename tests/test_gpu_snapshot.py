"""A joiner restored from a CUDA snapshot, on a GPU, as root, with real CRIU: the built-in model's
worker is baked (engine built, decode graphs captured, VMM arena released, CUDA-checkpointed,
dumped), a 1-rank CUDA deployment scales to 2 and its joiner is restored from that image (CRIU
restore, CUDA restore + unlock, arena remapped, weights pulled from rank 0); greedy tokens equal
the reference before, during and after, and the restored rank serves. The phase timings are
printed and, with $OUT set, written to $OUT/gpu_snapshot.json.

One GPU: a copy baked on cuda:0 serves as rank 1, which on a machine of several GPUs would run on
cuda:1 (and EP would use the peer-window transport, which the criu tier does not bake)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from bench.join import join_steps
from harness.server import Server, Traffic, engine_reference, scale

pytestmark = pytest.mark.gpu

MAX_TOKENS = 24
MAX_LEN = 1024  # given, not computed from free GPU memory: the router and the baker agree on it
PROMPTS = [[5 + i, 17, 42 + i, 99, 7 * i + 3, 250] for i in range(8)]


def test_a_joiner_restored_from_a_cuda_snapshot_serves_the_reference(tmp_path, monkeypatch):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0])
    from snapshot import cuda_checkpoint
    from snapshot.bake import bake
    from snapshot.criu import criu_status

    ok, why = cuda_checkpoint.available()
    assert ok, why
    ok, why = criu_status()
    assert ok, why
    root = tmp_path / "store"
    root.mkdir()
    t0 = time.perf_counter()
    snap, m = bake(root / "cuda", device="cuda", tier="criu", max_ranks=3, max_seqs=8, max_len=MAX_LEN, progress=False)
    bake_s = time.perf_counter() - t0
    assert m.tier == "criu" and m.device_type == torch.cuda.get_device_name(0)
    assert m.driver_version and m.cuda_version == torch.version.cuda
    warm = json.loads((snap / "warmup.json").read_text())
    assert warm["arena_released_bytes"] > 0 and warm["cuda_graph_captures"] > 0
    reference = dict(enumerate(engine_reference(PROMPTS, MAX_TOKENS, device="cuda")))
    srv = Server(
        [
            "--Worker.device=cuda",
            "--Worker.vmm=true",
            "--Worker.dp_size=1",
            "--Worker.max_ranks=3",
            "--Worker.max_seqs=8",
            f"--Worker.max_len={MAX_LEN}",
            f"--Worker.snapshot_root={root}",
            "--Planner.enabled=false",
        ],
        boot_timeout_s=600,
    )
    try:
        before = [srv.stream_text(q, MAX_TOKENS) for q in PROMPTS]
        with Traffic(srv, PROMPTS, MAX_TOKENS, clients=4) as traffic:
            up = scale(srv, 3)  # two joiners restored from the one image at once
            deadline = time.monotonic() + 120
            while up["phase"] == "done" and time.monotonic() < deadline:  # until the restored rank served
                ranks = {r["rank"]: r for r in srv.topology()["ranks"]}
                if min(ranks[r]["requests_total"] for r in (1, 2)) >= 4:
                    break
                time.sleep(0.2)
        after = [srv.stream_text(q, MAX_TOKENS) for q in PROMPTS]
        ranks = {r["rank"]: r for r in srv.topology()["ranks"]}
        log = srv.output
    finally:
        srv.stop()
    timings = {
        "bake_s": round(bake_s, 3),
        "image_bytes": m.image_bytes,
        "cuda_checkpoint_s": warm.get("cuda_checkpoint_s"),
        "image_memory": warm.get("image_memory"),  # what fills the image, before and after the CUDA checkpoint
        "phases_s": up.get("phases"),
        "total_s": up.get("total_s"),
        "restore_s": join_steps(log, 1, up["id"]),
    }
    print("\nCUDA snapshot join:", json.dumps(timings, indent=2))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_snapshot.json").write_text(json.dumps(timings, indent=2) + "\n")
    tail = "\n".join(log.splitlines()[-150:])
    assert up["phase"] == "done", (up, tail)
    assert up["joined_from"] == {"1": "snapshot", "2": "snapshot"}, (up["snapshot_refused"], tail)
    for r in (1, 2):
        assert ranks[r]["started_from"] == "snapshot" and ranks[r]["state"] == "ACTIVE"
        assert ranks[r]["requests_total"] >= 4, ranks[r]
        assert ranks[r]["graph_captures"] > 0  # captured before the dump, replayed after the restore
    assert "CUDA state restored in" in log and "VMM arena remapped in" in log
    assert before == after == [reference[i] for i in range(len(PROMPTS))]
    assert traffic.errors == []
    assert [(p, text) for p, text, _, _ in traffic.results if text != reference[p]] == []
