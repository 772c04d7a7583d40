"""Bake the artifacts tier of a snapshot: initialise a rank without weights, warm it up masked,
record what it was built for, and write it atomically.

Weights are never part of a snapshot: the engine is built with ``load_weights=False`` (dense
weights stay uninitialised, expert slots empty) and a joiner pulls them from its peers after
restoring. The warmup runs this rank alone (remote EP peers masked) through a prefill and every
decode batch size, which on CUDA replays the decode graphs captured at construction.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import msgspec

from snapshot.manifest import (
    SnapshotManifest,
    SnapshotTarget,
    check_creatable,
    check_destination,
    now_iso,
    write_snapshot,
)

# The defaults of components.worker.Worker.Config (kept in sync by a test).
DEFAULTS: dict[str, Any] = dict(
    device="cpu", dtype="", max_ranks=4, min_ranks=1, max_seqs=16, max_len=0, max_batched_tokens=256
)
ENGINE_FILE = "engine.json"
WARMUP_FILE = "warmup.json"
MODEL_CONFIG_FILE = "model_config.json"


def default_root() -> Path:
    env = os.environ.get("ELASTIC_EP_SNAPSHOTS")
    return Path(env) if env else Path.home() / ".cache" / "elastic-ep" / "snapshots"


def driver_version() -> str:
    """cuDriverGetVersion() as a string (e.g. "13000"), "" where cuda.bindings is missing."""
    try:
        from cuda.bindings import driver as d
    except ImportError:
        return ""
    err, ver = d.cuDriverGetVersion()
    return str(ver) if err == d.CUresult.CUDA_SUCCESS else ""


def device_info(device: str) -> tuple[str, str]:
    """(device_type, driver_version) for a torch device string."""
    import torch

    dev = torch.device(device)
    if dev.type != "cuda":
        return dev.type, ""
    return torch.cuda.get_device_name(dev), driver_version()


def model_source(model_dir: str | os.PathLike | None, model_name: str = "") -> tuple[str, str]:
    """(checkpoint directory, model name); None/"" = the built-in model (as the worker does)."""
    if model_dir:
        return str(model_dir), model_name or Path(model_dir).resolve().name
    from components.engine.builtin import BUILTIN_MODEL_NAME, builtin_model_dir

    return str(builtin_model_dir()), model_name or BUILTIN_MODEL_NAME


def _graph_sizes(device: str, max_seqs: int, sizes) -> list[int]:
    if not device.startswith("cuda"):
        return []
    return sorted(b for b in sizes if b <= max_seqs)


def rank_config(device: str = "cpu", **fields):
    """A RankConfig for rank 0 with the worker's defaults, `fields` overriding them."""
    from components.engine.rank import RankConfig

    kw = {**DEFAULTS, **{k: v for k, v in fields.items() if v is not None}, "device": device}
    return RankConfig(rank=0, **kw)


def target_for(model_dir: str | os.PathLike | None, cfg=None, **fields) -> SnapshotTarget:
    """What a deployment running `cfg` (a RankConfig; or RankConfig fields with the worker's
    defaults) on this machine expects of a snapshot, computed without building the engine."""
    import torch

    from components.engine.checkpoint import Checkpoint
    from components.engine.rank import DTYPES, context_length
    from components.protocol.placement import slots_needed

    if cfg is None:
        cfg = rank_config(**fields)
    mc = Checkpoint.open(model_source(model_dir)[0]).config
    device_type, drv = device_info(cfg.device)
    return SnapshotTarget(
        model_identity=mc.identity(),
        dtype=cfg.dtype or mc.dtype,
        max_ranks=cfg.max_ranks,
        num_experts=mc.num_experts,
        slots_per_rank=min(mc.num_experts, slots_needed(mc.num_experts, cfg.min_ranks, cfg.redundant_experts)),
        max_seqs=cfg.max_seqs,
        max_batched_tokens=cfg.max_batched_tokens,
        device_type=device_type,
        max_len=context_length(cfg.max_len, mc, cfg.max_seqs, DTYPES[cfg.dtype or mc.dtype], torch.device(cfg.device)),
        driver_version=drv,
        cuda_graph_sizes=_graph_sizes(cfg.device, cfg.max_seqs, cfg.cuda_graph_sizes),
    )


def target_for_engine(eng) -> SnapshotTarget:
    """The SnapshotTarget of a live EngineRank."""
    mc, cfg = eng.model_config, eng.cfg
    device_type, drv = device_info(str(eng.device))
    return SnapshotTarget(
        model_identity=mc.identity(),
        dtype=cfg.dtype or mc.dtype,
        max_ranks=cfg.max_ranks,
        num_experts=mc.num_experts,
        slots_per_rank=eng.slots_per_rank,
        max_seqs=cfg.max_seqs,
        max_len=eng.max_len,
        max_batched_tokens=cfg.max_batched_tokens,
        device_type=device_type,
        driver_version=drv,
        cuda_graph_sizes=sorted(eng.graphs.sizes) if eng.graphs else [],
    )


def _check_redundant(model_dir: str, min_ranks: int, redundant: int) -> None:
    """The engine caps a rank's expert slots at the model's expert count; refuse the redundant
    experts that cap would silently drop rather than record a value that changed nothing."""
    from components.engine.checkpoint import Checkpoint
    from components.protocol.placement import slots_needed

    if redundant < 0:
        raise ValueError(f"redundant_experts must be at least 0, got {redundant}")
    experts = Checkpoint.open(model_dir).config.num_experts
    if slots_needed(experts, min_ranks, redundant) > experts:
        raise ValueError(
            f"redundant_experts {redundant} does not fit: {min_ranks} rank(s) of at most {experts} expert "
            f"slots (the model's experts) hold at most {experts * (min_ranks - 1)} redundant experts"
        )


