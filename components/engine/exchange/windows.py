"""Same-node EP exchange through peer windows: dispatch and combine as device work only.

Why it is built this way:

* Host-driven all-to-alls cost a device->host->device round trip and host syncs per MoE layer,
  and cannot live in a CUDA graph. Ranks of one node can instead write into each other's memory:
  each rank owns a *mailbox* (a VMM arena: receive rows, their expert slots and counts, reply
  rows, arrival counters) and lends it to same-node peers as file descriptors (VmmExporter).
* Fixed addresses. Each rank reserves, at start, one virtual range of ``max_ranks`` mailbox-sized
  windows. Connecting peer r maps r's mailbox into window r; disconnecting unmaps it and keeps the
  range. The kernels read each peer's window address from a device table, so graphs captured
  before a join or a leave keep working: membership is data (the device mask), never a recapture.
* The device mask gates everything: a masked peer is neither written nor waited on, and nothing
  of an unconnected (unmapped) window is ever touched.
* Arrival counters instead of flags. Every sender program adds 1 to the receiver's counter of the
  phase (dispatch, combine) with release semantics at system scope after a block barrier; the
  receiver waits with acquire loads until the counter reaches what it expects next and then
  advances its expectation. Counters only grow within an epoch and are zeroed on every rank while
  the group is paused for a new epoch, so an arrival from an old topology is never taken for one
  of the new.
* Buffer reuse needs no acknowledgement: a peer writes layer L+1's rows into our mailbox only
  after it has our replies for layer L, which we send after our experts read its rows.
* No hang on a dead peer: a wait gives up after ``timeout_s`` or when the host sets the abort word
  (declare_gone), records which peer it waited for in host-mapped memory, and lets the step
  finish with garbage; `check()` (after the step's one sync) raises EPError and the step is
  discarded, as with the host-driven communicator.
"""

from __future__ import annotations

import logging
from typing import Protocol

import msgspec
import torch
import triton
import triton.language as tl

from components.engine.exchange.communicator import EPError
from components.engine.memory.vmm import VmmArena, VmmError, VmmExporter, VmmWindow, plan_bytes

log = logging.getLogger(__name__)

SEND_PROGRAMS = 64  # programs per destination in a send; every one of them arrives once. At 16 a
# DeepSeek-shaped dispatch of 256 rows (14 KB each) to one rank took 32 us: each program copies its
# rows one after another, so the copy is latency-bound, not bandwidth-bound; at 64, 10 us.
_BLOCK = 1024  # int32 words a program copies per iteration


class WindowMetadata(msgspec.Struct, array_like=True, frozen=True):
    """What a same-node peer needs to map our mailbox."""

    node: str
    address: str  # VmmExporter's abstract socket
    layout: tuple[int, ...]  # (max_ranks, capacity, row words, mailbox bytes): must match ours


@triton.jit
def _now_ns():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _send_kernel(
    src,  # int32 rows, row-major, `words` per row
    src_slots,  # int32 slot per row (dispatch only)
    starts,  # int64 [R] first row for each destination (unless STARTS_FROM_COUNTS)
    counts,  # int64 [>= R] rows for each destination
    mask,  # bool [R]
    windows,  # int64 [R] address of each destination's mailbox in this process
    me,
    cap,
    words,
    rows_off,
    slots_off,
    counts_off,
    arrive_off,
    HAS_SLOTS: tl.constexpr,  # the dispatch: slots and counts travel with the rows
    STARTS_FROM_COUNTS: tl.constexpr,  # rows of destinations back to back: starts are the counts' prefix sums
    R_PAD: tl.constexpr,
    NB: tl.constexpr,
    BLOCK: tl.constexpr,
):
    d = tl.program_id(0)
    b = tl.program_id(1)
    if tl.load(mask + d) != 0:
        base = tl.load(windows + d)
        n = tl.load(counts + d)
        if STARTS_FROM_COUNTS:
            r = tl.arange(0, R_PAD)
            s = tl.sum(tl.load(counts + r, mask=r < d, other=0), 0)
        else:
            s = tl.load(starts + d)
        dst_rows = (base + rows_off).to(tl.pointer_type(tl.int32))
        dst_slots = (base + slots_off).to(tl.pointer_type(tl.int32))
        for i in range(b, n, NB):
            row_src = src + (s + i) * words
            row_dst = dst_rows + (me * cap + i) * words
            for w in range(0, words, BLOCK):
                offs = w + tl.arange(0, BLOCK)
                m = offs < words
                tl.store(row_dst + offs, tl.load(row_src + offs, mask=m), mask=m)
            if HAS_SLOTS:
                tl.store(dst_slots + me * cap + i, tl.load(src_slots + s + i))
        if HAS_SLOTS and b == 0:
            tl.store((base + counts_off).to(tl.pointer_type(tl.int64)) + me, n)
        tl.debug_barrier()
        tl.atomic_add((base + arrive_off).to(tl.pointer_type(tl.int64)) + me, 1, sem="release", scope="sys")


