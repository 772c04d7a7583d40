"""Opening a same-node peer's memory directly, so a weight pull between processes of one machine
copies at device-copy speed instead of going through NIXL.

Why it is built this way:

* UCX in the NIXL wheel moved VRAM between processes of one node over tcp/loopback here, so a
  puller whose VRAM source is on its own node (same boot id, ``node_id``) maps the source's memory
  and copies from it itself. Torch's CUDA allocations are shared through CUDA IPC
  (``ipc_regions``); memory torch did not allocate, a CUDA VMM arena, cannot be, so an arena is
  lent by its own VmmExporter (vmm.py) and mapped with VmmImport.
* A process whose memory was exported for CUDA IPC, or that opened another's, cannot be
  checkpointed and restored (the driver API refuses). So a source exports only once it serves
  (``SameNodeExport.regions`` on its first manifest) and a puller closes what it opened as soon as
  it has copied (``SameNodeImports.close``): a joiner may be parked later.
* Best effort. A region that cannot be exported is left to NIXL; a source whose memory cannot be
  opened is read over NIXL instead (``open_regions`` raises).
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from components.protocol.transfer import IpcRegion, PullItem, TensorDesc, VmmRegion, WeightManifest

log = logging.getLogger(__name__)

# One tensor of a pull: what to read, its source's description, where it lands.
Entry = tuple[PullItem, TensorDesc, torch.Tensor]


def node_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() + "@" + socket.gethostname()
    except OSError:
        return socket.gethostname()


def ipc_regions(storages: list) -> list[IpcRegion]:
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


class SameNodeExport:
    """A source's memory as same-node pullers open it: its CUDA storages through CUDA IPC, its VMM
    arena (when it has one) through a VmmExporter."""

    def __init__(self, name: str, device: torch.device, storages: list, arena=None):
        self.name = name
        self._arena = arena
        in_arena = (lambda b: arena.ptr <= b < arena.ptr + arena.nbytes) if arena is not None else (lambda b: False)
        self._storages = [st for st in storages if not in_arena(st.data_ptr())] if device.type == "cuda" else []
        self._ipc: list[IpcRegion] | None = None
        self._vmm: list[VmmRegion] = []
        self._exporter = None

    def regions(self) -> tuple[list[IpcRegion], list[VmmRegion]]:
        """(CUDA IPC regions, VMM regions) for a manifest; exported on the first call."""
        if self._ipc is None:
            self._ipc = ipc_regions(self._storages)
            if self._arena is not None and self._arena.shareable:
                from components.engine.memory.vmm import VmmError, VmmExporter

                try:
                    self._exporter = VmmExporter(self._arena, keep=True)
                    self._vmm = [VmmRegion(self._arena.ptr, self._arena.nbytes, self._exporter.address)]
                except (VmmError, OSError) as e:
                    log.info("%s: the VMM arena cannot be lent (%s); NIXL serves it", self.name, e)
        return self._ipc, self._vmm

    def close(self) -> None:
        if self._exporter is not None:
            self._exporter.close()
            self._exporter = None


class SameNodeImports:
    """Same-node sources' memory opened in this process, per (source agent, region base)."""

    def __init__(self, name: str, device: torch.device, node: str, timeout_s: float = 10.0):
        self.name = name
        self.device = device
        self.node = node
        self.timeout_s = timeout_s
        # (source agent, region base) -> (its bytes, the VmmImport to close or None)
        self._opened: dict[tuple[str, int], tuple[torch.Tensor, object]] = {}
        # (source agent, region base) -> a VMM region's descriptors on their way (prefetch)
        self._coming: dict[tuple[str, int], Future] = {}
        self._pool: ThreadPoolExecutor | None = None

    def usable(self, m: WeightManifest) -> bool:
        return self.device.type == "cuda" and m.mem_type == "VRAM" and bool(m.ipc or m.vmm) and m.node == self.node

    def prefetch(self, manifests: Iterable[WeightManifest]) -> None:
        """Ask every usable source's VMM exporters for their descriptors now, from threads (sockets
        only), so the answers arrive together, and while the caller does other work, instead of
        one source after another inside the pull. `_open` takes them; `close` drops the unused."""
        from components.engine.memory.vmm import receive

        for m in manifests:
            if not self.usable(m):
                continue
            for g in m.vmm:
                if (m.agent, g.base) not in self._coming and (m.agent, g.base) not in self._opened:
                    if self._pool is None:
                        self._pool = ThreadPoolExecutor(8, thread_name_prefix=f"{self.name}-vmm-receive")
                    self._coming[m.agent, g.base] = self._pool.submit(receive, g.address, self.timeout_s)

    @staticmethod
    def _region(m: WeightManifest, desc: TensorDesc) -> IpcRegion | VmmRegion | None:
        return next((g for g in (*m.ipc, *m.vmm) if g.base <= desc.addr < g.base + g.nbytes), None)

    def open_regions(
        self, m: WeightManifest, entries: list[Entry]
    ) -> Iterator[tuple[list[Entry], list[tuple[torch.Tensor, torch.Tensor]]]]:
        """Open the regions of `m` the entries read, yielding (entries, their (destination, source
        bytes) pairs): first the entries of the region read most from, alone, then all the others.
        The caller copies each batch as it comes, so a pull's first copy starts after one opening
        instead of all of its first source's (each CUDA IPC opening took 0.2-0.3 ms on an H200,
        and a source lends a region per torch storage). Raises ValueError, before opening
        anything, for an entry outside every region, and the opening's error for a region that
        cannot be opened: the caller then waits for what it copied, closes the source (`close`)
        and reads it over NIXL instead."""
        by_region: dict[int, tuple[IpcRegion | VmmRegion, list[Entry]]] = {}
        for e in entries:
            g = self._region(m, e[1])
            if g is None:
                raise ValueError(f"tensor {e[0].src_name}: not in a region rank {m.rank} exported")
            by_region.setdefault(g.base, (g, []))[1].append(e)
        order = sorted(by_region.values(), key=lambda ge: -sum(d.nbytes for _, d, _ in ge[1]))
        for batch in (order[:1], order[1:]):
            if batch:
                yield (
                    [e for _, es in batch for e in es],
                    [
                        (dst, self._open(m.agent, g)[desc.addr - g.base : desc.addr - g.base + desc.nbytes])
                        for g, es in batch
                        for _, desc, dst in es
                    ],
                )

    def _open(self, agent: str, g: IpcRegion | VmmRegion) -> torch.Tensor:
        key = (agent, g.base)
        if key not in self._opened:
            if isinstance(g, VmmRegion):
                from components.engine.memory.vmm import VmmImport, receive

                coming = self._coming.pop(key, None)
                lent = coming.result() if coming is not None else receive(g.address, self.timeout_s)
                imp = VmmImport(lent, self.device)
                if imp.nbytes < g.nbytes:
                    imp.close()
                    raise ValueError(f"{g.address} lent {imp.nbytes} bytes, the manifest says {g.nbytes}")
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

    def close_descriptors(self) -> None:
        """Close the descriptors of what is mapped (the mappings stay): call while copies run."""
        for _, imported in self._opened.values():
            if imported is not None:
                imported.close_descriptors()

    def close(self, agent: str | None = None) -> None:
        """Close what was opened from `agent` (every source if None), and drop what was prefetched
        from it and not opened."""
        for key in [k for k in self._opened if agent is None or k[0] == agent]:
            _, imported = self._opened.pop(key)
            if imported is not None:
                imported.close()
        for key in [k for k in self._coming if agent is None or k[0] == agent]:
            self._coming.pop(key).add_done_callback(_drop_received)

    def shutdown(self) -> None:
        self.close()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _drop_received(f: Future) -> None:
    if not f.cancelled() and f.exception() is None:
        f.result().close()
