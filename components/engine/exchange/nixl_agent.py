"""What the EP communicator and the weight store both do with a NIXL agent: create it on the UCX
backend, call it under one lock (agents are created without internal locking), register memory,
load a peer's metadata under the name it claims, and tear down so that one failure (a peer that
is already gone, a handle still in flight on an error path) never stops the rest."""

from __future__ import annotations

import logging
import threading

import torch

log = logging.getLogger(__name__)


class NixlError(RuntimeError):
    """The NIXL agent could not be created as needed (no UCX backend)."""


class PeerMetadataError(NixlError):
    """A peer's NIXL metadata could not be loaded, or names another agent than the peer claims."""


def import_nixl():
    """(nixl_agent, nixl_agent_config, bindings) from the wheel installed."""
    try:
        import nixl_cu13._bindings as bindings
        from nixl_cu13._api import nixl_agent, nixl_agent_config
    except ImportError:  # other wheel flavours expose the same API under `nixl`
        import nixl._bindings as bindings  # type: ignore
        from nixl._api import nixl_agent, nixl_agent_config  # type: ignore
    return nixl_agent, nixl_agent_config, bindings


def nixl_memory(device: torch.device | str) -> tuple[torch.device, str, int]:
    """(device with its index, NIXL memory type, NIXL device id) of memory on `device`."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {device}")
    if device.type == "cuda":
        return device, "VRAM", device.index
    return device, "DRAM", 0


class NixlAgent:
    """One NIXL agent on the UCX backend and what it holds: memory registrations, the peers it
    loaded and transfer handles NIXL refused to release. `agent` is the raw NIXL agent; every call
    on it goes through `lock` (reentrant: the methods here take it too, so a caller may hold it
    across several calls). `lock` may be the caller's own, to outlive this agent (a communicator
    that drops its agent at park and makes a new one at resume)."""

    def __init__(self, name: str, progress_thread: bool = False, lock: threading.RLock | None = None):
        nixl_agent, nixl_agent_config, self.bindings = import_nixl()
        self.name = name
        self.lock = lock if lock is not None else threading.RLock()
        self.agent = nixl_agent(name, nixl_agent_config(backends=["UCX"], enable_prog_thread=progress_thread))
        if "UCX" not in self.agent.backends:
            raise NixlError("NIXL UCX backend is not available (plugin missing)")
        self.peers: set[str] = set()  # agent names loaded (each the one its peer claims)
        self._regs: list = []
        self._leaked: list = []

    def register(self, *args, **kwargs) -> None:
        """agent.register_memory(...); deregistered at close()."""
        with self.lock:
            self._regs.append(self.agent.register_memory(*args, **kwargs))

    def metadata(self) -> bytes:
        with self.lock:
            return self.agent.get_agent_metadata()

    def descs(self, mem_type: str, ranges: list[tuple[int, int, int]]):
        """A transfer descriptor list over (address, bytes, device id) ranges of `mem_type` memory."""
        nb = self.bindings
        return nb.nixlXferDList(nb.VRAM_SEG if mem_type == "VRAM" else nb.DRAM_SEG, ranges)

    def load_peer(self, metadata: bytes, claimed: str) -> str:
        """Load a peer's metadata; the agent name NIXL loaded must be the one the peer claims (a
        stale or forged manifest is unloaded again). Returns that name."""
        with self.lock:
            try:
                loaded = self.agent.add_remote_agent(metadata)
            except Exception as e:
                raise PeerMetadataError(f"loading its NIXL metadata failed: {e}") from e
            loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
            if loaded != claimed:
                self.agent.remove_remote_agent(loaded)
                raise PeerMetadataError(f"it claims agent {claimed!r} but its metadata is {loaded!r}")
            self.peers.add(loaded)
            return loaded

    def forget_peer(self, name: str) -> None:
        with self.lock:
            self.peers.discard(name)
            try:
                self.agent.remove_remote_agent(name)
            except Exception as e:  # a peer that is already gone must not stop the others' teardown
                log.warning("%s: remove_remote_agent(%s) failed: %s", self.name, name, e)

    def release(self, handle, what: str) -> None:
        """Release a transfer handle. One NIXL refuses (still in flight, on an error path) stays
        referenced until close()."""
        with self.lock:
            try:
                handle.release()
            except Exception as e:
                log.warning("could not release %s: %s", what, e)
                self._leaked.append(handle)

    def close(self) -> None:
        """Release what NIXL refused to earlier, forget every peer, deregister the memory and drop
        the agent (and with it its UCX context). Errors are logged, never raised: teardown."""
        with self.lock:
            if self.agent is None:
                return
            for h in self._leaked:
                try:
                    h.release()
                except Exception:
                    pass
            self._leaked.clear()
            for name in list(self.peers):
                self.forget_peer(name)
            for reg in self._regs:
                try:
                    self.agent.deregister_memory(reg)
                except Exception as e:
                    log.warning("%s: deregister_memory failed: %s", self.name, e)
            self._regs = []
            self.agent = None