@triton.jit
def _received_kernel(recv_counts, recv_slots, mask, got, slots, cap, BLOCK: tl.constexpr):
    """Peer r's rows that arrived here: got[r] of them (none from a masked peer), and the slot of
    each row of r's part of the mailbox, -1 past the rows that arrived."""
    r = tl.program_id(0)
    n = tl.where(tl.load(mask + r) != 0, tl.load(recv_counts + r), 0)
    tl.store(got + r, n)
    for i0 in range(0, cap, BLOCK):
        i = i0 + tl.arange(0, BLOCK)
        at = r.to(tl.int64) * cap + i
        tl.store(slots + at, tl.load(recv_slots + at, mask=i < n, other=-1), mask=i < cap)


@triton.jit
def _replies_kernel(ret, counts, out, cap, words, R, R_PAD: tl.constexpr, BLOCK: tl.constexpr):
    """Row i of the dispatch order: the reply from its destination d (the rank whose run of
    `counts` holds i) at d's part of the reply mailbox, or zeros for a row that was not sent."""
    i = tl.program_id(0)
    r = tl.arange(0, R_PAD)
    c = tl.load(counts + r, mask=r < R, other=0)
    d = tl.sum((tl.cumsum(c, 0) <= i).to(tl.int32), 0)
    n = tl.where(d < R, words, 0)  # words to copy; zeros for the rest
    src = (d * cap + i - tl.sum(tl.where(r < d, c, 0), 0)).to(tl.int64) * words
    dst = i.to(tl.int64) * words
    for w0 in range(0, words, BLOCK):
        w = w0 + tl.arange(0, BLOCK)
        tl.store(out + dst + w, tl.load(ret + src + w, mask=w < n, other=0), mask=w < words)


@triton.jit
def _wait_kernel(arrive, expect, mask, failed_addr, abort_addr, timeout_ns, NB: tl.constexpr):
    r = tl.program_id(0)
    if tl.load(mask + r) != 0:
        target = tl.load(expect + r) + NB
        # Host addresses arrive as plain ints, which Triton types i32 when the value fits: widen
        # before the cast to a pointer (a 32-bit int is no pointer on a 64-bit target).
        abort = abort_addr.to(tl.int64).to(tl.pointer_type(tl.int32))
        t0 = _now_ns()
        seen = tl.atomic_add(arrive + r, 0, sem="acquire", scope="sys")
        waiting = seen < target
        while waiting:
            seen = tl.atomic_add(arrive + r, 0, sem="acquire", scope="sys")
            stop = (tl.load(abort, volatile=True) != 0) | (_now_ns() - t0 > timeout_ns)
            waiting = (seen < target) & (stop == 0)
        if seen >= target:
            tl.store(expect + r, target)
        else:
            tl.store(failed_addr.to(tl.int64).to(tl.pointer_type(tl.int32)) + r, 1)


class Experts(Protocol):
    """The experts a rank computes the rows sent to it with (SparseMoE.experts): row i through
    slot slots[i]; rows of slot -1 zeros, or left unwritten without `zero_unrouted`."""

    def __call__(self, x: torch.Tensor, slots: torch.Tensor, zero_unrouted: bool = True) -> torch.Tensor: ...


