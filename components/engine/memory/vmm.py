"""CUDA virtual memory (VMM) arenas: tensors at fixed addresses whose physical memory can be
dropped and brought back.

A `VmmArena` reserves one virtual address range on a CUDA device, maps physical memory into it
(one or a few chunks, `cuMemCreate` + `cuMemMap`) and hands out aligned tensor views of it with a
bump allocator. Everything a captured CUDA graph reads at a fixed address (weights, expert slots,
KV cache) can live there. `release()` unmaps and frees the physical memory but keeps the virtual
range reserved: the views keep their `data_ptr()` (they must not be touched until `remap()`), and
a process parked with the driver checkpoint API then holds no copy of them, which keeps the
checkpoint small and fast (docs/design.md, "Snapshots"). `remap()` maps fresh physical memory at the
same addresses; its contents are undefined and the caller refills them (from peers or the
checkpoint), after which graphs captured before the release compute correctly again.

`place_engine_memory(model, kv)` moves a model's parameters, its MoE expert slot buffers and a
KV cache into one arena; call it before any CUDA graph is captured.

Sharing. CUDA IPC handles (cudaIpcGetMemHandle, torch's storage sharing) do not cover VMM
memory, and UCX moved VRAM between two processes of one GPU at 0.5 GB/s here, so an arena lends
its memory itself: `VmmExporter` hands each connecting process of the same user one POSIX file
descriptor per chunk (SCM_RIGHTS over an abstract Unix socket), `receive` gets them (sockets only,
so a puller asks all its sources at once from threads), and `VmmImport` maps them into the
importer, which then copies at device-copy speed. The exporter's own mapping is untouched; an
importer's mapping keeps the physical memory alive until it closes it, so it must close before the
exporter may count on a release having freed anything.

`cuda.bindings` is imported lazily, so this module imports anywhere; on CPU every entry point
raises `VmmError`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import threading
from collections.abc import Iterable, Iterator, Sequence

import msgspec
import torch

log = logging.getLogger(__name__)

DEFAULT_ALIGN = 256  # bytes between views: what vectorised loads and cuBLAS like


class VmmError(RuntimeError):
    """A VMM arena cannot be used here, or a driver call failed (the message names the call)."""


def _driver():
    try:
        from cuda.bindings import driver as d
    except ImportError as e:
        raise VmmError(f"CUDA VMM needs cuda.bindings (pip install cuda-python): {e}") from None
    return d


def _check(d, call: str, result):
    err = result[0] if isinstance(result, tuple) else result
    if err != d.CUresult.CUDA_SUCCESS:
        name = str(getattr(err, "name", err)).split(".")[-1]
        raise VmmError(f"{call} failed: {name}")
    if isinstance(result, tuple):
        return result[1] if len(result) == 2 else result[1:]
    return None


def _cuda_device(device) -> torch.device:
    dev = torch.device(device) if device is not None else torch.device("cuda")
    if dev.type != "cuda":
        raise VmmError(f"a VMM arena needs a CUDA device, got {str(dev)!r}")
    if not torch.cuda.is_available():
        raise VmmError("a VMM arena needs a CUDA device, and torch sees none")
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def _bytes(shape, dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n * dtype.itemsize


def plan_bytes(specs: Iterable[tuple[Sequence[int], torch.dtype]], align: int = DEFAULT_ALIGN) -> int:
    """Bytes an arena needs to hand out one view per (shape, dtype), each `align`-aligned."""
    return sum(_round_up(_bytes(shape, dtype), align) for shape, dtype in specs)


class _Raw:
    """A bare __cuda_array_interface__ so torch can wrap the range (torch keeps it alive)."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
        }


