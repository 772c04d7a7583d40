"""EP communicator on the NIXL core API: one-sided WRITEs into fixed buffers, notifications as flags.

Why it is built this way:

* Fixed buffers. An elastic group must change membership without re-allocating or re-registering
  anything: CUDA graphs captured on a rank hold the addresses of its buffers, and registration is
  slow. So each rank allocates, once, a receive region ``recv[2][max_ranks][capacity_bytes]`` and
  a send staging region ``send[2][max_ranks][capacity_bytes]`` and registers both with NIXL at
  construction. A peer's slot is addressed by its rank, so adding or removing a peer touches no
  memory, only the bookkeeping below.
* Masks. Connecting a peer (loading its NIXL metadata) is separate from activating it. The active
  set is a tuple installed with ``set_active(ranks, epoch)``; a joiner can be connected and masked
  while the group keeps serving, and ``mask_remote`` turns collectives into local copies so a
  joiner can warm up alone.
* Tags. Every collective is tagged (epoch, seq): seq counts calls within an epoch and restarts at
  0 when a new epoch is installed. A notification for a later (epoch, seq) is stashed, one for an
  earlier epoch (a straggler from a failed or replaced topology) is dropped, so a rank that changed
  topology never mistakes old traffic for new.
* Parity (double buffering). Collective ``seq`` uses buffer half ``seq % 2``. A rank A can only
  start collective s+2 towards B after finishing s+1, which needs B's notification for s+1, which
  B sends only after it has finished collective s (including copying A's slice out). So when A
  writes half ``s % 2`` again, B is done reading it: a fast rank may run one collective ahead of a
  slow one and never overwrites data still being read, with no extra acknowledgement round.
  Across an epoch change that argument needs the commit barrier of the design (every rank of the
  old set has returned from its last old-epoch collective before any rank starts a new-epoch one),
  because seq restarts at 0 whatever the parity of the last old-epoch collective was.
* Ordering. The data and the "it is there" flag travel together: the notification rides on the
  WRITE (``notif_msg``), and NIXL delivers a transfer's notification only after its data. A
  zero-byte send is a bare notification. Every active pair exchanges one notification per
  collective, which is also what makes the parity argument hold.
* No hangs. Waiting is bounded by ``timeout_s``; a WRITE that fails (a dead peer) or a peer that
  never answers raises EPError naming the ranks, so a dead peer cannot wedge a rank forever.
* No pickle on the wire. Metadata and notifications are msgspec Structs (msgpack). NIXL's own
  ``get_serialized_descs`` pickles, so the receive region is described by plain integers instead
  and rebuilt into a descriptor list by the peer.

Threading: every public method takes one lock, so ``connect`` may run on a background thread while
the serving thread runs collectives (the NIXL agent itself is created without internal locking).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable, Mapping

import msgspec
import torch

from components.engine.exchange.communicator import EPError
from components.engine.exchange.nixl_agent import NixlAgent, NixlError, PeerMetadataError, nixl_memory
from components.engine.memory import host_pages

log = logging.getLogger(__name__)

_PROTOCOL_VERSION = 1
_YIELD_S = 0.005  # after the first spins, yield the CPU for this long before sleeping
_SLEEP_S = 0.0002
_PROGRESS_THREAD_MIN_CPUS = 8


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


class PeerMetadata(msgspec.Struct, array_like=True, frozen=True):
    """What `metadata()` returns (msgpack): enough for a peer to WRITE into our receive region."""

    version: int
    rank: int
    max_ranks: int
    capacity_bytes: int
    agent_name: str
    agent_metadata: bytes  # nixl_agent.get_agent_metadata()
    recv_addr: int  # base address of recv[2][max_ranks][capacity_bytes]
    mem_type: str  # "DRAM" or "VRAM"
    dev_id: int


class Notif(msgspec.Struct, array_like=True, frozen=True):
    """Wire message: `src` wrote `nbytes` into our slot of collective (epoch, seq)."""

    epoch: int
    seq: int
    src: int
    nbytes: int


_notif_encoder = msgspec.msgpack.Encoder()
_notif_decoder = msgspec.msgpack.Decoder(Notif)
_meta_decoder = msgspec.msgpack.Decoder(PeerMetadata)


def _ranks(rs: list[int]) -> str:
    return f"rank {rs[0]}" if len(rs) == 1 else "ranks " + ", ".join(map(str, rs))


class _Peer:
    __slots__ = ("rank", "agent_name", "recv_addr", "mem_type", "dev_id")

    def __init__(self, rank: int, agent_name: str, recv_addr: int, mem_type: str, dev_id: int):
        self.rank = rank
        self.agent_name = agent_name
        self.recv_addr = recv_addr
        self.mem_type = mem_type
        self.dev_id = dev_id


class NixlCommunicator:
    """EPCommunicator over NIXL (UCX backend), for DRAM (device="cpu") or VRAM (device="cuda:N").

    Not a torch.distributed group: membership is bookkeeping over buffers registered once.
    See the module docstring for the protocol.

    `progress_thread` runs NIXL's UCX progress thread (a busy poller) beside the caller. The
    waiting rank drives UCX progress itself while it polls, so the thread is not needed for
    correctness; it helps where cores are plentiful and hurts badly where they are not. Measured,
    2 ranks, 64 B payloads: 16 cores, 68 us per all_to_all with it vs 101 us without; 2 cores,
    5-20 ms with it vs 60-110 us without. None (default) turns it on when this process may use
    at least `_PROGRESS_THREAD_MIN_CPUS` CPUs.
    """

    def __init__(
        self,
        rank: int,
        max_ranks: int,
        capacity_bytes: int,
        device: torch.device | str = "cpu",
        timeout_s: float = 30.0,
        name: str | None = None,
        progress_thread: bool | None = None,
    ):
        if not 0 <= rank < max_ranks:
            raise ValueError(f"rank {rank} outside [0, {max_ranks})")
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        self.rank = rank
        self.max_ranks = max_ranks
        self.capacity_bytes = capacity_bytes
        self.windows = None
        self.device, self._mem_type, self._dev_id = nixl_memory(device)
        self.timeout_s = timeout_s
        self.name = name or f"ep-{rank}-{os.getpid()}"

        self._lock = threading.RLock()  # also the agent's: it outlives each agent (suspend/resume)
        # Peers the router declared dead; read by a collective in flight, so replaced, never mutated.
        self._gone: frozenset[int] = frozenset()
        self._closed = False
        self._on_cuda = self.device.type == "cuda"

        # Allocated and registered once; never reallocated (addresses are part of the contract).
        self._recv = torch.zeros((2, max_ranks, capacity_bytes), dtype=torch.uint8, device=self.device)
        self._send = torch.zeros((2, max_ranks, capacity_bytes), dtype=torch.uint8, device=self.device)
        self._recv_addr = self._recv.data_ptr()
        self._send_addr = self._send.data_ptr()

        if progress_thread is None:
            progress_thread = _usable_cpus() >= _PROGRESS_THREAD_MIN_CPUS
        self._progress_thread = progress_thread
        self._base_name = self.name
        self._generation = 0
        self._nixl: NixlAgent | None = None
        self._metadata: bytes | None = None
        self._open_agent()

        self._peers: dict[int, _Peer] = {}
        self._agent_rank: dict[str, int] = {}
        self._active: tuple[int, ...] = (rank,)
        # -1 = nothing installed yet, so the first set_active may use epoch 0.
        self._epoch = -1
        self._seq = 0
        # (epoch, seq) -> {src: nbytes} for notifications that arrived before their collective.
        self._stash: dict[tuple[int, int], dict[int, int]] = {}

    def _open_agent(self) -> None:
        t0 = time.monotonic()
        try:
            self._nixl = NixlAgent(self.name, self._progress_thread, lock=self._lock)
        except NixlError as e:
            raise EPError(str(e)) from e
        self._nixl.register(self._recv)
        self._nixl.register(self._send)
        self._metadata = None
        log.info(
            "%s: NIXL agent up in %.2fs, 2 x %d x %d B per region on %s, progress thread %s",
            self.name,
            time.monotonic() - t0,
            self.max_ranks,
            self.capacity_bytes,
            self.device,
            "on" if self._progress_thread else "off",
        )

    def _drop_agent(self) -> None:
        """Forget every peer, deregister the buffers and destroy the agent (and its UCX context)."""
        if self._nixl is None:
            return
        self._peers.clear()
        self._agent_rank.clear()
        self._nixl.close()
        self._nixl = None

    # ------------------------------------------------------------------ parking

    def suspend(self) -> None:
        """Drop every peer and the NIXL agent, UCX context included, keeping the buffers at their
        addresses: a parked process then holds no transport state (CUDA IPC mappings, streams,
        pinned staging) under a CUDA checkpoint. Host buffers give back their pages too (their
        contents are read only after a peer's notification, which needs an agent), so neither a
        parked process nor a snapshot image holds them: 67 MB at max_ranks 4 for a
        Mixtral-shaped model. Until resume() only this rank may be active."""
        with self._lock:
            self._check_open()
            self._active = tuple(r for r in self._active if r == self.rank)
            self._drop_agent()
            self._metadata = b""  # nothing to connect to until resume()
            dropped = host_pages.drop([self._recv, self._send]) if self.device.type == "cpu" else 0
            log.info("%s: suspended (no NIXL agent; %d MB of buffer pages given back)", self.name, dropped >> 20)

    def resume(self) -> None:
        """A fresh agent over the same buffers, under a new name: peers may still know the old one."""
        with self._lock:
            self._check_open()
            if self._nixl is None:
                self._generation += 1
                self.name = f"{self._base_name}.{self._generation}"
                self._open_agent()

    def assume_rank(self, rank: int, name: str) -> None:
        """While suspended: become rank `rank`, the next agent named after `name` (a process
        restored from a snapshot image is told its rank only then; its PID is every copy's)."""
        with self._lock:
            self._check_open()
            if self._nixl is not None:
                raise EPError(f"rank {self.rank}: assume_rank needs the communicator suspended")
            if not 0 <= rank < self.max_ranks:
                raise ValueError(f"rank {rank} outside [0, {self.max_ranks})")
            self.rank, self._active = rank, (rank,)
            self._base_name, self._generation, self.name = name, 0, name

    # ------------------------------------------------------------------ membership

    def metadata(self) -> bytes:
        # Stable for the agent's lifetime, so built once: asking again must not wait on the lock a
        # collective in flight holds. Empty while suspended.
        if self._metadata is not None:
            return self._metadata
        with self._lock:
            self._check_open()
            self._metadata = msgspec.msgpack.encode(
                PeerMetadata(
                    version=_PROTOCOL_VERSION,
                    rank=self.rank,
                    max_ranks=self.max_ranks,
                    capacity_bytes=self.capacity_bytes,
                    agent_name=self.name,
                    agent_metadata=self._nixl.metadata(),
                    recv_addr=self._recv_addr,
                    mem_type=self._mem_type,
                    dev_id=self._dev_id,
                )
            )
            return self._metadata

    def connect(self, peers: Mapping[int, bytes], activate: bool = False) -> None:
        """Connect peers (rank -> metadata). Connected peers stay masked unless `activate`.

        Our own rank may appear in `peers` and is skipped. Reconnecting a rank whose agent name
        changed (a restarted process) replaces the old agent. `activate=True` installs
        active | peers under epoch + 1, which is only consistent if every rank of that set starts
        from the same epoch (initial bring-up); otherwise call `set_active` with an explicit epoch.
        Raises EPError if a peer's capacity, max_ranks or protocol differ from ours."""
        with self._lock:
            self._check_open()
            if self._nixl is None:
                raise EPError(f"rank {self.rank}: communicator is suspended (parked); resume() it first")
            decoded: dict[int, PeerMetadata] = {}
            for r, blob in peers.items():
                try:
                    m = _meta_decoder.decode(blob)
                except (msgspec.DecodeError, msgspec.ValidationError) as e:
                    raise EPError(f"rank {self.rank}: metadata for rank {r} is malformed: {e}") from e
                if m.version != _PROTOCOL_VERSION:
                    raise EPError(
                        f"rank {self.rank}: rank {r} speaks protocol {m.version}, we speak {_PROTOCOL_VERSION}"
                    )
                if m.rank != r:
                    raise EPError(f"rank {self.rank}: metadata given for rank {r} belongs to rank {m.rank}")
                if m.capacity_bytes != self.capacity_bytes or m.max_ranks != self.max_ranks:
                    raise EPError(
                        f"rank {self.rank}: rank {r} has capacity_bytes={m.capacity_bytes} max_ranks={m.max_ranks}, "
                        f"this rank has capacity_bytes={self.capacity_bytes} max_ranks={self.max_ranks}"
                    )
                if not 0 <= r < self.max_ranks:
                    raise EPError(f"rank {self.rank}: peer rank {r} outside [0, {self.max_ranks})")
                if m.mem_type not in ("DRAM", "VRAM"):
                    raise EPError(f"rank {self.rank}: rank {r} has unknown memory type {m.mem_type!r}")
                decoded[r] = m

            for r, m in decoded.items():
                if r == self.rank:
                    continue
                old = self._peers.get(r)
                if old is not None:
                    if old.agent_name == m.agent_name:
                        continue
                    log.info(
                        "%s: rank %d changed agent %s -> %s; replacing", self.name, r, old.agent_name, m.agent_name
                    )
                    self._forget(r)
                try:
                    loaded = self._nixl.load_peer(m.agent_metadata, m.agent_name)
                except PeerMetadataError as e:
                    raise EPError(f"rank {self.rank}: cannot connect rank {r}: {e}") from e
                self._peers[r] = _Peer(r, loaded, m.recv_addr, m.mem_type, m.dev_id)
                self._agent_rank[loaded] = r
                log.debug("%s: connected rank %d (%s)", self.name, r, loaded)

            if activate:
                ranks = set(self._active) | set(decoded) | {self.rank}
                self._install(ranks, self._epoch + 1)

    def disconnect(self, ranks: Iterable[int]) -> None:
        """Forget peers; they are masked first. Unknown ranks and our own rank are ignored."""
        with self._lock:
            if self._closed:
                return
            drop = {r for r in ranks if r != self.rank}
            self._active = tuple(r for r in self._active if r not in drop)
            for r in drop:
                if r in self._peers:
                    self._forget(r)
                    log.debug("%s: disconnected rank %d", self.name, r)

    def _forget(self, r: int) -> None:
        peer = self._peers.pop(r)
        self._agent_rank.pop(peer.agent_name, None)
        self._nixl.forget_peer(peer.agent_name)

    def set_active(self, ranks: Iterable[int], epoch: int) -> None:
        """Install the active set for `epoch` and restart seq at 0.

        Epochs must increase (re-installing the identical set and epoch before any collective is a
        no-op): a rollback is the old set under a NEW epoch, so stale traffic is never matched.
        Every rank of the set must be connected. Precondition for the parity argument: every rank
        of the old set has returned from its last collective of the old epoch before any rank of
        the new set starts its first one (the commit barrier)."""
        with self._lock:
            self._check_open()
            self._install(set(ranks), epoch)

    def _install(self, ranks: set[int], epoch: int) -> None:
        missing = sorted(r for r in ranks if r != self.rank and r not in self._peers)
        if missing:
            raise EPError(f"rank {self.rank}: cannot activate ranks {missing}: not connected")
        new = tuple(sorted(ranks))
        if epoch == self._epoch and new == self._active and self._seq == 0:
            return
        if epoch <= self._epoch:
            raise EPError(
                f"rank {self.rank}: epoch {epoch} does not follow current epoch {self._epoch}; install a new epoch"
            )
        self._active = new
        self._epoch = epoch
        self._seq = 0
        self._gone = frozenset()
        self._stash = {k: v for k, v in self._stash.items() if k[0] >= epoch}
        log.debug("%s: epoch %d active %s", self.name, epoch, new)

    def mask_remote(self) -> None:
        with self._lock:
            self._active = (self.rank,)

    @property
    def active(self) -> tuple[int, ...]:
        return self._active

    @property
    def connected(self) -> tuple[int, ...]:
        return tuple(sorted({self.rank, *self._peers}))

    @property
    def epoch(self) -> int:
        return self._epoch

    # ------------------------------------------------------------------ collective

    def all_to_all(self, send: Mapping[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """See EPCommunicator.all_to_all. After an EPError the current epoch is out of step: install
        a new epoch (set_active) before the next collective. Peers' data comes back on `self.device`;
        this rank's own slice stays on the device it was sent from (it never leaves the process)."""
        with self._lock:
            self._check_open()
            active = self._active
            if self.rank not in active:
                raise EPError(f"rank {self.rank} is not in the active set {active}")
            cap = self.capacity_bytes
            sizes: dict[int, int] = {}
            for dst, t in send.items():
                if dst not in active:
                    raise EPError(
                        f"rank {self.rank}: all_to_all to rank {dst} ({t.numel()} bytes), which is not active {active}"
                    )
                if t.dtype != torch.uint8 or t.dim() != 1:
                    raise EPError(
                        f"rank {self.rank}: payload for rank {dst} must be 1-D uint8, got {t.dtype} {tuple(t.shape)}"
                    )
                n = t.numel()
                if n > cap:
                    raise EPError(f"rank {self.rank}: payload for rank {dst} is {n} bytes, over capacity_bytes={cap}")
                sizes[dst] = n

            out: dict[int, torch.Tensor] = {}
            mine = send.get(self.rank)
            if len(active) == 1:
                out[self.rank] = self._local_copy(mine)
                return out

            epoch, seq = self._epoch, self._seq
            self._seq += 1
            parity = seq & 1
            remotes = [r for r in active if r != self.rank]

            # Stage first so a single stream sync covers every copy, and the clones handed out by
            # the previous call are complete before our notifications say we are done with it.
            # The sync covers every payload in device memory, whatever memory the buffers are in:
            # a WRITE must never read staging a copy may still be filling.
            streams = set()
            for dst in remotes:
                n = sizes.get(dst, 0)
                if n:
                    self._send[parity, dst, :n].copy_(send[dst], non_blocking=True)
                    if send[dst].is_cuda:
                        streams.add(torch.cuda.current_stream(send[dst].device))
            if self._on_cuda:
                streams.add(torch.cuda.current_stream(self.device))
            for st in streams:
                st.synchronize()

            handles: dict[int, object] = {}
            try:
                self._post(remotes, sizes, epoch, seq, parity, handles)
                out[self.rank] = self._local_copy(mine)
                got = self._wait(remotes, epoch, seq, handles)
                for src in active:
                    if src == self.rank:
                        continue
                    n = got[src]
                    out[src] = self._recv[parity, src, :n].clone()
            finally:
                self._release(handles)
            return dict(sorted(out.items()))

    def _local_copy(self, t: torch.Tensor | None) -> torch.Tensor:
        if t is None:
            return torch.empty(0, dtype=torch.uint8, device=self.device)
        return t.clone()

    def _post(self, remotes, sizes, epoch, seq, parity, handles) -> None:
        nixl, cap, mr = self._nixl, self.capacity_bytes, self.max_ranks
        agent = nixl.agent
        slot_off = (parity * mr + self.rank) * cap  # our slot in every peer's receive region
        for dst in remotes:
            peer = self._peers[dst]
            n = sizes.get(dst, 0)
            msg = _notif_encoder.encode(Notif(epoch, seq, self.rank, n))
            try:
                if n == 0:
                    agent.send_notif(peer.agent_name, msg)
                    continue
                # Exact-size descriptors per call: building them costs ~4-8 us (measured), far
                # below one UCX round trip, and a prepared fixed-size list cannot express the
                # variable payload without over-transfer.
                local = nixl.descs(self._mem_type, [(self._send_addr + (parity * mr + dst) * cap, n, self._dev_id)])
                remote = nixl.descs(peer.mem_type, [(peer.recv_addr + slot_off, n, peer.dev_id)])
                h = agent.initialize_xfer("WRITE", local, remote, peer.agent_name, msg)
                handles[dst] = h
                state = agent.transfer(h)
            except EPError:
                raise
            except Exception as e:
                raise EPError(
                    f"rank {self.rank}: sending {n} bytes to rank {dst} failed (epoch {epoch} seq {seq}): {e}", [dst]
                ) from e
            if state == "ERR":
                raise EPError(
                    f"rank {self.rank}: WRITE of {n} bytes to rank {dst} failed (epoch {epoch} seq {seq})", [dst]
                )

    def declare_gone(self, ranks: Iterable[int]) -> None:
        self._gone = frozenset(ranks)  # no lock: the collective holding it is what this unblocks
        log.debug("%s: ranks %s declared gone", self.name, sorted(self._gone))

    def _wait(self, remotes, epoch, seq, handles) -> dict[int, int]:
        """Wait for a notification from every remote source and for our own WRITEs to finish."""
        agent = self._nixl.agent
        got = self._stash.pop((epoch, seq), {})
        need = set(remotes)
        pending = dict(handles)
        deadline = time.monotonic() + self.timeout_s
        spins = 0
        while True:
            if not need.issubset(got):
                for agent_name, msgs in agent.get_new_notifs().items():
                    for raw in msgs:
                        self._on_notif(agent_name, raw, epoch, seq, got)
            for dst in list(pending):
                try:
                    state = agent.check_xfer_state(pending[dst])
                except Exception as e:  # NIXL raises (e.g. REMOTE_DISCONNECT) as well as answering ERR
                    raise EPError(
                        f"rank {self.rank}: WRITE to rank {dst} failed (epoch {epoch} seq {seq}): {e}", [dst]
                    ) from e
                if state == "DONE":
                    del pending[dst]
                elif state == "ERR":
                    raise EPError(
                        f"rank {self.rank}: WRITE to rank {dst} failed (epoch {epoch} seq {seq}); peer gone?", [dst]
                    )
            if not pending and need.issubset(got):
                return got
            if self._gone:
                # Abandoned whoever it waits for: a live peer may itself have given up this
                # collective, and the router installs a new epoch for all survivors next.
                raise EPError(
                    f"rank {self.rank}: all_to_all epoch {epoch} seq {seq} abandoned: "
                    f"{_ranks(sorted(self._gone))} declared gone",
                    self._gone,
                )
            spins += 1
            if spins > 64:
                now = time.monotonic()
                if now > deadline:
                    silent = sorted(need.difference(got))
                    unfinished = sorted(pending)
                    parts = []
                    if silent:
                        parts.append(f"no data from {_ranks(silent)}")
                    if unfinished:
                        parts.append(f"WRITE to {_ranks(unfinished)} unfinished")
                    raise EPError(
                        f"rank {self.rank}: all_to_all epoch {epoch} seq {seq} timed out after {self.timeout_s}s: "
                        + "; ".join(parts),
                        silent + unfinished,
                    )
                # Spin first (latency), then yield: on an oversubscribed CPU a spinning waiter
                # starves the very peers it waits for (4 ranks on 2 cores: 12 ms per collective
                # spinning vs 1.6 ms yielding). Long waits (a slow or dead peer) sleep instead of
                # burning a core until the timeout.
                time.sleep(0 if now < deadline - self.timeout_s + _YIELD_S else _SLEEP_S)

    def _on_notif(self, agent_name: str, raw: bytes, epoch: int, seq: int, got: dict[int, int]) -> None:
        try:
            m = _notif_decoder.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError):
            log.warning("%s: dropping malformed notification from %s: %r", self.name, agent_name, raw[:64])
            return
        sender = self._agent_rank.get(agent_name)
        if sender is None or sender != m.src:
            log.warning("%s: dropping notification %s from agent %s (rank %s)", self.name, m, agent_name, sender)
            return
        if not 0 <= m.nbytes <= self.capacity_bytes:
            log.warning("%s: dropping notification with bad size %s", self.name, m)
            return
        key = (m.epoch, m.seq)
        if key == (epoch, seq):
            got[m.src] = m.nbytes
        elif m.epoch > epoch or (m.epoch == epoch and m.seq > seq):
            self._stash.setdefault(key, {})[m.src] = m.nbytes
        else:
            log.debug("%s: dropping stale notification %s (now epoch %d seq %d)", self.name, m, epoch, seq)

    def _release(self, handles: dict) -> None:
        for dst, h in handles.items():
            self._nixl.release(h, f"{self.name}: WRITE handle to rank {dst}")
        handles.clear()

    # ------------------------------------------------------------------ teardown

    def _check_open(self) -> None:
        if self._closed:
            raise EPError(f"rank {self.rank}: communicator is closed")

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._active = ()
            self._drop_agent()
            log.info("%s: closed", self.name)

    def __enter__(self) -> NixlCommunicator:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