class PeerWindows:
    """This rank's mailbox and its windows onto same-node peers' mailboxes (see the module doc).

    `capacity`: most (token, expert) rows one rank sends one peer in a step; `hidden`, `dtype`:
    the row. `mask` is the EP mask the dispatch and these kernels read (ExpertParallel.mask takes
    this one), at a fixed address."""

    def __init__(
        self,
        rank: int,
        max_ranks: int,
        capacity: int,
        hidden: int,
        dtype: torch.dtype,
        device: torch.device,
        node: str,
        timeout_s: float = 30.0,
    ):
        if hidden * dtype.itemsize % 4:
            raise VmmError(f"a row of {hidden} x {dtype} is not a whole number of 32-bit words")
        self.rank, self.max_ranks, self.cap, self.hidden, self.dtype = rank, max_ranks, capacity, hidden, dtype
        self.words = hidden * dtype.itemsize // 4
        dev = self.device = device
        self.mask = torch.zeros(max_ranks, dtype=torch.bool, device=dev)
        self.node, self.timeout_s = node, timeout_s
        R, C, W = max_ranks, capacity, self.words
        specs = [((R, C, W), torch.int32), ((R, C), torch.int32), ((R,), torch.int64), ((R, C, W), torch.int32)]
        specs.append(((2, R), torch.int64))
        self.box = VmmArena(plan_bytes(specs), dev)
        self.recv_rows, self.recv_slots, self.recv_counts, self.ret_rows, self.arrive = (
            self.box.alloc(s, t) for s, t in specs
        )
        self.arrive.zero_()
        # Where each part sits in a mailbox: the same in every peer's (same layout).
        parts = {
            "rows": self.recv_rows,
            "slots": self.recv_slots,
            "counts": self.recv_counts,
            "ret": self.ret_rows,
            "arrive": self.arrive,
        }
        self._off = {n: t.data_ptr() - self.box.ptr for n, t in parts.items()}
        self.layout = (R, C, W, self.box.nbytes)
        self.exporter = VmmExporter(self.box, keep=False)
        self.windows = VmmWindow(R, self.box.nbytes, dev)
        self.table = torch.zeros(R, dtype=torch.int64, device=dev)  # window address per peer
        self.table[rank] = self.box.ptr
        self._lender: dict[int, str] = {}  # exporter address of each mapped peer
        self.expect = torch.zeros(2, R, dtype=torch.int64, device=dev)
        # Host-mapped: written by a wait that gave up, read by the host after the step; and the
        # word the host sets to abandon waits in flight.
        self.failed = torch.zeros(R, dtype=torch.int32, pin_memory=True)
        self.abort = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        self.peer_starts = torch.arange(R, device=dev, dtype=torch.int64) * C
        log.info(
            "rank %d: EP peer windows: mailbox %.1f MiB (%d peers x %d rows of %d B), %s",
            rank,
            self.box.nbytes / 2**20,
            R,
            C,
            W * 4,
            self.box,
        )

    # ---- membership (host, while the group is paused) -----------------------------------------
    def metadata(self) -> WindowMetadata:
        return WindowMetadata(self.node, self.exporter.address, self.layout)

    def can_map(self, meta: WindowMetadata) -> bool:
        return meta.node == self.node and tuple(meta.layout) == self.layout

    def connect(self, rank: int, meta: WindowMetadata) -> None:
        """Map `rank`'s mailbox into its window (again if the peer's exporter changed)."""
        if rank == self.rank or self._lender.get(rank) == meta.address:
            return
        if not self.can_map(meta):
            raise EPError(f"rank {self.rank}: rank {rank}'s mailbox cannot be mapped here ({meta})", [rank])
        try:
            addr = self.windows.map(rank, meta.address)
        except VmmError as e:
            raise EPError(f"rank {self.rank}: mapping rank {rank}'s mailbox failed: {e}", [rank]) from e
        self.table[rank] = addr
        self._lender[rank] = meta.address

    def disconnect(self, rank: int) -> None:
        if rank != self.rank:
            self.windows.unmap(rank)
            self._lender.pop(rank, None)

    def reset(self) -> None:
        """A new epoch: every rank zeroes its counters and expectations while the group is paused,
        before any rank takes a step of the new epoch."""
        torch.cuda.synchronize(self.device)
        self.arrive.zero_()
        self.expect.zero_()
        self.failed.zero_()
        self.abort.zero_()
        torch.cuda.synchronize(self.device)

    def declare_gone(self) -> None:
        self.abort[0] = 1

    def check(self) -> None:
        """After the step's sync: raise EPError naming the peers a wait gave up on."""
        failed = self.failed.nonzero().flatten().tolist()
        if failed:
            why = "abandoned (declared gone)" if int(self.abort[0]) else f"timed out after {self.timeout_s:g}s"
            raise EPError(f"rank {self.rank}: EP exchange with ranks {failed} {why}", failed)

    def assume_rank(self, rank: int) -> None:
        """A process restored from a snapshot image becomes `rank` (no peer mapped yet)."""
        self.table.zero_()
        self.table[rank] = self.box.ptr
        self.rank = rank

    def suspend(self) -> None:
        """Parking: unmap every peer's window (a CUDA checkpoint refuses imported memory)."""
        for r in list(self.windows.mapped):
            self.disconnect(r)

    def close(self) -> None:
        self.suspend()
        self.exporter.close()
        self.windows.close()
        self.box.close()

    # ---- the exchange (device only: graph-capturable) -----------------------------------------
    def _send(self, rows, slots, starts, counts, phase: int) -> None:
        """`starts` None: each destination's rows follow the previous one's (the dispatch order)."""
        has_slots = slots is not None
        _send_kernel[(self.max_ranks, SEND_PROGRAMS)](
            rows,
            slots if has_slots else rows,
            starts if starts is not None else counts,
            counts,
            self.mask,
            self.table,
            self.rank,
            self.cap,
            self.words,
            self._off["rows" if phase == 0 else "ret"],
            self._off["slots"],
            self._off["counts"],
            self._off["arrive"] + phase * 8 * self.max_ranks,
            HAS_SLOTS=has_slots,
            STARTS_FROM_COUNTS=starts is None,
            R_PAD=triton.next_power_of_2(self.max_ranks),
            NB=SEND_PROGRAMS,
            BLOCK=_BLOCK,
        )

    def _wait(self, phase: int) -> None:
        _wait_kernel[(self.max_ranks,)](
            self.arrive[phase],
            self.expect[phase],
            self.mask,
            self.failed.data_ptr(),
            self.abort.data_ptr(),
            int(self.timeout_s * 1e9),
            NB=SEND_PROGRAMS,
        )

    def exchange(
        self,
        rows: torch.Tensor,
        local: torch.Tensor,
        counts: torch.Tensor,
        out: torch.Tensor,
        experts: Experts,
    ) -> None:
        """`rows` [P, H] sorted by destination with `counts` [>= R] per destination (what
        SparseMoE.dispatch makes), `local` their slots there; writes each row's expert output into
        `out` [P, H] (contiguous) in the same order (zeros for rows not sent), computing the rows sent
        here with `experts(rows, slots)` (slot -1: a row to ignore). Besides the experts, six
        launches: two sends (the dispatch's finding each destination's rows from the counts), two
        waits, the slots of the rows received and the gather of the replies."""
        R, C, H = self.max_ranks, self.cap, self.hidden
        P = rows.shape[0]
        if P > C:
            raise ValueError(f"{P} (token, expert) rows exceed the EP window capacity of {C}")
        if counts.numel() < R:  # the kernels read one per rank: fewer would be read past their end
            raise ValueError(f"{counts.numel()} counts for an exchange of {R} ranks")
        self._send(rows.contiguous().view(torch.int32), local, None, counts, 0)
        self._wait(0)
        got = torch.empty(R, dtype=torch.int64, device=rows.device)
        slots = torch.empty(R * C, dtype=torch.int32, device=rows.device)
        _received_kernel[(R,)](self.recv_counts, self.recv_slots, self.mask, got, slots, C, BLOCK=_BLOCK)
        # Only each peer's first got[r] rows go back, and each has its slot: the rest of the
        # max_ranks x capacity rows stay unwritten (zeroing them cost a memset of max_ranks x the
        # budget x top-k x hidden every MoE layer of every step, decode steps too).
        y = experts(self.recv_rows.view(self.dtype).view(R * C, H), slots, zero_unrouted=False)
        self._send(y.contiguous().view(torch.int32), None, self.peer_starts, got, 1)
        self._wait(1)
        if P:
            _replies_kernel[(P,)](
                self.ret_rows, counts, out.view(torch.int32), C, self.words, R,
                R_PAD=triton.next_power_of_2(R), BLOCK=_BLOCK,
            )  # fmt: skip