def new_snapshot_id(model_name: str, identity: str) -> str:
    slug = re.sub(r"[^A-Za-z0-9]+", "-", model_name.rsplit("/", 1)[-1]).strip("-").lower() or "model"
    return f"{slug}-{identity[:8]}-{uuid.uuid4().hex[:8]}"


def bake(
    out: str | os.PathLike | None = None,
    model_dir: str | os.PathLike | None = None,
    *,
    device: str = DEFAULTS["device"],
    dtype: str = DEFAULTS["dtype"],
    max_ranks: int = DEFAULTS["max_ranks"],
    min_ranks: int = DEFAULTS["min_ranks"],
    max_seqs: int = DEFAULTS["max_seqs"],
    max_len: int = DEFAULTS["max_len"],
    max_batched_tokens: int = DEFAULTS["max_batched_tokens"],
    redundant_experts: int = 0,
    cuda_graph_sizes: tuple[int, ...] | None = None,
    model_name: str = "",
    force: bool = False,
    progress: bool = True,
    root: str | os.PathLike | None = None,
) -> tuple[Path, SnapshotManifest]:
    """Bake the artifacts tier into `out` (default: <root>/<snapshot id>, root as default_root()).
    Returns (snapshot directory, manifest). Raises CheckpointError (bad model dir), ValueError
    (bad config), SnapshotExists (`out` exists and not `force`)."""
    from tqdm import tqdm

    if device == "cuda":
        device = "cuda:0"
    if not 1 <= min_ranks <= max_ranks:
        raise ValueError(f"min_ranks ({min_ranks}) must be in 1..max_ranks ({max_ranks})")
    if cuda_graph_sizes and not device.startswith("cuda"):
        raise ValueError(f"cuda_graph_sizes are captured on CUDA only, not on {device}")
    if cuda_graph_sizes and max(cuda_graph_sizes) > max_seqs:
        raise ValueError(f"cuda_graph_sizes: {max(cuda_graph_sizes)} exceeds max_seqs ({max_seqs})")
    # Fail before the expensive part.
    if out is not None:
        check_destination(out, force)
    else:
        check_creatable(root or default_root())
    src, name = model_source(model_dir, model_name)
    _check_redundant(src, min_ranks, redundant_experts)
    extra = {} if cuda_graph_sizes is None else {"cuda_graph_sizes": tuple(cuda_graph_sizes)}
    cfg = rank_config(
        device=device,
        dtype=dtype,
        max_ranks=max_ranks,
        min_ranks=min_ranks,
        max_seqs=max_seqs,
        max_len=max_len,
        max_batched_tokens=max_batched_tokens,
        redundant_experts=redundant_experts,
        **extra,
    )

    from components.engine.rank import EngineRank

    steps: dict[str, float] = {}
    bar = tqdm(
        total=3,
        desc="load model skeleton",
        unit="step",
        file=sys.stderr,
        disable=not progress,
        bar_format="{desc:<22} {bar} {n_fmt}/{total_fmt} [{elapsed}]",
    )
    try:
        t0 = time.perf_counter()
        eng = EngineRank(cfg, src, load_weights=False)
        steps["load_skeleton"] = time.perf_counter() - t0
        try:
            bar.update(1)
            bar.set_description_str("warmup (masked)")
            placement = eng.default_placement([cfg.rank])
            runs = [eng.warmup(placement), eng.warmup(placement)]  # cold, then warm
            steps["warmup"] = runs[0]
            steps["warmup_again"] = runs[1]
            bar.update(1)
            bar.set_description_str("write")
            mc = eng.model_config
            target = target_for_engine(eng)
            sid = new_snapshot_id(name, target.model_identity)
            dest = Path(out) if out is not None else Path(root or default_root()) / sid
            manifest = SnapshotManifest(
                snapshot_id=sid,
                created=now_iso(),
                tier="artifacts",
                model_name=name,
                architecture=mc.architecture,
                warmup_seconds=round(runs[0], 6),
                weights_included=False,
                **msgspec.structs.asdict(target),
            )
            warm = {
                "steps_s": {k: round(v, 6) for k, v in steps.items()},
                "warmup_runs_s": [round(r, 6) for r in runs],
                "cuda_graph_sizes": target.cuda_graph_sizes,
                "cuda_graph_captures": eng.graphs.captures if eng.graphs else 0,
                "device": str(eng.device),
                "torch": __import__("torch").__version__,
                "python": sys.version.split()[0],
            }
            files = {
                ENGINE_FILE: msgspec.json.format(msgspec.json.encode(cfg), indent=2) + b"\n",
                WARMUP_FILE: (json.dumps(warm, indent=2) + "\n").encode(),
                MODEL_CONFIG_FILE: (Path(src) / "config.json").read_bytes(),
            }
            manifest = write_snapshot(dest, manifest, files, force=force)
            bar.update(1)
            bar.set_description_str("done")
        finally:
            eng.stop()  # stops the loop if started, closes the communicator
    finally:
        bar.close()
    return dest.absolute(), manifest
