"""WeightStore.pull over real NIXL/UCX between real processes (CPU DRAM; a GPU variant where CUDA is).

Sources are `python -m harness.weight_peer` processes serving deterministic weights
(harness/weight_peer.make_weights); the test process is the joiner and checks what it pulled
byte-for-byte against the same function.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import msgspec
import pytest
import torch

from components.engine.weights.checksum import checksum, checksums
from components.engine.weights.store import WeightStore, WeightTransferError
from components.protocol.placement import Placement
from components.protocol.transfer import PullItem, SourceLoss, replan, spread
from harness.server import freeze
from harness.weight_peer import N_SLOTS, NON_EXPERT, Sources, fresh_like, make_weights

ROOT = Path(__file__).resolve().parent.parent
BIG_MB = 256  # each source holds 256 MB of "big" tensors; spread() pulls half from each


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    """Ranks 0 and 1 serve healthy weights (same non-expert tensors, different experts); rank 2
    serves a corrupted `embed`; rank 3 exits right after its manifest. Started together so the
    interpreter start-ups overlap."""
    s = Sources(tmp_path_factory.mktemp("weights"))
    s.spawn(0, "--big-mb", str(BIG_MB))
    s.spawn(1, "--big-mb", str(BIG_MB))
    s.spawn(2, "--corrupt", "embed")
    s.spawn(3, "--exit-early")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def expected():
    return {r: make_weights(r, big_mb=BIG_MB) for r in (0, 1)}


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8).cpu()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bytes(a), _bytes(b))


def test_pull_from_two_sources(src, expected):
    m = {r: src.manifest(r) for r in (0, 1)}
    sizes = {d.name: d.nbytes for d in m[0].tensors}
    items = spread(NON_EXPERT, [0, 1], sizes)
    # Experts per a target expert map: slots 0-3 from rank 0, 4-7 from rank 1.
    items += [PullItem(s // 4, f"experts.0.{s}.gate", f"experts.0.{s}.gate") for s in range(N_SLOTS)]
    calls: list[tuple[int, int]] = []
    with WeightStore(7, fresh_like(expected[0])) as local:
        assert local.num_regions == len(NON_EXPERT) + 1  # the slot views share moe.w_gate's region
        stats = local.pull(items, m, timeout_s=60, progress=lambda d, t: calls.append((d, t)))

        for n in NON_EXPERT:
            assert _same(local.tensors[n], expected[0][n]), n
        for s in range(N_SLOTS):
            assert _same(local.tensors[f"experts.0.{s}.gate"], expected[s // 4][f"experts.0.{s}.gate"]), s
        total = sum(sizes[it.src_name] for it in items)
        assert stats.tensors == len(items) and stats.bytes == total
        assert set(stats.per_source) == {0, 1} and sum(stats.per_source.values()) == total
        big = 4 * (BIG_MB << 20) // 4
        assert min(stats.per_source.values()) > big // 3, stats.per_source  # spread balanced the big ones
        assert calls and calls[-1] == (total, total)
        assert all(a[0] <= b[0] for a, b in zip(calls, calls[1:]))
        for r in (0, 1):
            done = src.done(r)
            assert any(e["rank"] == 7 and e["ok"] and e["bytes"] == stats.per_source[r] for e in done), done
        print(
            f"\npulled {stats.bytes / 2**20:.0f} MiB in {stats.tensors} tensors from ranks {sorted(stats.per_source)}: "
            f"{stats.gbps:.2f} GB/s end to end ({stats.seconds:.3f}s), "
            f"{stats.bytes / stats.transfer_seconds / 1e9:.2f} GB/s transfer only ({stats.transfer_seconds:.3f}s), "
            f"verify {stats.verify_seconds:.3f}s"
        )


def test_slot_view_lands_in_right_slot(src, expected):
    m = {1: src.manifest(1)}
    with WeightStore(8, fresh_like(expected[1])) as local:
        local.pull([PullItem(1, "experts.0.5.gate", "experts.0.2.gate")], m, timeout_s=30)
        buf = local.tensors["moe.w_gate"]
        assert _same(buf[2], expected[1]["experts.0.5.gate"])
        others = [s for s in range(N_SLOTS) if s != 2]
        assert not buf[others].any(), "bytes landed outside the destination slot"
        assert not _same(buf[2], expected[1]["experts.0.2.gate"])


def test_pull_from_self(src, expected):
    """A rebalance may plan a rank to copy an expert between two of its own slots: such items are
    local copies (no NIXL, no manifest of our own needed), counted and verified like the rest."""
    slot = expected[1]["experts.0.0.gate"].numel() * 2
    before = make_weights(9)
    with WeightStore(9, make_weights(9)) as local:
        stats = local.pull([PullItem(9, "experts.0.5.gate", "experts.0.2.gate")], {}, timeout_s=30)
        assert _same(local.tensors["experts.0.2.gate"], before["experts.0.5.gate"])
        assert _same(local.tensors["experts.0.5.gate"], before["experts.0.5.gate"])
        assert (stats.tensors, stats.bytes, stats.local_bytes, stats.ipc_bytes) == (1, slot, slot, 0)
        assert stats.per_source == {9: slot}

        # Mixed with a remote source, our own manifest given too: slots 2 and 5 swap places, slot 6
        # goes to slot 7 while slot 6 is refilled from rank 1 (each read before it is written).
        now = {n: t.clone() for n, t in local.tensors.items()}
        m = {1: src.manifest(1), 9: local.manifest()}
        items = [
            PullItem(9, "experts.0.5.gate", "experts.0.2.gate"),
            PullItem(9, "experts.0.2.gate", "experts.0.5.gate"),
            PullItem(1, "experts.0.6.gate", "experts.0.6.gate"),
            PullItem(9, "experts.0.6.gate", "experts.0.7.gate"),
            PullItem(1, "embed", "embed"),
        ]
        calls: list[tuple[int, int]] = []
        stats = local.pull(items, m, timeout_s=30, progress=lambda d, t: calls.append((d, t)))
        got = local.tensors
        assert _same(got["experts.0.2.gate"], now["experts.0.5.gate"])
        assert _same(got["experts.0.5.gate"], now["experts.0.2.gate"])
        assert _same(got["experts.0.7.gate"], now["experts.0.6.gate"])
        assert _same(got["experts.0.6.gate"], expected[1]["experts.0.6.gate"])
        assert _same(got["embed"], expected[1]["embed"])
        for s in (0, 1, 3, 4):
            assert _same(got[f"experts.0.{s}.gate"], now[f"experts.0.{s}.gate"]), s
        remote = slot + expected[1]["embed"].numel() * 4
        assert stats.per_source == {9: 3 * slot, 1: remote}
        assert (stats.tensors, stats.bytes, stats.local_bytes) == (5, 3 * slot + remote, 3 * slot)
        assert calls and calls[-1] == (stats.bytes, stats.bytes)
        # Rank 1 already holds earlier pullers' notifications: wait for ours.
        deadline = time.monotonic() + 10
        while not any(e["rank"] == 9 for e in src.done(1)) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert [(e["ok"], e["bytes"]) for e in src.done(1) if e["rank"] == 9] == [(True, remote)]

        with pytest.raises(WeightTransferError, match=r"tensor nope from rank 9: this rank has no such tensor"):
            local.pull([PullItem(9, "nope", "embed")], {})


def test_mismatch_refused_before_transfer(src, expected):
    m = {0: src.manifest(0)}
    dst = fresh_like(expected[0])
    dst["embed"] = torch.zeros(1000, 32)  # wrong shape
    dst["norm"] = torch.zeros(4096, dtype=torch.float16)  # wrong dtype, same size
    with WeightStore(8, dst) as local:
        # A valid item first: nothing at all may be transferred when any item is refused.
        with pytest.raises(WeightTransferError) as ei:
            local.pull([PullItem(0, "attn.qkv", "attn.qkv"), PullItem(0, "embed", "embed")], m, timeout_s=30)
        msg = str(ei.value)
        assert "tensor embed from rank 0" in msg and "[1000, 64]" in msg and "[1000, 32]" in msg, msg
        assert "nothing was transferred" in msg
        with pytest.raises(WeightTransferError, match=r"tensor norm from rank 0: source is bfloat16.*float16"):
            local.pull([PullItem(0, "attn.qkv", "attn.qkv"), PullItem(0, "norm", "norm")], m, timeout_s=30)
        with pytest.raises(WeightTransferError, match=r"tensor nope from rank 0: not in that rank's manifest"):
            local.pull([PullItem(0, "nope", "embed")], m)
        with pytest.raises(WeightTransferError, match=r"no manifest for rank 5"):
            local.pull([PullItem(5, "embed", "embed")], m)
        with pytest.raises(WeightTransferError, match=r"overlaps"):
            local.pull(
                [PullItem(0, "moe.w_gate", "moe.w_gate"), PullItem(0, "experts.0.1.gate", "experts.0.1.gate")], m
            )
        assert not local.tensors["attn.qkv"].any()
        # The store is still usable after refusals.
        local.pull([PullItem(0, "attn.qkv", "attn.qkv")], m, timeout_s=30)
        assert _same(local.tensors["attn.qkv"], expected[0]["attn.qkv"])


def test_corrupted_source_is_caught(src):
    m = {2: src.manifest(2), 0: src.manifest(0)}
    w2 = make_weights(2)
    with WeightStore(8, fresh_like(w2)) as local:
        items = [PullItem(2, "embed", "embed"), PullItem(2, "norm", "norm"), PullItem(0, "attn.qkv", "attn.qkv")]
        with pytest.raises(WeightTransferError) as ei:
            local.pull(items, m, timeout_s=30)
        msg = str(ei.value)
        assert "tensor embed from rank 2: checksum mismatch" in msg, msg
        assert "norm" not in msg.split("(source")[0]
        assert _same(local.tensors["norm"], w2["norm"])  # the rest arrived intact
        done = src.done(2)
        assert any(e["rank"] == 8 and not e["ok"] for e in done), done


def test_dead_source_raises(src, expected):
    m = {3: src.manifest(3)}
    src.procs[3].wait(timeout=30)
    with WeightStore(8, fresh_like(expected[0])) as local:
        t0 = time.monotonic()
        with pytest.raises(WeightTransferError, match=r"rank 3") as ei:
            local.pull([PullItem(3, "embed", "embed")], m, timeout_s=3.0)
        dt = time.monotonic() - t0
        assert dt < 3.0 + 2.0, dt
        print(f"\ndead source reported after {dt:.3f}s: {ei.value}")


@pytest.mark.parametrize("how", ["kill", "stop", "stop, then kill"])
def test_source_vanishes_between_pulls(tmp_path, expected, how):
    """A source that served once, then dies (UCX sees the disconnect), freezes (SIGSTOP: only the
    timeout can tell), or freezes and is killed while our READs wait on it (NIXL raises the
    disconnect from the state poll). Its agent is already loaded, so this is the path through
    the xfer states."""
    s = Sources(tmp_path)
    s.spawn(4)
    try:
        m = {4: s.manifest(4)}
        w = make_weights(4)
        with WeightStore(8, fresh_like(w)) as local:
            if how == "kill":
                local.pull([PullItem(4, "embed", "embed")], m, timeout_s=30)
                s.procs[4].kill()
                s.procs[4].wait()
            else:
                if how == "stop, then kill":
                    local.pull([PullItem(4, "embed", "embed")], m, timeout_s=30)
                    threading.Timer(0.5, s.procs[4].kill).start()
                freeze(s.procs[4].pid)
            timeout = 2.0
            t0 = time.monotonic()
            with pytest.raises(WeightTransferError, match=r"rank 4") as ei:
                local.pull([PullItem(4, "norm", "norm"), PullItem(4, "attn.qkv", "attn.qkv")], m, timeout_s=timeout)
            dt = time.monotonic() - t0
            assert dt < timeout + 2.0, dt
            if how == "stop":
                assert "did not finish" in str(ei.value), ei.value
            if how == "stop, then kill":
                assert "READ of norm, attn.qkv failed: NIXL_ERR_REMOTE_DISCONNECT" in str(ei.value), ei.value
            print(f"\n{how}: reported after {dt:.3f}s: {ei.value}")
    finally:
        s.stop()


def test_a_dropped_source_costs_only_its_items(tmp_path, expected):
    """Source 5 freezes (SIGSTOP) with our READs from it posted: they never fail, only the pull's
    timeout would tell. The router's word (drop_sources, from another thread, as the worker's
    control handler calls it) ends them at once; with `partial` the other source's items are
    pulled and verified and source 5's come back as lost, and a later pull does not start to
    read from it. Without `partial` the pull fails naming it."""
    s = Sources(tmp_path)
    s.spawn(4)
    s.spawn(5)
    try:
        m = {r: s.manifest(r) for r in (4, 5)}
        w = make_weights(4)
        with WeightStore(8, fresh_like(w)) as local:
            local.pull([PullItem(5, "embed", "embed")], m, timeout_s=30)  # connected: READs to it get posted
            freeze(s.procs[5].pid)
            items = [PullItem(4, "norm", "norm"), PullItem(5, "attn.qkv", "attn.qkv"), PullItem(5, "odd", "odd")]
            threading.Timer(0.5, local.drop_sources, [{m[5].agent: "rank 5 failed (the test says)"}]).start()
            stats = local.pull(items, m, timeout_s=120, partial=True)
            assert stats.lost == [SourceLoss(5, "rank 5: dropped mid-pull: rank 5 failed (the test says)", items[1:])]
            assert (stats.tensors, set(stats.per_source)) == (1, {4}) and stats.bytes == m[4].tensors[1].nbytes
            assert _same(local.tensors["norm"], w["norm"])

            later = [PullItem(4, "half3", "half3"), PullItem(5, "odd", "odd")]
            stats = local.pull(later, m, timeout_s=120, partial=True)
            assert [(g.src_rank, g.reason) for g in stats.lost] == [
                (5, "rank 5: dropped before the pull: rank 5 failed (the test says)")
            ]
            assert _same(local.tensors["half3"], w["half3"])
            with pytest.raises(WeightTransferError, match=r"^pull into rank 8 failed: rank 5: dropped before the pull"):
                local.pull([PullItem(5, "odd", "odd")], m, timeout_s=120)
    finally:
        s.stop()


# ---------------------------------------------------------------- in-process (no transfers)


def test_checksum_properties():
    g = torch.Generator().manual_seed(0)
    t = torch.randn(4096, generator=g)
    c = checksum(t)
    assert checksum(t.clone()) == c
    assert checksum(t.view(torch.int32)) == c  # bytes, not dtype
    assert checksum(t.view(2, -1).flip(0).contiguous()) != c  # swapped halves
    # Halves a multiple of 251 words long fool a (index % 251) weighting alone.
    x = torch.randint(-1000, 1000, (251 * 6,), dtype=torch.int32, generator=g)
    assert checksum(x.view(2, -1).flip(0).contiguous()) != checksum(x)
    y = t.clone()
    y.view(torch.uint8)[1234] ^= 1
    assert checksum(y) != c
    # Odd and 16-bit sizes, empty, 0-dim, and a view whose offset is not word-aligned.
    b = torch.arange(11, dtype=torch.uint8)
    assert checksum(b) == checksum(b.clone()) != checksum(b.flip(0))
    h = torch.arange(10, dtype=torch.bfloat16)
    assert checksum(h[1:5]) == checksum(h[1:5].clone())
    assert checksum(torch.empty(0)) == 0
    assert checksum(torch.tensor(3.0)) == checksum(torch.tensor([3.0]))
    assert checksums([t, x, b]) == [checksum(t), checksum(x), checksum(b)]
    # Larger than one checksum chunk, with a partial last row.
    z = torch.randint(-(2**31), 2**31 - 1, (251 * (1 << 14) + 1000,), dtype=torch.int32, generator=g)
    zs = z.clone()
    zs[:500], zs[-500:] = z[-500:].clone(), z[:500].clone()
    assert checksum(z) == checksum(z.clone()) != checksum(zs)
    with pytest.raises(ValueError):
        checksum(torch.zeros(4, 4).t())


def test_spread_balances_by_size():
    names = ["a", "b", "c", "d", "e"]
    sizes = {"a": 10, "b": 100, "c": 60, "d": 50, "e": 5}
    items = spread(names, [3, 1], sizes)
    assert [i.src_name for i in items] == names and all(i.src_name == i.dst_name for i in items)
    got = {i.src_name: i.src_rank for i in items}
    # b->3 (100), c->1 (60), d->1 (110), a->3 (110), e->3 (115, tie goes to the first source)
    assert got == {"b": 3, "c": 1, "d": 1, "a": 3, "e": 3}
    assert {i.src_rank for i in spread(names, [0, 1, 2])} == {0, 1, 2}
    with pytest.raises(ValueError):
        spread(names, [])


def test_replan_reads_what_a_lost_source_held_from_the_other_holders():
    # 2 slots per rank; rank 1 is lost. Expert 2 is on ranks 0 and 2, expert 3 only on rank 1.
    planned = Placement(2, [[0, 2, 3, 1, 2, 0]])
    lost = [
        PullItem(1, "embed", "embed"),
        PullItem(1, "norm", "norm"),
        PullItem(1, "experts.0.1.gate", "experts.0.6.gate"),  # expert 1, into the joiner's slot 6
        PullItem(1, "experts.0.1.up", "experts.0.6.up"),
        PullItem(1, "experts.0.0.gate", "experts.0.7.gate"),  # expert 3
    ]
    # After the failover: expert 3 was reloaded into rank 0's duplicate slot 1, expert 1 into rank 2's slot 5.
    where = Placement(2, [[0, 3, -1, -1, 2, 1]])
    got = replan(lost, planned, where, [0, 2], dst=3, sizes={"embed": 100, "norm": 10})
    assert got == [
        PullItem(0, "embed", "embed"),
        PullItem(2, "norm", "norm"),
        PullItem(2, "experts.0.1.gate", "experts.0.6.gate"),  # both parts of one slot from one replica
        PullItem(2, "experts.0.1.up", "experts.0.6.up"),
        PullItem(0, "experts.0.1.gate", "experts.0.7.gate"),
    ]
    # A serving rank reads another rank's replica before its own, and its own when it is the only one.
    own = Placement(2, [[3, -1, 1, 0, -1, -1]])  # rank 0's slot 1 is being filled
    item = [PullItem(2, "experts.0.0.down", "experts.0.1.down")]
    assert replan(item, Placement(2, [[3, -1, 1, 0, 1, -1]]), own, [0, 1], dst=0) == [
        PullItem(1, "experts.0.0.down", "experts.0.1.down")
    ]
    assert replan(item, Placement(2, [[3, -1, 1, 0, 3, -1]]), own, [0, 1], dst=0) == [
        PullItem(0, "experts.0.0.down", "experts.0.1.down")
    ]
    # No live holder: every orphan named.
    with pytest.raises(ValueError, match=r"^no live rank holds experts\.0\.7\.gate \(of ranks \[0, 2\]\)$"):
        replan(lost[4:], planned, Placement(2, [[0, 2, -1, -1, 2, 1]]), [0, 2], dst=3)
    with pytest.raises(ValueError, match=r"^no live rank holds embed, norm, experts\.0\.6\.gate and 2 more \(of"):
        replan(lost, planned, where, [3], dst=3)


def test_store_validates_tensors():
    with pytest.raises(ValueError, match="not contiguous"):
        WeightStore(0, {"w": torch.zeros(4, 4).t()})
    with WeightStore(0, make_weights(0)) as st:
        assert st.num_regions == 6  # embed, norm, attn.qkv, odd, half3, moe.w_gate (+ 8 slot views)
        man = st.manifest(["experts.0.3.gate", "embed"])
        d = {t.name: t for t in man.tensors}
        assert d["experts.0.3.gate"].addr == st.tensors["moe.w_gate"][3].data_ptr()
        assert d["experts.0.3.gate"].shape == [64, 32] and d["experts.0.3.gate"].dtype == "bfloat16"
        assert d["embed"].checksum == checksum(st.tensors["embed"])
        with pytest.raises(KeyError):
            st.manifest(["missing"])
    st.close()  # idempotent
    with pytest.raises(WeightTransferError, match="closed"):
        st.manifest()


@pytest.mark.gpu
@pytest.mark.parametrize("memory", ["torch", "vmm"])
def test_pull_two_sources_gpu(tmp_path, memory):
    """Same-node sources are copied from directly: CUDA IPC for torch allocations, the lent arena
    for weights in a VMM arena; both end with the same bytes."""
    s = Sources(tmp_path)
    for r in (0, 1):
        s.spawn(r, "--big-mb", str(BIG_MB), "--device", "cuda", *(["--vmm"] if memory == "vmm" else []))
    try:
        m = {r: s.manifest(r) for r in (0, 1)}
        exp = {r: make_weights(r, big_mb=BIG_MB) for r in (0, 1)}
        sizes = {d.name: d.nbytes for d in m[0].tensors}
        items = spread(NON_EXPERT, [0, 1], sizes)
        items += [PullItem(s_ // 4, f"experts.0.{s_}.gate", f"experts.0.{s_}.gate") for s_ in range(N_SLOTS)]
        dst = {k: v.cuda() for k, v in fresh_like(exp[0]).items() if k != "moe.w_gate" and not k.startswith("experts")}
        buf = torch.zeros_like(exp[0]["moe.w_gate"], device="cuda")
        dst["moe.w_gate"] = buf
        dst.update({f"experts.0.{i}.gate": buf[i] for i in range(N_SLOTS)})
        with WeightStore(7, dst, device="cuda") as local:
            stats = local.pull(items, m, timeout_s=60)
            for n in NON_EXPERT:
                assert _same(local.tensors[n], exp[0][n]), n
            for i in range(N_SLOTS):
                assert _same(local.tensors[f"experts.0.{i}.gate"], exp[i // 4][f"experts.0.{i}.gate"]), i
            assert set(stats.per_source) == {0, 1}
            assert stats.ipc_bytes == stats.bytes, "a same-node source was read over NIXL"
            assert (m[0].vmm != []) == (memory == "vmm")
            # Same bytes, same checksum on either device.
            assert checksum(local.tensors["embed"]) == checksum(exp[0]["embed"])
            print(
                f"\nGPU: pulled {stats.bytes / 2**20:.0f} MiB from 2 sources: {stats.gbps:.2f} GB/s end to end, "
                f"{stats.bytes / stats.transfer_seconds / 1e9:.2f} GB/s transfer only"
            )
    finally:
        s.stop()


@pytest.mark.gpu
def test_a_region_that_cannot_be_opened_sends_its_source_to_nixl(tmp_path, caplog):
    """Rank 0's largest region is copied first; another of its regions then fails to open (its
    CUDA IPC handle zeroed in the manifest). Rank 0 is read over NIXL instead, after the copy
    already launched from it, and every byte lands; rank 1 is still copied directly."""
    s = Sources(tmp_path)
    for r in (0, 1):
        s.spawn(r, "--big-mb", str(BIG_MB), "--device", "cuda")
    try:
        m = {r: s.manifest(r) for r in (0, 1)}
        sizes = {d.name: d.nbytes for d in m[0].tensors}
        items = spread(NON_EXPERT, [0, 1], sizes)
        from0 = sorted((it.src_name for it in items if it.src_rank == 0), key=sizes.get)
        assert sizes[from0[0]] < sizes[from0[-1]]  # the one made to fail is not copied first
        bad = next(d.addr for d in m[0].tensors if d.name == from0[0])
        m[0] = msgspec.structs.replace(
            m[0],
            ipc=[
                msgspec.structs.replace(g, handle=bytes(len(g.handle))) if g.base <= bad < g.base + g.nbytes else g
                for g in m[0].ipc
            ],
        )
        exp = make_weights(0, big_mb=BIG_MB)
        dst = {n: torch.zeros_like(exp[n], device="cuda") for n in NON_EXPERT}
        with caplog.at_level(logging.WARNING), WeightStore(7, dst, device="cuda") as local:
            stats = local.pull(items, m, timeout_s=60)
        for n in NON_EXPERT:
            assert _same(dst[n], exp[n]), n
        assert stats.ipc_bytes == stats.per_source[1] < stats.bytes
        assert "cannot map rank 0's memory directly" in caplog.text
    finally:
        s.stop()


@pytest.mark.gpu
def test_checksum_same_on_cpu_and_cuda():
    g = torch.Generator().manual_seed(1)
    ts = [
        torch.randn(251 * (1 << 14) * 2 + 777, generator=g),  # several chunks and a partial row
        torch.randn(4097, generator=g).to(torch.bfloat16),  # 16-bit words
        torch.randint(0, 256, (13,), dtype=torch.uint8, generator=g),  # bytes
        torch.empty(0),
    ]
    assert [checksum(t.cuda()) for t in ts] == [checksum(t) for t in ts]
    assert checksums([t.cuda() for t in ts]) == checksums(ts)
