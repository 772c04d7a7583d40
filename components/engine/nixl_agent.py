"""What the EP communicator and the weight store both do with a NIXL agent: import the bindings,
load a peer's metadata under the name it claims, and tear down so that one failure (a peer that
is already gone, a handle still in flight on an error path) never stops the rest."""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


class PeerMetadataError(RuntimeError):
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


def load_peer(agent, metadata: bytes, claimed: str) -> str:
    """Load a peer's metadata; the agent name NIXL loaded must be the one the peer claims (a stale
    or forged manifest is unloaded again). Returns that name."""
    try:
        loaded = agent.add_remote_agent(metadata)
    except Exception as e:
        raise PeerMetadataError(f"loading its NIXL metadata failed: {e}") from e
    loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
    if loaded != claimed:
        agent.remove_remote_agent(loaded)
        raise PeerMetadataError(f"it claims agent {claimed!r} but its metadata is {loaded!r}")
    return loaded


def forget_peer(agent, name: str, owner: str) -> None:
    try:
        agent.remove_remote_agent(name)
    except Exception as e:  # a peer that is already gone must not stop the others' teardown
        log.warning("%s: remove_remote_agent(%s) failed: %s", owner, name, e)


def deregister(agent, reg, owner: str) -> None:
    try:
        agent.deregister_memory(reg)
    except Exception as e:
        log.warning("%s: deregister_memory failed: %s", owner, e)


def release(handle, leaked: list, what: str) -> None:
    """Release a transfer handle. One NIXL refuses (still in flight, on an error path) stays
    referenced in `leaked`, for release_quietly at close."""
    try:
        handle.release()
    except Exception as e:
        log.warning("could not release %s: %s", what, e)
        leaked.append(handle)


def release_quietly(handles: list) -> None:
    """Release handles NIXL refused to release earlier (teardown: errors are moot)."""
    for h in handles:
        try:
            h.release()
        except Exception:
            pass
    handles.clear()
