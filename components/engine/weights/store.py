"""Weight transfer for scale-up: a joining rank READs its weights from serving ranks over NIXL.

Why it is built this way:

* Final addresses. A joiner allocates its weights where they will live (CUDA graphs captured later
  hold those addresses), so data is READ straight into them; nothing is staged or copied after.
  Every tensor handed to a WeightStore is a contiguous view; views often share one buffer (an
  expert slot is ``w_gate[slot]``), so each distinct storage is registered once and descriptors
  address sub-ranges of it. Registration happens once at construction: it is slow, and the
  metadata a peer loaded stays valid only while the registrations do.
* One-sided READ, pulled by the joiner. The serving ranks keep serving; the joiner decides what to
  read from whom (``spread`` for non-expert weights, the target expert map for experts) and drives
  the transfers. Many tensors go into one request per source (or a few, bounded by
  ``_REQ_BYTES``): a model has thousands of tensors and per-request overhead dominates small ones.
  Requests for all sources are posted before any is waited on, so transports that run
  asynchronously (CUDA IPC, RDMA) read from every source at once. A same-node VRAM source is
  copied from directly instead (same_node.py).
* A pull may name this rank itself as a source (a rebalance moving an expert between two of its
  own slots): such items are a local copy, done before anything else writes, from sources staged
  first where the same pull also writes them (two slots swapped), and verified like the rest.
* A source must make UCX progress to be readable: the joiner's first READ needs a connection
  handshake the target has to answer. NIXL's own progress thread would do it but spins a full core
  forever (its poll delay is fixed at 0 by the Python API), which a serving rank cannot spare. So a
  WeightStore whose manifest has been handed out runs a light thread that polls the agent every
  ``serve_interval_s`` (which also collects the joiners' completion notifications), until
  ``stop_serving``/``close``.
* Checksums from the source. Each TensorDesc carries a checksum (checksum.py) computed at the
  source when the manifest is made; the joiner recomputes it over its destination as each
  request's data lands, so on a GPU the checks of early requests run while later ones are in
  flight. This catches a wrong address, a wrong slot, a short read and a source whose memory does
  not hold what it claims. A same-node copy on one GPU is summed by the kernel that copies it
  (copy_checksums_later): reading 8.6 GB once instead of twice is most of the pull's speed,
  and the sum is of the bytes as read, which are the bytes written where the pull planned.
* No hangs. A pull is bounded by ``timeout_s``; a source that disappears (NIXL reports ERR) or
  stays silent gives a WeightTransferError naming it. Requests to healthy sources are allowed to
  finish first, so they are not still writing into our weights when pull() raises; a timed-out
  request is aborted (NIXL release) and its destinations must be treated as garbage.
* A lost source costs only its items, where the caller can read them elsewhere (``partial``: the
  router plans them again onto other holders): they come back in ``PullStats.lost``, the rest is
  pulled and verified. A stalled source never fails a READ, and a dead one may not be noticed
  before the timeout; the router, which finds failed ranks, says so (``drop_sources``), and the
  pull gives up on them at once. A lost source's requests are released and its agent forgotten
  before pull() returns: nothing of it writes into our weights once the caller re-plans.
* No pickle on the wire: manifests and notifications are msgspec Structs (msgpack).

Threading: NIXL agents are created without internal locking, so every agent call goes through the
NixlAgent's lock (the serve thread polls concurrently); pull() calls are serialized by a second lock.
"""

from __future__ import annotations

import bisect
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable

import msgspec
import torch

from components.engine.exchange.nixl_agent import NixlAgent, NixlError, PeerMetadataError, nixl_memory
from components.engine.weights.checksum import checksums, checksums_later, copy_checksums_later, fused_copy_ok
from components.engine.weights.same_node import Entry, SameNodeExport, SameNodeImports, node_id
from components.protocol.transfer import PullItem, PullStats, SourceLoss, TensorDesc, WeightManifest

log = logging.getLogger(__name__)

_REQ_BYTES = 256 << 20  # bytes per xfer request: few requests, but progress still reported in steps
_YIELD_S = 0.005
_SLEEP_S = 0.0005