class VmmArena:
    """One reserved VA range on a CUDA device with physical memory mapped into it.

    `nbytes` is rounded up to the allocation granularity (2 MiB on current GPUs). Physical memory
    is created in chunks of at most `chunk_bytes` (default: one chunk for the whole range).
    `alloc` views must be handed out before anything that records their addresses (CUDA graphs,
    NIXL registrations) is set up; they stay valid for the arena's life, but read or write them
    only while `mapped`.
    """

    def __init__(self, nbytes: int, device=None, align: int = DEFAULT_ALIGN, chunk_bytes: int | None = None):
        if nbytes <= 0:
            raise VmmError(f"a VMM arena needs a positive size, got {nbytes}")
        if align <= 0 or align & (align - 1):
            raise VmmError(f"align must be a power of two, got {align}")
        self.device = _cuda_device(device)
        self.align = align
        d = self._d = _driver()
        torch.cuda.init()
        with torch.cuda.device(self.device):
            torch.empty(1, device=self.device)  # the primary context exists and is current
        _check(d, "cuInit", d.cuInit(0))
        prop = d.CUmemAllocationProp()
        prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = self.device.index
        posix_fd = d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        dev = _check(d, "cuDeviceGet", d.cuDeviceGet(self.device.index))
        self.shareable = bool(
            _check(
                d,
                "cuDeviceGetAttribute",
                d.cuDeviceGetAttribute(
                    d.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, dev
                ),
            )
        )
        if self.shareable:  # exportable to same-node peers (VmmExporter)
            prop.requestedHandleTypes = posix_fd
        self._prop = prop
        gran = int(
            _check(
                d,
                "cuMemGetAllocationGranularity",
                d.cuMemGetAllocationGranularity(
                    prop, d.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
                ),
            )
        )
        mini = int(
            _check(
                d,
                "cuMemGetAllocationGranularity",
                d.cuMemGetAllocationGranularity(
                    prop, d.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
                ),
            )
        )
        self.granularity = max(gran, mini)
        self._nbytes = _round_up(int(nbytes), self.granularity)
        chunk = self._nbytes if not chunk_bytes else _round_up(min(int(chunk_bytes), self._nbytes), self.granularity)
        self._chunks = [(off, min(chunk, self._nbytes - off)) for off in range(0, self._nbytes, chunk)]
        self._va = _check(d, "cuMemAddressReserve", d.cuMemAddressReserve(self._nbytes, self.granularity, 0, 0))
        self.ptr = int(self._va)
        self._handles: list = []
        self._lent: list[tuple[int, int, int]] = []  # exported descriptors (lend)
        self._offset = 0
        self._closed = False
        self._lock = threading.Lock()
        try:
            self._map()
        except BaseException:
            self._unmap(sync=False)
            d.cuMemAddressFree(self._va, self._nbytes)
            raise
        self._flat = torch.as_tensor(_Raw(self.ptr, self._nbytes), device=self.device)
        if self._flat.data_ptr() != self.ptr:
            raise VmmError("torch did not wrap the arena at its address")

    # ---- physical memory -------------------------------------------------------------------
    def _map(self) -> None:
        d = self._d
        torch.cuda.synchronize(self.device)  # the primary context is current on this thread too
        acc = d.CUmemAccessDesc()
        acc.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        acc.location.id = self.device.index
        acc.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        for off, size in self._chunks:
            h = _check(d, "cuMemCreate", d.cuMemCreate(size, self._prop, 0))
            try:
                _check(d, "cuMemMap", d.cuMemMap(d.CUdeviceptr(self.ptr + off), size, 0, h, 0))
            except VmmError:
                d.cuMemRelease(h)
                raise
            self._handles.append((off, size, h))
            _check(d, "cuMemSetAccess", d.cuMemSetAccess(d.CUdeviceptr(self.ptr + off), size, [acc], 1))

    def _unmap(self, sync: bool = True) -> None:
        d = self._d
        self._close_lent()  # an exported descriptor would keep the physical memory alive
        if sync and self._handles:
            torch.cuda.synchronize(self.device)
        errors = []
        while self._handles:
            off, size, h = self._handles.pop()
            for call, res in (
                ("cuMemUnmap", d.cuMemUnmap(d.CUdeviceptr(self.ptr + off), size)),
                ("cuMemRelease", d.cuMemRelease(h)),
            ):
                try:
                    _check(d, call, res)
                except VmmError as e:
                    errors.append(str(e))
        if errors:
            raise VmmError("; ".join(errors))

    @property
    def mapped(self) -> bool:
        """Physical memory is mapped: the views may be read and written."""
        return bool(self._handles)

    @property
    def nbytes(self) -> int:
        """Size of the reserved range (and of the physical memory while mapped)."""
        return self._nbytes

    @property
    def used(self) -> int:
        """Bytes handed out so far (alignment padding included)."""
        return self._offset

    def release(self) -> None:
        """Synchronize the device, then unmap and free the physical memory; the VA stays reserved
        and every view keeps its address. No-op when already released."""
        self._check_open()
        with self._lock:
            self._unmap(sync=True)

    def remap(self) -> None:
        """Map fresh physical memory at the same addresses (contents undefined: refill them).
        No-op when already mapped."""
        self._check_open()
        with self._lock:
            if self._handles:
                return
            try:
                self._map()
            except BaseException:
                self._unmap(sync=False)
                raise

    @contextlib.contextmanager
    def lend(self) -> Iterator[list[tuple[int, int, int]]]:
        """(offset, size, fd) per chunk of the mapped memory, to send to an importer, held under
        the arena's lock so a release cannot free them meanwhile. Exported on the first use after
        each mapping (0.7-1.0 ms a chunk measured in bench.weight_pull's sources on an H200, whose
        arenas NIXL had registered; 0.05 ms in a bare process) and kept until `unlend()`, a
        release or close."""
        self._check_open()
        if not self.shareable:
            raise VmmError("this device cannot export VMM memory as POSIX file descriptors")
        with self._lock:
            if not self._handles:
                raise VmmError("the VMM arena is released: nothing to export")
            if not self._lent:
                self._lent = self._export()
            yield self._lent

    def unlend(self) -> None:
        """Close the exported descriptors (the next `lend()` exports anew)."""
        with self._lock:
            self._close_lent()

    def _export(self) -> list[tuple[int, int, int]]:
        d = self._d
        kind = d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        out = []
        try:
            for off, size, h in sorted(self._handles, key=lambda x: x[0]):
                fd = _check(d, "cuMemExportToShareableHandle", d.cuMemExportToShareableHandle(h, kind, 0))
                out.append((off, size, int(fd)))
        except VmmError:
            for _, _, fd in out:
                os.close(fd)
            raise
        return out

    def _close_lent(self) -> None:
        lent, self._lent = self._lent, []
        for _, _, fd in lent:
            os.close(fd)

    def close(self) -> None:
        """Free the physical memory and the VA range. Views must not be used afterwards."""
        if self._closed:
            return
        with self._lock:
            self._unmap(sync=True)
            self._flat = None
            _check(self._d, "cuMemAddressFree", self._d.cuMemAddressFree(self._va, self._nbytes))
            self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise VmmError("the VMM arena is closed")

    # ---- views -----------------------------------------------------------------------------
    def alloc(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """A contiguous `shape` x `dtype` view at the next aligned offset (contents undefined)."""
        self._check_open()
        shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list, torch.Size)) else (shape,)))
        n = _bytes(shape, dtype)
        with self._lock:
            off = self._offset
            if off + n > self._nbytes:
                raise VmmError(f"VMM arena full: {n} bytes asked, {self._nbytes - off} of {self._nbytes} left")
            self._offset = _round_up(off + n, self.align)
        if not n:
            return torch.empty(shape, dtype=dtype, device=self.device)
        # Made in grad mode even under no_grad: a view created in no_grad mode may not later be
        # written in place with grad enabled (graph capture writes the KV views that way).
        with torch.enable_grad():
            return self._flat[off : off + n].view(dtype).view(shape)

    def alloc_like(self, t: torch.Tensor, copy: bool = True) -> torch.Tensor:
        """A view shaped like `t`, filled with its values when `copy` (the arena must be mapped)."""
        out = self.alloc(t.shape, t.dtype)
        if copy:
            out.copy_(t)
        return out

    def __contains__(self, t: torch.Tensor) -> bool:
        p = t.data_ptr()
        return t.device == self.device and self.ptr <= p < self.ptr + self._nbytes

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("mapped" if self.mapped else "released")
        return (
            f"VmmArena({self.device}, {self._nbytes / 2**20:.1f} MiB reserved at {self.ptr:#x}, "
            f"{self._offset / 2**20:.1f} MiB used, {len(self._chunks)} chunk(s), {state})"
        )