class WindowPeerMetadata(msgspec.Struct, array_like=True, frozen=True):
    host: bytes  # the host communicator's metadata
    window: WindowMetadata


_window_meta_decoder = msgspec.msgpack.Decoder(WindowPeerMetadata)


class WindowCommunicator:
    """EPCommunicator for same-node ranks on CUDA: the host-driven NIXL communicator carries the
    small per-step collectives (the step header), and `windows` carries the MoE exchange as device
    work (SparseMoE.exchange uses it when present). Every peer must be mappable (same node, same
    layout): a deployment across nodes uses the NIXL communicator alone (`Worker.ep_transport`)."""

    def __init__(self, host, windows: PeerWindows):
        self.host, self.windows = host, windows
        self.rank, self.max_ranks, self.capacity_bytes = host.rank, host.max_ranks, host.capacity_bytes
        self._metadata = (b"", b"")  # (the host metadata it was built from, ours)

    def metadata(self) -> bytes:
        host = self.host.metadata()
        if not host:  # suspended
            return b""
        if self._metadata[0] != host:  # a resumed host agent has new metadata
            self._metadata = (host, msgspec.msgpack.encode(WindowPeerMetadata(host, self.windows.metadata())))
        return self._metadata[1]

    def connect(self, peers, activate: bool = False) -> None:
        decoded = {}
        for r, blob in peers.items():
            try:
                decoded[r] = _window_meta_decoder.decode(blob)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                raise EPError(f"rank {self.rank}: metadata for rank {r} is not a peer-window rank's: {e}") from e
        for r, m in decoded.items():
            if r != self.rank and not self.windows.can_map(m.window):
                raise EPError(
                    f"rank {self.rank}: rank {r} cannot share EP windows with this rank (node {m.window.node} vs "
                    f"{self.windows.node}, layout {m.window.layout} vs {self.windows.layout}); set "
                    f"Worker.ep_transport=nixl for deployments across nodes",
                    [r],
                )
        for r, m in decoded.items():
            self.windows.connect(r, m.window)
        self.host.connect({r: m.host for r, m in decoded.items()}, activate)
        if activate:
            self.windows.reset()

    def disconnect(self, ranks) -> None:
        ranks = list(ranks)
        self.host.disconnect(ranks)
        for r in ranks:
            self.windows.disconnect(r)

    def set_active(self, ranks, epoch: int) -> None:
        self.host.set_active(ranks, epoch)
        self.windows.reset()

    def declare_gone(self, ranks) -> None:
        self.host.declare_gone(ranks)
        self.windows.declare_gone()

    def mask_remote(self) -> None:
        self.host.mask_remote()

    @property
    def active(self) -> tuple[int, ...]:
        return self.host.active

    @property
    def connected(self) -> tuple[int, ...]:
        return self.host.connected

    @property
    def epoch(self) -> int:
        return self.host.epoch

    def all_to_all(self, send):
        return self.host.all_to_all(send)

    def suspend(self) -> None:
        self.windows.suspend()
        self.host.suspend()

    def resume(self) -> None:
        self.host.resume()

    def assume_rank(self, rank: int, name: str) -> None:
        self.host.assume_rank(rank, name)
        self.windows.assume_rank(rank)
        self.rank = rank

    def close(self) -> None:
        self.windows.close()
        self.host.close()