class WeightTransferError(RuntimeError):
    """A pull could not complete or produced bad data; the message names the tensor and/or source rank."""


class PullDone(msgspec.Struct, frozen=True, tag="wt-done", array_like=True):
    """Notification a puller sends each source once it no longer reads from it."""

    rank: int  # the puller
    agent: str
    tensors: int  # read from this source
    bytes: int
    ok: bool  # every tensor from this source matched its checksum
    op: str = "-"  # the scale operation pulling, for the source's log


_done_encoder = msgspec.msgpack.Encoder()
_done_decoder = msgspec.msgpack.Decoder(PullDone)


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


# ---------------------------------------------------------------------------------------- planning


class _Xfer:
    """One READ request: many tensors from one source."""

    __slots__ = ("src", "items", "nbytes", "handle", "state")

    def __init__(self, src: int):
        self.src = src
        self.items: list[Entry] = []
        self.nbytes = 0
        self.handle = None
        self.state = "NEW"  # NEW -> PROC -> DONE | ERR


class _Checks:
    """Checksums of a pull's destinations, started as each request's data lands: on a GPU they run
    while later transfers are still in flight (checksums_later); compared once all have landed."""

    def __init__(self):
        self._started: list[tuple[list[str], Callable[[], list[int]]]] = []

    def start(self, entries: list[Entry]) -> None:
        if entries:
            self._started.append(([it.dst_name for it, _, _ in entries], checksums_later(t for _, _, t in entries)))

    def copy(self, entries: list[Entry], pairs) -> None:
        """Copy each (destination, source bytes) pair into its entry's destination and checksum the
        bytes in the same pass (copy_checksums_later: fused_copy_ok pairs)."""
        if entries:
            self._started.append(([it.dst_name for it, _, _ in entries], copy_checksums_later(pairs)))

    def bad(self, xfers: list[_Xfer]) -> list[tuple[PullItem, TensorDesc, int]]:
        """The items of `xfers`, in order, whose destination does not match its source's checksum."""
        got: dict[str, int] = {}
        for names, wait in self._started:
            got.update(zip(names, wait()))
        return [(it, d, got[it.dst_name]) for x in xfers for it, d, _ in x.items if got[it.dst_name] != d.checksum]


def _wait(copied: torch.cuda.Event | None) -> None:
    if copied is not None:
        copied.synchronize()


def _names(items, k: int = 3) -> str:
    names = [it.src_name for it, _, _ in items]
    s = ", ".join(names[:k])
    return s + (f" and {len(names) - k} more" if len(names) > k else "")


# ---------------------------------------------------------------------------------------- store