_layout_encoder = msgspec.msgpack.Encoder()
_layout_decoder = msgspec.msgpack.Decoder(list[tuple[int, int]])


class VmmExporter:
    """Serves an arena's chunks as file descriptors, over the abstract Unix socket `address`, to
    processes of this user on this machine (checked with SO_PEERCRED: a mapping is writable).

    With `keep`, the descriptors are exported once per mapping of the arena and kept open until it
    is released (a weight arena: a puller's wait shrinks by the export). Without, each request
    gets a fresh export, closed once sent: a mailbox stays mapped while its process is
    CUDA-checkpointed, and a checkpoint with exported descriptors open has not been tried."""

    def __init__(self, arena: VmmArena, keep: bool):
        if not arena.shareable:
            raise VmmError("this device cannot export VMM memory as POSIX file descriptors")
        self.arena = arena
        self.keep = keep
        self.address = f"elastic-ep-vmm-{os.getpid()}-{id(self):x}"
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind("\0" + self.address)
        self._sock.listen(16)
        self._sock.settimeout(0.2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="vmm-export", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except (TimeoutError, OSError):
                continue
            with conn:
                _, uid, _ = struct.unpack(
                    "3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
                )
                if uid != os.getuid():
                    log.warning("%s: refused a process of uid %d", self.address, uid)
                    continue
                try:
                    with self.arena.lend() as chunks:
                        socket.send_fds(
                            conn, [_layout_encoder.encode([(o, n) for o, n, _ in chunks])], [fd for _, _, fd in chunks]
                        )
                except VmmError as e:
                    log.warning("%s: export failed: %s", self.address, e)
                except OSError as e:
                    log.warning("%s: sending the descriptors failed: %s", self.address, e)
                finally:
                    if not self.keep:
                        self.arena.unlend()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sock.close()
        self.arena.unlend()


class LentMemory:
    """An arena's chunks as its VmmExporter lent them: (offset, size) each and its file descriptor.
    Owns the descriptors until they are mapped (VmmImport, VmmWindow.map) or closed."""

    def __init__(self, address: str, layout: list[tuple[int, int]], fds: list[int]):
        self.address, self.layout, self.fds = address, layout, fds
        self.nbytes = max(o + n for o, n in layout)

    def close(self) -> None:
        fds, self.fds = self.fds, []
        for fd in fds:
            os.close(fd)


def receive(address: str, timeout_s: float = 10.0) -> LentMemory:
    """Ask the VmmExporter at `address` for its chunks. Sockets only (no CUDA call), so several
    sources can be asked at once from threads while the caller maps what already came."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        try:
            s.connect("\0" + address)
            msg, fds, _, _ = socket.recv_fds(s, 1 << 16, 256)
        except OSError as e:
            raise VmmError(f"could not get the memory of {address}: {e}") from None
    try:
        if not fds:
            raise VmmError(f"{address} sent no memory (its export failed; see its log)")
        layout = _layout_decoder.decode(msg)
        if len(layout) != len(fds):
            raise VmmError(f"{address} sent {len(fds)} descriptors for {len(layout)} chunks")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return LentMemory(address, layout, fds)


def _map_imported(d, device: torch.device, va: int, lent: LentMemory) -> list:
    """Import each lent chunk and map it at `va` + its offset, read-write for `device`. Returns the
    mapped (offset, size, handle); on failure nothing stays mapped. The caller closes the fds."""
    kind = d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    handles: list = []
    try:
        for (off, size), fd in zip(lent.layout, lent.fds):
            h = _check(d, "cuMemImportFromShareableHandle", d.cuMemImportFromShareableHandle(fd, kind))
            handles.append((off, size, h))
            _check(d, "cuMemMap", d.cuMemMap(d.CUdeviceptr(va + off), size, 0, h, 0))
        acc = d.CUmemAccessDesc()
        acc.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        acc.location.id = device.index
        acc.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        _check(d, "cuMemSetAccess", d.cuMemSetAccess(d.CUdeviceptr(va), lent.nbytes, [acc], 1))
    except BaseException:
        _unmap_imported(d, va, handles)
        raise
    return handles


def _unmap_imported(d, va: int, handles) -> None:
    for off, size, h in handles:
        d.cuMemUnmap(d.CUdeviceptr(va + off), size)
        d.cuMemRelease(h)


class VmmImport:
    """Another process's arena, as `receive` got it, mapped into this one (read-write) as one
    uint8 tensor."""

    def __init__(self, lent: LentMemory, device=None):
        self._lent = lent
        try:
            self.device = _cuda_device(device)
            d = self._d = _driver()
            self.nbytes = lent.nbytes
            self._va = _check(d, "cuMemAddressReserve", d.cuMemAddressReserve(self.nbytes, 0, 0, 0))
            try:
                self._handles = _map_imported(d, self.device, int(self._va), lent)
            except BaseException:
                d.cuMemAddressFree(self._va, self.nbytes)
                raise
        except BaseException:
            lent.close()
            raise
        self.tensor = torch.as_tensor(_Raw(int(self._va), self.nbytes), device=self.device)

    def close_descriptors(self) -> None:
        """The mapping no longer needs the lent descriptors. Closing one took 0.6 ms on an H200, so
        a puller closes them while its copies run rather than before launching them."""
        self._lent.close()

    def close(self) -> None:
        """Unmap (after the device finished reading) and drop our hold on the memory."""
        self.close_descriptors()
        if self.tensor is None:
            return
        self.tensor = None
        torch.cuda.synchronize(self.device)
        _unmap_imported(self._d, int(self._va), self._handles)
        self._d.cuMemAddressFree(self._va, self.nbytes)


class VmmWindow:
    """`slots` fixed-address windows of `nbytes` each, reserved once, into which other processes'
    arenas are mapped and unmapped (window i at `ptr + i * nbytes`); the range stays reserved, so
    kernels and graphs that recorded a window's address stay valid across remaps."""

    def __init__(self, slots: int, nbytes: int, device=None, timeout_s: float = 10.0):
        self.device = _cuda_device(device)
        d = self._d = _driver()
        self.slots, self.nbytes, self.timeout_s = slots, nbytes, timeout_s
        self._va = _check(d, "cuMemAddressReserve", d.cuMemAddressReserve(slots * nbytes, 0, 0, 0))
        self.ptr = int(self._va)
        self.mapped: dict[int, list] = {}

    def map(self, i: int, address: str) -> int:
        """Map the arena served at `address` into window i (replacing what was there); returns
        the window's address."""
        lent = receive(address, self.timeout_s)
        if lent.nbytes > self.nbytes:
            lent.close()
            raise VmmError(f"{address} lends more than a {self.nbytes}-byte window holds")
        try:
            self.unmap(i)
            self.mapped[i] = _map_imported(self._d, self.device, self.ptr + i * self.nbytes, lent)
        finally:
            lent.close()
        return self.ptr + i * self.nbytes

    def unmap(self, i: int) -> None:
        """Unmap window i (after the device finished with it); its range stays reserved."""
        handles = self.mapped.pop(i, None)
        if handles:
            torch.cuda.synchronize(self.device)
            _unmap_imported(self._d, self.ptr + i * self.nbytes, handles)

    def close(self) -> None:
        for i in list(self.mapped):
            self.unmap(i)
        self._d.cuMemAddressFree(self._va, self.slots * self.nbytes)


EXPERT_BUFFERS = ("w_gate", "w_up", "w_down")


def engine_tensors(model, kv) -> list[torch.Tensor]:
    """What `place_engine_memory` moves: dense parameters (tied ones once), expert slot buffers,
    KV cache."""
    out = [p for _, p in model.named_parameters()]
    for _, moe in model.moe_layers:
        out += [getattr(moe, n) for n in EXPERT_BUFFERS]
    return out + list(kv.k) + list(kv.v)


def place_engine_memory(model, kv, device=None, chunk_bytes: int | None = None) -> VmmArena:
    """Move every dense parameter (`param.data`, so tied weights stay tied), every MoE expert
    slot buffer (re-registered under the same name) and the KV cache (k/v lists) of `model`/`kv`
    into one new arena, keeping their values (KV zeroed). Call before capturing CUDA graphs."""
    dev = _cuda_device(device if device is not None else model.lm_head.weight.device)
    arena = VmmArena(plan_bytes((t.shape, t.dtype) for t in engine_tensors(model, kv)), dev, chunk_bytes=chunk_bytes)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.data = arena.alloc_like(p.data)
        for _, moe in model.moe_layers:
            for n in EXPERT_BUFFERS:
                moe.register_buffer(n, arena.alloc_like(getattr(moe, n)), persistent=False)
        for lst in (kv.k, kv.v):  # the same list objects: whoever holds kv.k sees the views
            for i, t in enumerate(lst):
                lst[i] = arena.alloc(t.shape, t.dtype).zero_()
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()  # the old copies go back to the driver, not to torch's cache
    return arena
