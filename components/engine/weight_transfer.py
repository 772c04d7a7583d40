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
  asynchronously (CUDA IPC, RDMA) read from every source at once.
* A source must make UCX progress to be readable: the joiner's first READ needs a connection
  handshake the target has to answer. NIXL's own progress thread would do it but spins a full core
  forever (its poll delay is fixed at 0 by the Python API), which a serving rank cannot spare. So a
  WeightStore whose manifest has been handed out runs a light thread that polls the agent every
  ``serve_interval_s`` (which also collects the joiners' completion notifications), until
  ``stop_serving``/``close``.
* Checksums from the source. Each TensorDesc carries a checksum computed at the source when the
  manifest is made; after the READs the joiner recomputes it over its destination. This catches a
  wrong address, a wrong slot, a short read and a source whose memory does not hold what it claims.
  The checksum runs on the tensor's device (no host round trip of the weights) and depends only on
  the bytes, so CPU and CUDA agree.
* No hangs. A pull is bounded by ``timeout_s``; a source that disappears (NIXL reports ERR) or
  stays silent gives a WeightTransferError naming it. Requests to healthy sources are allowed to
  finish first, so they are not still writing into our weights when pull() raises; a timed-out
  request is aborted (NIXL release) and its destinations must be treated as garbage.
* No pickle on the wire: manifests and notifications are msgspec Structs (msgpack).

Threading: NIXL agents are created without internal locking, so every agent call goes through one
lock (the serve thread polls concurrently); pull() calls are serialized by a second lock.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import msgspec
import torch

from components.protocol.transfer import (
    IpcRegion,
    PullItem,
    PullStats,
    TensorDesc,
    VmmRegion,
    WeightManifest,
)

from .nixl_agent import PeerMetadataError, deregister, forget_peer, import_nixl, load_peer, release, release_quietly

log = logging.getLogger(__name__)

_REQ_BYTES = 256 << 20  # bytes per xfer request: few requests, but progress still reported in steps
_CHUNK_WORDS = 251 * (1 << 14)  # checksum chunk (a whole number of 251-word rows): bounds temporaries
_COLS = 251
_ROW_MOD = 257
# Odd multipliers mixing the three partial sums (int64 arithmetic wraps identically everywhere).
_MIX_COL = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX_ROW = 0xC2B2AE3D27D4EB4F - (1 << 64)
_YIELD_S = 0.005
_SLEEP_S = 0.0005


class WeightTransferError(RuntimeError):
    """A pull could not complete or produced bad data; the message names the tensor and/or source rank."""


def node_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() + "@" + socket.gethostname()
    except OSError:
        return socket.gethostname()


def _ipc_regions(storages: list) -> list[IpcRegion]:
    """Export the CUDA allocations behind the store's tensors. Memory torch did not allocate
    (e.g. a CUDA VMM arena) cannot be shared this way; such regions are left to NIXL."""
    out = []
    for st in storages:
        try:
            dev, handle, size, offset, rc_handle, rc_offset, ev, ev_sync = st._share_cuda_()
        except Exception as e:
            log.info("CUDA IPC unavailable for a region at 0x%x (%s); NIXL serves it", st.data_ptr(), e)
            continue
        out.append(
            IpcRegion(
                st.data_ptr(), st.nbytes(), dev, handle, size, offset, rc_handle, rc_offset, ev or b"", bool(ev_sync)
            )
        )
    return out


class PullDone(msgspec.Struct, frozen=True, tag="wt-done", array_like=True):
    """Notification a puller sends each source once it no longer reads from it."""

    rank: int  # the puller
    agent: str
    tensors: int  # read from this source
    bytes: int
    ok: bool  # every tensor from this source matched its checksum


_done_encoder = msgspec.msgpack.Encoder()
_done_decoder = msgspec.msgpack.Decoder(PullDone)
# ---------------------------------------------------------------------------------------- checksum


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def _words(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as 1-D words. The word size depends only on the byte count (not on the
    dtype or alignment), so equal bytes give an equal checksum whatever view they came from."""
    b = t.reshape(-1).view(torch.uint8)
    n = b.numel()
    wdt = torch.int32 if n % 4 == 0 else torch.int16 if n % 2 == 0 else torch.uint8
    if wdt is torch.uint8:
        return b
    try:
        return b.view(wdt)
    except RuntimeError:  # storage offset not aligned to the word size: realign by copying
        return b.clone().view(wdt)


def _checksum_dev(t: torch.Tensor) -> torch.Tensor:
    """0-dim int64 checksum on the tensor's device (no sync).

    Words are laid out as rows of 251: the column sums weighted by (column + 1) catch moves by any
    distance that is not a multiple of 251 words, and the row sums weighted by (row % 257 + 1)
    catch those that are, so swapped blocks change the result unless they are 64507-word aligned
    and sized. Plus the plain sum. Integer arithmetic wraps mod 2**64 in any order, so CPU and CUDA
    agree bit for bit."""
    if not t.is_contiguous():
        raise ValueError("checksum needs a contiguous tensor")
    dev = t.device
    w = _words(t)
    n = w.numel()
    cols = torch.zeros(_COLS, dtype=torch.int64, device=dev)
    rowacc = torch.zeros((), dtype=torch.int64, device=dev)
    for start in range(0, n, _CHUNK_WORDS):
        c = w[start : start + _CHUNK_WORDS]
        full = c.numel() // _COLS * _COLS
        row0 = start // _COLS
        if full:
            x = c[:full].view(-1, _COLS)
            cols += x.sum(0, dtype=torch.int64)
            rows = x.sum(1, dtype=torch.int64)
            rw = torch.arange(row0, row0 + rows.numel(), device=dev, dtype=torch.int64) % _ROW_MOD + 1
            rowacc += (rows * rw).sum()
        if full < c.numel():  # only in the last chunk: a partial row
            tail = c[full:].to(torch.int64)
            cols[: tail.numel()] += tail
            rowacc += tail.sum() * ((row0 + full // _COLS) % _ROW_MOD + 1)
    colw = torch.arange(1, _COLS + 1, dtype=torch.int64, device=dev)
    return cols.sum() + (cols * colw).sum() * _MIX_COL + rowacc * _MIX_ROW


def checksum(t: torch.Tensor) -> int:
    """Order-sensitive checksum of a contiguous tensor's bytes, computed on its device."""
    return int(_checksum_dev(t).item())


def checksums(ts: Iterable[torch.Tensor]) -> list[int]:
    """checksum() of many tensors with one device sync instead of one per tensor."""
    ts = list(ts)
    if not ts:
        return []
    by_dev: dict[torch.device, list[int]] = {}
    for i, t in enumerate(ts):
        by_dev.setdefault(t.device, []).append(i)
    out = [0] * len(ts)
    for idx in by_dev.values():
        vals = torch.stack([_checksum_dev(ts[i]) for i in idx]).tolist()
        for i, v in zip(idx, vals):
            out[i] = int(v)
    return out


# ---------------------------------------------------------------------------------------- planning


class _Xfer:
    """One READ request: many tensors from one source."""

    __slots__ = ("src", "items", "nbytes", "handle", "state")

    def __init__(self, src: int):
        self.src = src
        self.items: list[tuple[PullItem, TensorDesc, torch.Tensor]] = []
        self.nbytes = 0
        self.handle = None
        self.state = "NEW"  # NEW -> PROC -> DONE | ERR


def _names(items, k: int = 3) -> str:
    names = [it.src_name for it, _, _ in items]
    s = ", ".join(names[:k])
    return s + (f" and {len(names) - k} more" if len(names) > k else "")


# ---------------------------------------------------------------------------------------- store


class WeightStore:
    """One rank's weights, registered with one NIXL agent once (addresses never change).

    As a source: ``manifest()`` describes (and checksums) tensors for a puller and starts the serve
    thread; ``pulls_done()``/``wait_pulled()`` report pullers' completion notifications.
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
        self._arena = arena
        self._exporter = None
        self._vmm: list[VmmRegion] = []
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"unsupported device {self.device}")
        self.name = name or f"weights-{rank}-{os.getpid()}"
        self.serve_interval_s = serve_interval_s
        self._on_cuda = self.device.type == "cuda"
        self.mem_type = "VRAM" if self._on_cuda else "DRAM"
        self.dev_id = self.device.index if self._on_cuda else 0

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
        # Exported on the first manifest only: a process whose memory was exported for CUDA IPC
        # (or that opened another's) cannot be checkpointed, so only serving sources pay that.
        in_arena = (lambda b: arena.ptr <= b < arena.ptr + arena.nbytes) if arena is not None else (lambda b: False)
        self._storages = (
            [storages[b] for b, _ in self._regions if not in_arena(b)] if self.device.type == "cuda" else []
        )
        self._ipc: list[IpcRegion] | None = None
        # (source agent, region base) -> (its bytes, the VmmImport to close or None)
        self._opened: dict[tuple[str, int], tuple[torch.Tensor, object]] = {}
        # Distinct storages never overlap, but memory handed in from outside torch could: refuse
        # rather than let UCX see overlapping registrations.
        for (a, na), (b, _) in zip(self._regions, self._regions[1:]):
            if a + na > b:
                raise ValueError(f"storage regions at 0x{a:x} (+{na}) and 0x{b:x} overlap")

        nixl_agent, nixl_agent_config, self._nb = import_nixl()
        self._seg = self._nb.VRAM_SEG if self._on_cuda else self._nb.DRAM_SEG
        self._lock = threading.Lock()  # every agent call
        self._pull_lock = threading.Lock()
        self._closed = False
        self._remote: dict[str, str] = {}  # agent name in a manifest -> name NIXL loaded
        self._leaked: list = []
        self._done: list[PullDone] = []
        self._serve_stop = threading.Event()
        self._serve_thread: threading.Thread | None = None

        t0 = time.monotonic()
        # No NIXL progress thread: it spins a core (see module docstring); we poll instead.
        self._agent = nixl_agent(self.name, nixl_agent_config(backends=["UCX"], enable_prog_thread=False))
        if "UCX" not in self._agent.backends:
            raise WeightTransferError("NIXL UCX backend is not available (plugin missing)")
        self._reg = None
        if self._regions:
            self._reg = self._agent.register_memory(
                [(base, n, self.dev_id, "") for base, n in self._regions], mem_type=self.mem_type
            )
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
        ts = [self.tensors[n] for n in names]
        sums = checksums(ts)
        descs = [
            TensorDesc(n, t.data_ptr(), t.numel() * t.element_size(), _dtype_name(t.dtype), list(t.shape), s)
            for n, t, s in zip(names, ts, sums)
        ]
        with self._lock:
            self._check_open()
            meta = self._agent.get_agent_metadata()
        self.start_serving()
        if self._ipc is None:
            self._ipc = _ipc_regions(self._storages)
            if self._arena is not None and self._arena.shareable:
                from .vmm import VmmError, VmmExporter

                try:
                    self._exporter = VmmExporter(self._arena)
                    self._vmm = [VmmRegion(self._arena.ptr, self._arena.nbytes, self._exporter.address)]
                except (VmmError, OSError) as e:
                    log.info("%s: the VMM arena cannot be lent (%s); NIXL serves it", self.name, e)
        return WeightManifest(
            self.rank, self.name, meta, self.mem_type, self.dev_id, descs, self.node, self._ipc, self._vmm
        )

    def start_serving(self) -> None:
        with self._lock:
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
            with self._lock:
                if self._closed:
                    return
                try:
                    self._collect_notifs()
                except Exception as e:  # a poll failure must not kill serving silently forever
                    log.warning("%s: serve poll failed: %s", self.name, e)

    def _collect_notifs(self) -> None:
        """Drain NIXL notifications (drives UCX progress). Caller holds self._lock."""
        for agent_name, msgs in self._agent.get_new_notifs().items():
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
                    "%s: rank %d finished pulling %d tensors (%d B, ok=%s)", self.name, m.rank, m.tensors, m.bytes, m.ok
                )

    def pulls_done(self) -> list[PullDone]:
        """Completion notifications received so far (drained)."""
        with self._lock:
            self._check_open()
            self._collect_notifs()
            out, self._done = self._done, []
            return out

    def wait_pulled(self, ranks: Iterable[int], timeout_s: float = 60.0) -> dict[int, PullDone]:
        """Wait until every puller rank in `ranks` has sent its completion notification."""
        want = set(ranks)
        got: dict[int, PullDone] = {}
        deadline = time.monotonic() + timeout_s
        while True:
            for m in self.pulls_done():
                if m.rank in want:
                    got[m.rank] = m
            if want.issubset(got):
                return got
            if time.monotonic() > deadline:
                raise WeightTransferError(
                    f"rank {self.rank}: no completion from puller ranks {sorted(want - set(got))} after {timeout_s}s"
                )
            time.sleep(0.002)

    # ------------------------------------------------------------------ joiner side

    def pull(
        self,
        items: list[PullItem],
        sources: dict[int, WeightManifest],
        timeout_s: float = 60.0,
        progress: Callable[[int, int], None] | None = None,
        use_ipc: bool = True,
    ) -> PullStats:
        """READ each item's source tensor into self.tensors[dst_name], then verify every checksum.

        Everything is validated before the first transfer. Raises WeightTransferError naming the
        tensor and source rank for a mismatch, a failed or timed-out source, or a bad checksum."""
        t_start = time.monotonic()
        deadline = t_start + timeout_s
        with self._pull_lock:
            self._check_open()
            plan = self._plan(items, sources)
            total = sum(x.nbytes for xs in plan.values() for x in xs)
            per_source = {r: sum(x.nbytes for x in xs) for r, xs in plan.items()}
            for r in plan:
                self._load_source(sources[r])

            t_xfer = time.monotonic()
            # Same-node VRAM sources: copy through CUDA IPC or a lent VMM arena at device-copy
            # speed (UCX in the NIXL wheel moved VRAM over tcp/loopback here); NIXL READ for
            # everything else, and for a source whose memory could not be opened.
            direct = {}  # source rank -> its (destination, mapped source bytes) pairs
            for r, xs in plan.items():
                if use_ipc and self._ipc_usable(sources[r]):
                    pairs = self._open_all(sources[r], xs)
                    if pairs is not None:
                        direct[r] = pairs
            t_opened = time.monotonic()
            try:
                self._copy_ipc(direct, plan)
            finally:
                # Close what was opened: a process holding another's CUDA IPC memory cannot be
                # checkpointed and restored (the driver API refuses), and a joiner may be parked later.
                t_copied = time.monotonic()
                self._close_opened()
                t_unmapped = time.monotonic()
            xfers = self._run(
                {r: xs for r, xs in plan.items() if r not in direct}, sources, deadline, total, progress, timeout_s
            )
            t_verify = time.monotonic()
            bad = self._verify([x for xs in plan.values() for x in xs])
            t_end = time.monotonic()

            self._notify_done(plan, sources, {it.src_rank for it, _, _ in bad})
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
            stats = PullStats(
                tensors=len(items),
                bytes=total,
                seconds=t_end - t_start,
                per_source=per_source,
                transfer_seconds=t_verify - t_xfer,
                verify_seconds=t_end - t_verify,
                ipc_bytes=sum(per_source[r] for r in direct),
                map_seconds=(t_opened - t_xfer) + (t_unmapped - t_copied),
            )
            log.info(
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

        by_src: dict[int, list[tuple[PullItem, TensorDesc, torch.Tensor]]] = {}
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

    def _ipc_usable(self, m: WeightManifest) -> bool:
        return self._on_cuda and m.mem_type == "VRAM" and bool(m.ipc or m.vmm) and m.node == self.node

    @staticmethod
    def _region(m: WeightManifest, desc: TensorDesc) -> IpcRegion | VmmRegion | None:
        return next((g for g in (*m.ipc, *m.vmm) if g.base <= desc.addr < g.base + g.nbytes), None)

    def _open_all(self, m: WeightManifest, xs: list[_Xfer]) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Open every region of `m` the transfers read: (destination, source bytes) per tensor;
        None (a warning, nothing left open) when one cannot be, so NIXL reads that source instead."""
        pairs = []
        try:
            for x in xs:
                for it, desc, dst in x.items:
                    g = self._region(m, desc)
                    if g is None:
                        raise WeightTransferError(f"tensor {it.src_name}: not in a region rank {m.rank} exported")
                    off = desc.addr - g.base
                    pairs.append((dst, self._open(m.agent, g)[off : off + desc.nbytes]))
        except Exception as e:
            log.warning("%s: cannot map rank %d's memory directly (%s); reading it over NIXL", self.name, m.rank, e)
            self._close_opened(m.agent)
            return None
        return pairs

    def _copy_ipc(
        self, direct: dict[int, list[tuple[torch.Tensor, torch.Tensor]]], plan: dict[int, list[_Xfer]]
    ) -> None:
        for r, pairs in direct.items():
            for dst, src in pairs:
                dst.view(-1).view(torch.uint8).copy_(src, non_blocking=True)
            for x in plan[r]:
                x.state = "DONE"
        if direct:
            torch.cuda.synchronize(self.device)

    def _open(self, agent: str, g: IpcRegion | VmmRegion) -> torch.Tensor:
        key = (agent, g.base)
        if key not in self._opened:
            if isinstance(g, VmmRegion):
                from .vmm import VmmImport

                imp = VmmImport(g.address, self.device)
                if imp.nbytes < g.nbytes:
                    imp.close()
                    raise WeightTransferError(f"{g.address} lent {imp.nbytes} bytes, the manifest says {g.nbytes}")
                self._opened[key] = (imp.tensor, imp)
            else:
                st = torch.UntypedStorage._new_shared_cuda(
                    g.device,
                    g.handle,
                    g.size,
                    g.offset,
                    g.ref_counter_handle,
                    g.ref_counter_offset,
                    g.event_handle or None,
                    g.event_sync_required,
                )
                # On the source's GPU, which may be another one of this node's: the copy then goes peer to peer.
                self._opened[key] = (
                    torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", g.device)).set_(st),
                    None,
                )
        return self._opened[key][0]

    def _close_opened(self, agent: str | None = None) -> None:
        for key in [k for k in self._opened if agent is None or k[0] == agent]:
            _, imported = self._opened.pop(key)
            if imported is not None:
                imported.close()

    def _load_source(self, m: WeightManifest) -> None:
        if m.agent in self._remote:
            return
        with self._lock:
            try:
                self._remote[m.agent] = load_peer(self._agent, m.agent_metadata, m.agent)
            except PeerMetadataError as e:
                raise WeightTransferError(f"rank {self.rank}: source rank {m.rank} is unreachable: {e}") from e

    def _forget_source(self, m: WeightManifest) -> None:
        """Drop a failed source's agent so a retry reloads it from a fresh manifest."""
        self._close_opened(m.agent)
        if self._remote.pop(m.agent, None) is None:
            return
        with self._lock:
            forget_peer(self._agent, m.agent, self.name)

    def _run(self, plan, sources, deadline, total, progress, timeout_s) -> list[_Xfer]:
        nb, agent = self._nb, self._agent
        # Round-robin over sources so every source has a request in flight from the start.
        queue: list[_Xfer] = []
        depth = max(len(xs) for xs in plan.values()) if plan else 0
        for i in range(depth):
            queue.extend(xs[i] for xs in plan.values() if i < len(xs))
        done_bytes = 0
        failed: dict[int, str] = {}

        def report() -> None:
            if progress is not None:
                try:
                    progress(done_bytes, total)
                except Exception:
                    log.exception("%s: progress callback failed", self.name)

        for x in queue:
            if x.src in failed:
                x.state = "ERR"
                continue
            m = sources[x.src]
            live = [(it, d, t) for it, d, t in x.items if d.nbytes]
            if not live:
                x.state = "DONE"
                continue
            try:
                local = nb.nixlXferDList(self._seg, [(t.data_ptr(), d.nbytes, self.dev_id) for _, d, t in live])
                remote = nb.nixlXferDList(
                    nb.VRAM_SEG if m.mem_type == "VRAM" else nb.DRAM_SEG,
                    [(d.addr, d.nbytes, m.dev_id) for _, d, _ in live],
                )
                with self._lock:
                    x.handle = agent.initialize_xfer("READ", local, remote, self._remote[m.agent])
                    x.state = agent.transfer(x.handle)
            except Exception as e:
                x.state = "ERR"
                failed[x.src] = f"READ of {_names(x.items)} could not start: {e}"
                continue
            if x.state == "ERR":
                failed[x.src] = f"READ of {_names(x.items)} failed"
            elif x.state == "DONE":
                done_bytes += x.nbytes
                report()

        pending = [x for x in queue if x.state == "PROC"]
        spins = 0
        t0 = time.monotonic()
        while pending:
            still = []
            # A failed source's other requests are polled to the end too: nothing may still be
            # writing into our tensors when we return.
            for x in pending:
                with self._lock:
                    st = agent.check_xfer_state(x.handle)
                x.state = st
                if st == "PROC":
                    still.append(x)
                elif st == "DONE":
                    done_bytes += x.nbytes
                    report()
                else:
                    failed.setdefault(x.src, f"READ of {_names(x.items)} failed (source gone?)")
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

        if pending or failed:
            for x in pending:
                failed.setdefault(x.src, "")
            self._release(queue)
            parts = []
            for r in sorted(failed):
                if any(x.src == r for x in pending):
                    left = sum(x.nbytes for x in pending if x.src == r)
                    names = _names([i for x in pending if x.src == r for i in x.items])
                    parts.append(f"rank {r} did not finish within {timeout_s}s ({left} B of {names} outstanding)")
                else:
                    parts.append(f"rank {r}: {failed[r]}")
            self._notify_done({r: xs for r, xs in plan.items() if r not in failed}, sources, set(plan))
            for r in failed:
                self._forget_source(sources[r])
            self._progress()
            raise WeightTransferError(f"pull into rank {self.rank} failed: " + "; ".join(parts))
        return queue

    def _verify(self, xfers: list[_Xfer]) -> list[tuple[PullItem, TensorDesc, int]]:
        entries = [e for x in xfers for e in x.items]
        got = checksums(t for _, _, t in entries)
        return [(it, d, g) for (it, d, _), g in zip(entries, got) if g != d.checksum]

    def _notify_done(self, plan, sources, bad_src: set[int]) -> None:
        """Tell each source we no longer read from it; ok=False if its data did not verify."""
        for r, xs in plan.items():
            msg = _done_encoder.encode(
                PullDone(
                    self.rank, self.name, sum(len(x.items) for x in xs), sum(x.nbytes for x in xs), r not in bad_src
                )
            )
            try:
                with self._lock:
                    self._agent.send_notif(self._remote[sources[r].agent], msg)
            except Exception as e:  # the data is here and verified; a lost notice is the source's timeout
                log.warning("%s: completion notification to rank %d failed: %s", self.name, r, e)

    def _progress(self, polls: int = 5) -> None:
        """Let UCX retire what a failed endpoint left queued. Destroying an agent while a dead
        peer's endpoint still has queued operations aborts the process (UCX arbiter assertion);
        one progress call after the failure is enough, a few are cheap."""
        for _ in range(polls):
            with self._lock:
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
            with self._lock:
                release(h, self._leaked, f"{self.name}: READ handle from rank {x.src}")

    # ------------------------------------------------------------------ teardown

    def _check_open(self) -> None:
        if self._closed:
            raise WeightTransferError(f"rank {self.rank}: weight store is closed")

    def close(self) -> None:
        if self._closed:
            return
        self.stop_serving()
        if self._exporter is not None:
            self._exporter.close()
            self._exporter = None
        self._progress()
        with self._pull_lock, self._lock:
            if self._closed:
                return
            self._closed = True
            agent = self._agent
            release_quietly(self._leaked)
            for name in list(self._remote.values()):
                forget_peer(agent, name, self.name)
            self._remote.clear()
            if self._reg is not None:
                deregister(agent, self._reg, self.name)
                self._reg = None
            self._agent = None
            del agent
            log.info("%s: closed", self.name)

    def __enter__(self) -> WeightStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