class WeightStore:
    """One rank's weights, registered with one NIXL agent once (addresses never change).

    As a source: ``manifest()`` describes (and checksums) tensors for a puller and starts the serve
    thread; ``pulls_done()`` reports pullers' completion notifications.
    As a joiner: ``pull()`` READs tensors from sources' manifests into this store's tensors."""

    def __init__(
        self,
        rank: int,
        tensors: dict[str, torch.Tensor],
        device: str = "cpu",
        name: str | None = None,
        serve_interval_s: float = 0.001,
        arena=None,
    ):
        """`arena`: the VmmArena holding (some of) the tensors; same-node pullers then map it
        directly (VmmExporter) instead of reading over NIXL."""
        self.rank = rank
        self.device, self.mem_type, self.dev_id = nixl_memory(device)
        self.name = name or f"weights-{rank}-{os.getpid()}"
        self.serve_interval_s = serve_interval_s

        regions: dict[int, int] = {}  # storage base -> nbytes
        storages: dict[int, object] = {}
        for n, t in tensors.items():
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"tensor {n}: not a torch.Tensor")
            if t.device != self.device:
                raise ValueError(f"tensor {n} is on {t.device}, the store is on {self.device}")
            if not t.is_contiguous():
                raise ValueError(f"tensor {n} is not contiguous: a READ fills one byte range")
            st = t.untyped_storage()
            if st.nbytes() == 0:
                continue
            base = st.data_ptr()
            if regions.get(base, 0) < st.nbytes():
                regions[base] = st.nbytes()
                storages[base] = st
        self.tensors: dict[str, torch.Tensor] = dict(tensors)
        self._regions = sorted(regions.items())
        self.node = node_id()
        self._export = SameNodeExport(self.name, self.device, [storages[b] for b, _ in self._regions], arena)
        self._imports = SameNodeImports(self.name, self.device, self.node)
        # Distinct storages never overlap, but memory handed in from outside torch could: refuse
        # rather than let UCX see overlapping registrations.
        for (a, na), (b, _) in zip(self._regions, self._regions[1:]):
            if a + na > b:
                raise ValueError(f"storage regions at 0x{a:x} (+{na}) and 0x{b:x} overlap")

        self._pull_lock = threading.Lock()
        self._dropped: dict[str, str] = {}  # source agent -> why no pull reads from it any more
        self._closed = False
        self._done: list[PullDone] = []
        self._serve_stop = threading.Event()
        self._serve_thread: threading.Thread | None = None

        t0 = time.monotonic()
        try:
            # No NIXL progress thread: it spins a core (see module docstring); we poll instead.
            self._nixl = NixlAgent(self.name)
        except NixlError as e:
            raise WeightTransferError(str(e)) from e
        if self._regions:
            self._nixl.register([(base, n, self.dev_id, "") for base, n in self._regions], mem_type=self.mem_type)
        log.info(
            "%s: NIXL agent up in %.2fs, %d tensors in %d regions (%.1f MiB) on %s",
            self.name,
            time.monotonic() - t0,
            len(self.tensors),
            len(self._regions),
            sum(n for _, n in self._regions) / 2**20,
            self.device,
        )

    # ------------------------------------------------------------------ source side

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def num_regions(self) -> int:
        return len(self._regions)

    def manifest(self, names: Iterable[str] | None = None) -> WeightManifest:
        """Describe the named tensors (all if None) with checksums computed now, and start serving:
        whoever holds the manifest may READ from this store until stop_serving()/close()."""
        self._check_open()
        names = list(self.tensors) if names is None else list(names)
        missing = [n for n in names if n not in self.tensors]
        if missing:
            raise KeyError(f"rank {self.rank}: no tensors named {missing[:5]}")
        descs = self._describe(names)
        with self._nixl.lock:
            self._check_open()
            meta = self._nixl.metadata()
        self.start_serving()
        ipc, vmm = self._export.regions()
        return WeightManifest(self.rank, self.name, meta, self.mem_type, self.dev_id, descs, self.node, ipc, vmm)

    def _describe(self, names: list[str]) -> list[TensorDesc]:
        """The named tensors as they are now, checksums included."""
        ts = [self.tensors[n] for n in names]
        return [
            TensorDesc(n, t.data_ptr(), t.numel() * t.element_size(), _dtype_name(t.dtype), list(t.shape), s)
            for n, t, s in zip(names, ts, checksums(ts))
        ]

    def start_serving(self) -> None:
        with self._nixl.lock:
            self._check_open()
            if self._serve_thread is not None and self._serve_thread.is_alive():
                return
            self._serve_stop.clear()
            self._serve_thread = threading.Thread(target=self._serve, name=f"{self.name}-serve", daemon=True)
            self._serve_thread.start()

    def stop_serving(self) -> None:
        th = self._serve_thread
        self._serve_stop.set()
        if th is not None and th is not threading.current_thread():
            th.join()
        self._serve_thread = None

    def _serve(self) -> None:
        while not self._serve_stop.wait(self.serve_interval_s):
            with self._nixl.lock:
                if self._closed:
                    return
                try:
                    self._collect_notifs()
                except Exception as e:  # a poll failure must not kill serving silently forever
                    log.warning("%s: serve poll failed: %s", self.name, e)

    def _collect_notifs(self) -> None:
        """Drain NIXL notifications (drives UCX progress). Caller holds the agent's lock."""
        for agent_name, msgs in self._nixl.agent.get_new_notifs().items():
            for raw in msgs:
                try:
                    m = _done_decoder.decode(raw)
                except (msgspec.DecodeError, msgspec.ValidationError):
                    log.warning("%s: dropping unknown notification from %s: %r", self.name, agent_name, raw[:64])
                    continue
                if m.agent != agent_name:
                    log.warning("%s: dropping notification %s sent by agent %s", self.name, m, agent_name)
                    continue
                self._done.append(m)
                log.info(
                    "[op %s] %s: rank %d finished pulling %d tensors (%d B, ok=%s)",
                    m.op,
                    self.name,
                    m.rank,
                    m.tensors,
                    m.bytes,
                    m.ok,
                )

    def pulls_done(self) -> list[PullDone]:
        """Completion notifications received so far (drained)."""
        with self._nixl.lock:
            self._check_open()
            self._collect_notifs()
            out, self._done = self._done, []
            return out

    # ------------------------------------------------------------------ joiner side

    def drop_sources(self, agents: dict[str, str]) -> None:
        """Read no more from these sources (agent name -> why): a pull in flight gives up on them
        at once, a later one from the start. Safe from any thread: one dict update."""
        self._dropped.update(agents)

    def pull(
        self,
        items: list[PullItem],
        sources: dict[int, WeightManifest],
        timeout_s: float = 60.0,
        progress: Callable[[int, int], None] | None = None,
        use_ipc: bool = True,
        partial: bool = False,
        op: str = "-",
        posted: Callable[[int, list[int]], None] | None = None,
    ) -> PullStats:
        """READ each item's source tensor into self.tensors[dst_name], then verify every checksum.

        Items whose source is this rank are copied from its own tensors (`sources` needs no
        manifest for it; one given is not used). Everything is validated before the first
        transfer. Raises WeightTransferError naming the tensor and source rank for a mismatch, a
        failed, dropped or timed-out source, or a bad checksum; with `partial`, a source that
        fails, is dropped or times out is given up on instead: its items come back in
        `PullStats.lost`, and the rest is pulled and verified. `posted(source, waiting)` is called
        after each READ is posted, with the sources whose READs are still to post (a fault
        injected there holds the pull mid-transfer)."""
        t_start = time.monotonic()
        deadline = t_start + timeout_s
        with self._pull_lock:
            self._check_open()
            plan = self._plan(items, sources)
            local = plan.pop(self.rank, [])
            if use_ipc:  # their VMM descriptors arrive while the NIXL metadata loads
                self._imports.prefetch(sources[r] for r in plan)
            lost: dict[int, str] = {}  # source rank -> why it was given up on
            for r in plan:
                why = self._dropped.get(sources[r].agent)
                if why:
                    lost[r] = f"rank {r}: dropped before the pull: {why}"
                    continue
                try:
                    self._load_source(sources[r])
                except WeightTransferError as e:
                    if not partial:
                        self._imports.close()  # the prefetched descriptors
                        raise
                    lost[r] = str(e)

            t_xfer = time.monotonic()
            checks = _Checks()
            # Before anything else writes: a source of ours may be a destination of this pull.
            local_entries = [e for x in local for e in x.items]
            _wait(self._copy(local_entries, self._local_pairs(local_entries), checks))
            # Same-node VRAM sources: copy through CUDA IPC or a lent VMM arena (same_node.py);
            # NIXL READ for everything else, and for a source whose memory could not be opened.
            direct, map_seconds = self._copy_same_node(
                {r: xs for r, xs in plan.items() if r not in lost and use_ipc and self._imports.usable(sources[r])},
                sources,
                checks,
            )
            t_direct = time.monotonic()
            per_source = {r: sum(x.nbytes for x in xs) for r, xs in plan.items() if r not in lost}
            if local:
                per_source[self.rank] = sum(x.nbytes for x in local)
            local_bytes = per_source.get(self.rank, 0)
            ipc_bytes = sum(per_source[r] for r in direct)
            total = sum(per_source.values())
            xfers, failed = self._run(
                {r: xs for r, xs in plan.items() if r not in direct and r not in lost},
                sources,
                deadline,
                local_bytes + ipc_bytes,
                total,
                progress,
                timeout_s,
                checks.start,
                posted,
            )
            lost.update(failed)
            for r in lost:
                self._forget_source(sources[r])
            if lost:
                self._progress()
            if lost and not partial:
                self._release(xfers)
                # Nothing of this pull is verified: no source may take it as done.
                self._notify_done({r: xs for r, xs in plan.items() if r not in lost}, sources, set(plan), op)
                why = "; ".join(lost[r] for r in sorted(lost))
                raise WeightTransferError(f"pull into rank {self.rank} failed: {why}")
            for r, why in sorted(lost.items()):
                total -= per_source.pop(r, 0)
                log.warning("%s: gave up on source rank %d: %s", self.name, r, why)
            kept = {r: xs for r, xs in plan.items() if r not in lost}
            t_verify = time.monotonic()
            bad = checks.bad([x for xs in (*kept.values(), local) for x in xs])
            t_end = time.monotonic()

            self._notify_done(kept, sources, {it.src_rank for it, _, _ in bad}, op)
            self._release(xfers)
            if bad:
                it, desc, got = bad[0]
                more = (
                    f" ({len(bad) - 1} more tensors also differ: {', '.join(b[0].dst_name for b in bad[1:4])})"
                    if len(bad) > 1
                    else ""
                )
                raise WeightTransferError(
                    f"tensor {it.src_name} from rank {it.src_rank}: checksum mismatch after READ into "
                    f"{it.dst_name} on rank {self.rank} (source {desc.checksum}, got {got}){more}"
                )
            gone = [SourceLoss(r, lost[r], [it for x in plan[r] for it, _, _ in x.items]) for r in sorted(lost)]
            stats = PullStats(
                tensors=len(items) - sum(len(g.items) for g in gone),
                bytes=total,
                seconds=t_end - t_start,
                per_source=per_source,
                setup_seconds=t_xfer - t_start,
                transfer_seconds=t_verify - t_xfer,
                verify_seconds=t_end - t_verify,
                ipc_bytes=ipc_bytes,
                map_seconds=map_seconds,
                copy_seconds=(t_direct - t_xfer) - map_seconds,
                local_bytes=local_bytes,
                lost=gone,
            )
            log.debug(
                "%s: pulled %d tensors, %.1f MiB from ranks %s in %.3fs (%.2f GB/s; transfer %.3fs, verify %.3fs)",
                self.name,
                stats.tensors,
                total / 2**20,
                sorted(per_source),
                stats.seconds,
                stats.gbps,
                stats.transfer_seconds,
                stats.verify_seconds,
            )
            return stats

    def _plan(self, items: list[PullItem], sources: dict[int, WeightManifest]) -> dict[int, list[_Xfer]]:
        index: dict[int, dict[str, TensorDesc]] = {}
        for r, m in sources.items():
            if m.rank != r:
                raise WeightTransferError(f"manifest given for rank {r} belongs to rank {m.rank}")
            if m.mem_type not in ("DRAM", "VRAM"):
                raise WeightTransferError(f"rank {r}: unknown memory type {m.mem_type!r} in manifest")
            index[r] = {d.name: d for d in m.tensors}
        # Our own sources are described now, before anything is written (and a manifest of ours
        # may be older than what our tensors hold).
        own = list(dict.fromkeys(it.src_name for it in items if it.src_rank == self.rank))
        if own:
            missing = [n for n in own if n not in self.tensors]
            if missing:
                raise WeightTransferError(f"tensor {missing[0]} from rank {self.rank}: this rank has no such tensor")
            index[self.rank] = {d.name: d for d in self._describe(own)}

        by_src: dict[int, list[Entry]] = {}
        seen_dst: set[str] = set()
        ranges: list[tuple[int, int, str]] = []
        for it in items:
            if it.src_rank not in index:
                raise WeightTransferError(
                    f"tensor {it.src_name} from rank {it.src_rank}: no manifest for rank {it.src_rank}"
                )
            desc = index[it.src_rank].get(it.src_name)
            if desc is None:
                raise WeightTransferError(f"tensor {it.src_name} from rank {it.src_rank}: not in that rank's manifest")
            dst = self.tensors.get(it.dst_name)
            if dst is None:
                raise WeightTransferError(
                    f"tensor {it.src_name} from rank {it.src_rank}: "
                    f"rank {self.rank} has no destination tensor {it.dst_name!r}"
                )
            if it.dst_name in seen_dst:
                raise WeightTransferError(f"tensor {it.dst_name}: destination listed twice in one pull")
            seen_dst.add(it.dst_name)
            nbytes = dst.numel() * dst.element_size()
            dshape, ddtype = list(dst.shape), _dtype_name(dst.dtype)
            if desc.shape != dshape or desc.dtype != ddtype or desc.nbytes != nbytes:
                raise WeightTransferError(
                    f"tensor {it.src_name} from rank {it.src_rank}: source is {desc.dtype}{desc.shape} "
                    f"({desc.nbytes} B) but destination {it.dst_name} on rank {self.rank} is "
                    f"{ddtype}{dshape} ({nbytes} B); nothing was transferred"
                )
            if nbytes:
                ranges.append((dst.data_ptr(), nbytes, it.dst_name))
            by_src.setdefault(it.src_rank, []).append((it, desc, dst))
        # Two views of one buffer in one pull (a slot and its whole buffer) would race each other.
        ranges.sort()
        for (a, na, an), (b, _, bn) in zip(ranges, ranges[1:]):
            if a + na > b:
                raise WeightTransferError(f"tensor {bn}: destination overlaps destination {an} in the same pull")

        plan: dict[int, list[_Xfer]] = {}
        for r, lst in by_src.items():
            xs: list[_Xfer] = []
            cur = _Xfer(r)
            for it, desc, dst in lst:
                if cur.items and cur.nbytes + desc.nbytes > _REQ_BYTES:
                    xs.append(cur)
                    cur = _Xfer(r)
                cur.items.append((it, desc, dst))
                cur.nbytes += desc.nbytes
            xs.append(cur)
            plan[r] = xs
        return plan

    def _local_pairs(self, entries) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(destination, source bytes) of each entry, copied from this rank's own tensors. A source
        that is also a destination of these copies (two slots swapped) is staged: read before any
        write."""
        dsts = sorted((t.data_ptr(), t.data_ptr() + d.nbytes) for _, d, t in entries if d.nbytes)
        ends = [b for _, b in dsts]  # destinations never overlap: sorted by start is sorted by end
        pairs = []
        for it, d, dst in entries:
            src = self.tensors[it.src_name].reshape(-1).view(torch.uint8)
            a = src.data_ptr()
            i = bisect.bisect_right(ends, a)  # the first destination ending after the source starts
            if d.nbytes and i < len(dsts) and dsts[i][0] < a + d.nbytes:
                src = src.clone()
            pairs.append((dst, src))
        return pairs

    def _copy_same_node(
        self, plan: dict[int, list[_Xfer]], sources: dict[int, WeightManifest], checks: _Checks
    ) -> tuple[set[int], float]:
        """Copy `plan`'s same-node sources through their opened memory, each batch of regions as it
        is opened (SameNodeImports.open_regions), so that opening the next overlaps the copies
        already launched. Returns the sources copied (the others are left to NIXL) and the seconds
        spent opening and closing their memory."""
        spent = 0.0
        copying: list[tuple[int, torch.cuda.Event | None]] = []
        try:
            for r, xs in plan.items():
                batches = self._imports.open_regions(sources[r], [e for x in xs for e in x.items])
                copied = None
                try:
                    while True:
                        t = time.monotonic()
                        batch = next(batches, None)
                        spent += time.monotonic() - t
                        if batch is None:
                            break
                        copied = self._copy(*batch, checks)
                except Exception as e:
                    _wait(copied)  # NIXL writes these destinations again, and what they read is closed now
                    log.warning("%s: cannot map rank %d's memory directly (%s); reading it over NIXL", self.name, r, e)
                    self._imports.close(sources[r].agent)
                    continue
                copying.append((r, copied))
            self._imports.close_descriptors()  # while the copies run
            for r, copied in copying:
                _wait(copied)
                # A process holding another's CUDA IPC memory cannot be checkpointed and restored
                # (the driver API refuses), and a joiner may be parked later: close as soon as copied.
                t = time.monotonic()
                self._imports.close(sources[r].agent)
                spent += time.monotonic() - t
        except BaseException:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # no copy may still read what is closed below
            raise
        finally:
            self._imports.close()  # what a failure left open, and prefetches no pull opened
        return {r for r, _ in copying}, spent

    def _copy(self, entries, pairs: list[tuple[torch.Tensor, torch.Tensor]], checks: _Checks):
        """Copy pair i's source bytes into entry i's destination and start checking the entries.
        Returns the event after which the copies are there (None on CPU: they already are); the
        checksums may still run. On a GPU a pair on one device is copied and checksummed in one
        pass (copy_checksums_later, which sums the bytes it copies: reading them once instead of
        twice is most of a same-node pull's speed); other pairs' checksums queue behind their
        copies, and run while the peers are unmapped and the READs are in flight."""
        one_pass = [fused_copy_ok(d, s) for d, s in pairs]
        rest = [i for i, f in enumerate(one_pass) if not f]
        for i in rest:
            dst, src = pairs[i]
            dst.view(-1).view(torch.uint8).copy_(src, non_blocking=True)
        fused = [i for i, f in enumerate(one_pass) if f]
        checks.copy([entries[i] for i in fused], [pairs[i] for i in fused])
        if not (pairs and self.device.type == "cuda"):
            checks.start([entries[i] for i in rest])
            return None
        copied = torch.cuda.Event()
        copied.record(torch.cuda.current_stream(self.device))  # cross-GPU copies end on it too
        checks.start([entries[i] for i in rest])
        return copied

    def _load_source(self, m: WeightManifest) -> None:
        if m.agent in self._nixl.peers:
            return
        try:
            self._nixl.load_peer(m.agent_metadata, m.agent)
        except PeerMetadataError as e:
            raise WeightTransferError(f"rank {self.rank}: source rank {m.rank} is unreachable: {e}") from e

    def _forget_source(self, m: WeightManifest) -> None:
        """Drop a failed source's agent so a retry reloads it from a fresh manifest."""
        self._imports.close(m.agent)
        if m.agent in self._nixl.peers:
            self._nixl.forget_peer(m.agent)

    def _run(self, plan, sources, deadline, done_bytes, total, progress, timeout_s, landed, posted=None):
        """Post every READ of `plan`, then wait for them; `done_bytes` of `total` are in already.
        `landed(items)` is called with the items of each request once they are all in. Returns the
        requests and the sources that failed, timed out or were dropped meanwhile, each with why;
        their requests are released (aborted): none of them writes any more."""
        nixl = self._nixl
        # Round-robin over sources so every source has a request in flight from the start.
        queue: list[_Xfer] = []
        depth = max(len(xs) for xs in plan.values()) if plan else 0
        for i in range(depth):
            queue.extend(xs[i] for xs in plan.values() if i < len(xs))
        failed: dict[int, str] = {}

        def report() -> None:
            if progress is not None:
                try:
                    progress(done_bytes, total)
                except Exception:
                    log.exception("%s: progress callback failed", self.name)

        for i, x in enumerate(queue):
            if x.src in failed:
                x.state = "ERR"
                continue
            m = sources[x.src]
            live = [(it, d, t) for it, d, t in x.items if d.nbytes]
            if not live:
                x.state = "DONE"
                landed(x.items)
                continue
            try:
                local = nixl.descs(self.mem_type, [(t.data_ptr(), d.nbytes, self.dev_id) for _, d, t in live])
                remote = nixl.descs(m.mem_type, [(d.addr, d.nbytes, m.dev_id) for _, d, _ in live])
                with nixl.lock:
                    x.handle = nixl.agent.initialize_xfer("READ", local, remote, m.agent)
                    x.state = nixl.agent.transfer(x.handle)
            except Exception as e:
                x.state = "ERR"
                failed[x.src] = f"rank {x.src}: READ of {_names(x.items)} could not start: {e}"
                continue
            if x.state == "ERR":
                failed[x.src] = f"rank {x.src}: READ of {_names(x.items)} failed"
            elif x.state == "DONE":
                done_bytes += x.nbytes
                landed(x.items)
                report()
            if posted is not None:
                posted(x.src, sorted({y.src for y in queue[i + 1 :]}))

        pending = [x for x in queue if x.state == "PROC"]
        spins = 0
        t0 = time.monotonic()
        while pending:
            still = []
            # A failed source's other requests are polled to the end too: nothing may still be
            # writing into our tensors when we return. A dropped one's are not (it is stalled or
            # gone): they are aborted below.
            for x in pending:
                dropped = self._dropped.get(sources[x.src].agent)
                if dropped:
                    failed.setdefault(x.src, f"rank {x.src}: dropped mid-pull: {dropped}")
                    continue
                err = ""
                try:
                    with nixl.lock:
                        st = nixl.agent.check_xfer_state(x.handle)
                except Exception as e:  # NIXL raises for a source that disconnected mid-transfer
                    st, err = "ERR", f": {e}"
                x.state = st
                if st == "PROC":
                    still.append(x)
                elif st == "DONE":
                    done_bytes += x.nbytes
                    landed(x.items)
                    report()
                else:
                    err = err or " (source gone?)"
                    failed.setdefault(x.src, f"rank {x.src}: READ of {_names(x.items)} failed{err}")
            pending = still
            if not pending:
                break
            spins += 1
            if spins > 64:
                now = time.monotonic()
                if now > deadline:
                    break
                # Spin briefly for latency, then sleep so a waiting joiner does not starve the
                # processes it reads from on a small host.
                time.sleep(0 if now < t0 + _YIELD_S else _SLEEP_S)

        for r in {x.src for x in pending}:
            left = sum(x.nbytes for x in pending if x.src == r)
            names = _names([i for x in pending if x.src == r for i in x.items])
            failed.setdefault(r, f"rank {r} did not finish within {timeout_s}s ({left} B of {names} outstanding)")
        self._release([x for x in queue if x.src in failed])
        return queue, failed

    def _notify_done(self, plan, sources, bad_src: set[int], op: str) -> None:
        """Tell each source we no longer read from it; ok=False if its data did not verify."""
        for r, xs in plan.items():
            msg = _done_encoder.encode(
                PullDone(
                    self.rank,
                    self.name,
                    sum(len(x.items) for x in xs),
                    sum(x.nbytes for x in xs),
                    r not in bad_src,
                    op,
                )
            )
            try:
                with self._nixl.lock:
                    self._nixl.agent.send_notif(sources[r].agent, msg)
            except Exception as e:  # the data is here and verified; a lost notice is the source's timeout
                log.warning("%s: completion notification to rank %d failed: %s", self.name, r, e)

    def _progress(self, polls: int = 5) -> None:
        """Let UCX retire what a failed endpoint left queued. Destroying an agent while a dead
        peer's endpoint still has queued operations aborts the process (UCX arbiter assertion);
        one progress call after the failure is enough, a few are cheap."""
        for _ in range(polls):
            with self._nixl.lock:
                if self._closed:
                    return
                try:
                    self._collect_notifs()
                except Exception as e:
                    log.warning("%s: progress poll failed: %s", self.name, e)
                    return
            time.sleep(0.001)

    def _release(self, xfers: list[_Xfer]) -> None:
        for x in xfers:
            h, x.handle = x.handle, None
            if h is None:
                continue
            self._nixl.release(h, f"{self.name}: READ handle from rank {x.src}")

    # ------------------------------------------------------------------ teardown

    def _check_open(self) -> None:
        if self._closed:
            raise WeightTransferError(f"rank {self.rank}: weight store is closed")

    def close(self) -> None:
        if self._closed:
            return
        self.stop_serving()
        self._export.close()
        self._progress()
        with self._pull_lock, self._nixl.lock:
            self._imports.shutdown()
            if self._closed:
                return
            self._closed = True
            self._nixl.close()
            log.info("%s: closed", self.name)

    def __enter__(self) -> WeightStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
