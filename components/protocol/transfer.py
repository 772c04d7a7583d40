"""Weight-transfer manifests and pull plans, as data: what a source offers (`WeightManifest`), what a
joiner reads from whom (`PullItem`, planned by `spread` and the scale operation, and by `replan`
again for what a source lost mid-pull was to send), and what it reports (`PullStats`). Torch-free:
the router plans pulls; ranks execute them (engine/weights/store.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping

import msgspec

from components.protocol.placement import Placement, changed_slots


def expert_slot_name(layer: int, slot: int, part: str) -> str:
    """The name under which a rank's expert slot (gate, up or down) is offered and pulled."""
    return f"experts.{layer}.{slot}.{part}"


class TensorDesc(msgspec.Struct, frozen=True):
    name: str
    addr: int  # absolute address of the tensor's first byte in the source process / device
    nbytes: int
    dtype: str  # torch dtype name without "torch.", e.g. "bfloat16"
    shape: list[int]
    checksum: int


class IpcRegion(msgspec.Struct, frozen=True, array_like=True):
    """A CUDA allocation a peer on the same node can open directly (torch's CUDA IPC sharing)."""

    base: int
    nbytes: int
    device: int
    handle: bytes
    size: int
    offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool


class VmmRegion(msgspec.Struct, frozen=True, array_like=True):
    """A VMM arena a peer on the same node maps by asking `address` for its memory (vmm.VmmExporter)."""

    base: int
    nbytes: int
    address: str


class WeightManifest(msgspec.Struct, frozen=True):
    rank: int
    agent: str
    agent_metadata: bytes  # nixl_agent.get_agent_metadata(), valid for the agent's lifetime
    mem_type: str  # "DRAM" | "VRAM"
    dev_id: int
    tensors: list[TensorDesc]
    node: str = ""  # boot id of the source's machine: CUDA IPC only works within one
    ipc: list[IpcRegion] = []  # VRAM regions a same-node puller copies from directly
    vmm: list[VmmRegion] = []  # likewise, for weights in a VMM arena


class PullItem(msgspec.Struct, frozen=True):
    src_rank: int
    src_name: str
    dst_name: str


class SourceLoss(msgspec.Struct, frozen=True):
    """A source a pull gave up on (it failed, or the router said it did): why, and the items of
    the pull it was to send, none of them verified (their destinations hold garbage)."""

    src_rank: int
    reason: str
    items: list[PullItem]


class PullStats(msgspec.Struct):
    tensors: int  # pulled and verified; the items of `lost` not among them
    bytes: int
    seconds: float  # whole pull() call: metadata, transfers, verification
    per_source: dict[int, int]  # bytes per source rank
    setup_seconds: float = 0.0  # planning and loading the sources' NIXL metadata, before the first transfer
    transfer_seconds: float = 0.0  # first post to last completion
    verify_seconds: float = 0.0  # checksums still running after the last transfer (the rest overlapped it)
    ipc_bytes: int = 0  # of `bytes`, copied through CUDA IPC from same-node peers
    # Of transfer_seconds: opening and closing same-node peers' memory (one source's copy runs
    # while the next is opened), then the rest of the same-node phase: launching the copies (this
    # rank's own included) and waiting for them.
    map_seconds: float = 0.0
    copy_seconds: float = 0.0
    local_bytes: int = 0  # of `bytes`, copied from the puller's own tensors (its rank was a source)
    lost: list[SourceLoss] = []  # sources given up on, when the puller may lose some (pull(partial=True))

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


manifest_encoder = msgspec.msgpack.Encoder()
manifest_decoder = msgspec.msgpack.Decoder(WeightManifest)


def encode_manifest(m: WeightManifest) -> bytes:
    return manifest_encoder.encode(m)


def decode_manifest(blob: bytes) -> WeightManifest:
    return manifest_decoder.decode(blob)


def spread(names: list[str], sources: list[int], sizes: Mapping[str, int] | None = None) -> list[PullItem]:
    """Assign each tensor to one source, largest first to the least-loaded source, so a joiner
    reads non-expert weights from every serving peer at once. `sizes` (name -> bytes, e.g. from a
    manifest) balances bytes; without it every tensor counts the same. Deterministic: ties go to
    the earlier source in `sources`. Items come back in the order of `names`."""
    if not sources:
        raise ValueError("spread needs at least one source")
    if len(set(names)) != len(names):
        raise ValueError("spread: duplicate tensor names")
    load = {s: 0 for s in sources}
    order = sorted(range(len(names)), key=lambda i: -(sizes[names[i]] if sizes is not None else 1))
    chosen: dict[str, int] = {}
    for i in order:
        name = names[i]
        src = min(sources, key=lambda s: load[s])  # min() keeps the first of equals
        chosen[name] = src
        load[src] += sizes[name] if sizes is not None else 1
    return [PullItem(chosen[n], n, n) for n in names]


EXPERT_PARTS = ("gate", "up", "down")


def expert_pulls(current: Placement, target: Placement, sources: list[int]) -> dict[int, list[PullItem]]:
    """What each rank pulls so that every slot `target` changes holds its expert, read from the
    slots of `sources` that hold it under `current`. A rank reads from other ranks, spread round
    robin over the replicas; from one of its own slots only when no other source holds the expert,
    as a local copy (a rank never asks its own NIXL agent for its own memory)."""
    holders: dict[tuple[int, int], list[int]] = {}
    for layer, row in enumerate(current.slots):
        for slot, e in enumerate(row):
            if e >= 0 and slot // current.slots_per_rank in sources:
                holders.setdefault((layer, e), []).append(slot)
    turn = itertools.count()
    items: dict[int, list[PullItem]] = {}
    for layer, slot in changed_slots(current, target):
        dst, expert = slot // target.slots_per_rank, target.slots[layer][slot]
        choices = holders.get((layer, expert))
        if not choices:
            raise ValueError(f"no serving rank holds expert {expert} of layer {layer}")
        remote = [s for s in choices if s // current.slots_per_rank != dst]
        src_slot = remote[next(turn) % len(remote)] if remote else choices[0]
        for part in EXPERT_PARTS:
            items.setdefault(dst, []).append(
                PullItem(
                    src_rank=src_slot // current.slots_per_rank,
                    src_name=expert_slot_name(layer, src_slot % current.slots_per_rank, part),
                    dst_name=expert_slot_name(layer, slot % target.slots_per_rank, part),
                )
            )
    return items


def replan(
    lost: list[PullItem],
    planned: Placement,
    where: Placement,
    sources: list[int],
    dst: int,
    sizes: Mapping[str, int] | None = None,
) -> list[PullItem]:
    """The items rank `dst` lost with their source, read from other holders among `sources`: a
    dense weight from any of them (every serving rank holds every one, `spread` by `sizes`), an
    expert from a slot holding it under `where`, the expert being the one its lost source slot held
    under `planned` (the placement the items were planned on). As in `expert_pulls`, another
    rank's replica before `dst`'s own, round robin, the parts of one slot from one replica.
    ValueError naming the items that no source holds."""
    S = planned.slots_per_rank
    remote = [s for s in sources if s != dst]
    dense = [it.dst_name for it in lost if not it.src_name.startswith("experts.")]
    out = {it.dst_name: it for it in spread(dense, remote, sizes)} if dense and remote else {}
    orphans = dense if not remote else []
    turn = itertools.count()
    chosen: dict[tuple[int, str], int | None] = {}  # (layer, destination slot) -> source slot
    for it in lost:
        if not it.src_name.startswith("experts."):
            continue
        _, layer, slot, part = it.src_name.split(".")
        layer = int(layer)
        key = (layer, it.dst_name.rsplit(".", 1)[0])
        if key not in chosen:
            expert = planned.slots[layer][it.src_rank * S + int(slot)]
            holders = [s for s, e in enumerate(where.slots[layer]) if e == expert and s // S in sources]
            others = [s for s in holders if s // S != dst] or holders
            chosen[key] = others[next(turn) % len(others)] if others else None
        src_slot = chosen[key]
        if src_slot is None:
            orphans.append(it.dst_name)
            continue
        out[it.dst_name] = PullItem(src_slot // S, expert_slot_name(layer, src_slot % S, part), it.dst_name)
    if orphans:
        more = f" and {len(orphans) - 3} more" if len(orphans) > 3 else ""
        raise ValueError(f"no live rank holds {', '.join(orphans[:3])}{more} (of ranks {sorted(sources)})")
    return [out[it.dst_name] for it in lost]
