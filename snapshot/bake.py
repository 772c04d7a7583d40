"""Bake a snapshot: initialise a rank without weights, warm it up masked, record what it was
built for, and write it atomically. The criu tier does this in a worker process that it then
dumps with CRIU (joiners are restored from that image); the artifacts tier in this process.

Weights are never part of a snapshot: the engine is built with ``load_weights=False`` (dense
weights stay uninitialised, expert slots empty) and a joiner pulls them from its peers after
restoring. The warmup runs this rank alone (remote EP peers masked) through a prefill and every
decode batch size, which on CUDA replays the decode graphs captured at construction.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import msgspec

from snapshot.manifest import (
    SnapshotError,
    SnapshotManifest,
    SnapshotTarget,
    check_creatable,
    check_destination,
    now_iso,
    write_snapshot,
)

# The defaults of components.worker.Worker.Config (kept in sync by a test).
DEFAULTS: dict[str, Any] = dict(
    device="cpu",
    dtype="",
    max_ranks=4,
    min_ranks=1,
    max_seqs=16,
    max_len=0,
    max_batched_tokens=0,
    batch_invariant=True,
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
    from components.engine.models.builtin import BUILTIN_MODEL_NAME, builtin_model_dir

    return str(builtin_model_dir()), model_name or BUILTIN_MODEL_NAME


def _graph_sizes(cfg) -> list[int]:
    from components.engine.rank import decode_graph_sizes

    return decode_graph_sizes(cfg) if cfg.device.startswith("cuda") else []


def rank_config(device: str = "cpu", **fields):
    """A RankConfig for rank 0 with the worker's defaults, `fields` overriding them."""
    from components.engine.rank import RankConfig, batched_tokens

    kw = {**DEFAULTS, **{k: v for k, v in fields.items() if v is not None}, "device": device}
    kw["max_batched_tokens"] = batched_tokens(kw["max_batched_tokens"], device)
    return RankConfig(rank=0, **kw)


def target_for(model_dir: str | os.PathLike | None, cfg=None, **fields) -> SnapshotTarget:
    """What a deployment running `cfg` (a RankConfig; or RankConfig fields with the worker's
    defaults) on this machine expects of a snapshot, computed without building the engine."""
    import torch

    from components.engine.models.checkpoint import Checkpoint
    from components.engine.rank import DTYPES, context_length, ep_transport
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
        cuda_graph_sizes=_graph_sizes(cfg),
        batch_invariant=cfg.batch_invariant,
        ep_transport=ep_transport(cfg, torch.device(cfg.device)),
    )


def target_for_engine(eng) -> SnapshotTarget:
    """The SnapshotTarget of a live EngineRank."""
    from components.engine.rank import ep_transport

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
        batch_invariant=cfg.batch_invariant,
        ep_transport=ep_transport(cfg, eng.device),
    )


def _check_redundant(model_dir: str, min_ranks: int, redundant: int) -> None:
    """The engine caps a rank's expert slots at the model's expert count; refuse the redundant
    experts that cap would silently drop rather than record a value that changed nothing."""
    from components.engine.models.checkpoint import Checkpoint
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


class BakeSpec(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What the process baked into a CRIU image builds (`python -m components.worker --bake SPEC`)."""

    config: dict[str, Any]  # a RankConfig (rank 0; the restored copy is told its own)
    model_dir: str
    ready: str  # where it writes its BakeReady once warm, then waits to be dumped


class BakeReady(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    target: SnapshotTarget
    architecture: str
    steps_s: dict[str, float]
    warmup_runs_s: list[float]
    warm: dict[str, Any]


def warm(cfg, model_dir: str, on_step=lambda desc: None):
    """Build an EngineRank without weights and warm it up masked, twice (cold, then warm).
    Returns (engine, BakeReady); `on_step(description)` after each of the two steps."""
    from components.engine.rank import EngineRank

    steps: dict[str, float] = {}
    t0 = time.perf_counter()
    eng = EngineRank(cfg, model_dir, load_weights=False)
    steps["load_skeleton"] = time.perf_counter() - t0
    on_step("warmup (masked)")
    placement = eng.default_placement([cfg.rank])
    runs = [eng.warmup(placement), eng.warmup(placement)]
    steps["warmup"], steps["warmup_again"] = runs
    target = target_for_engine(eng)
    ready = BakeReady(
        target=target,
        architecture=eng.model_config.architecture,
        steps_s={k: round(v, 6) for k, v in steps.items()},
        warmup_runs_s=[round(r, 6) for r in runs],
        warm={
            "cuda_graph_sizes": target.cuda_graph_sizes,
            "cuda_graph_captures": eng.graphs.captures if eng.graphs else 0,
            "device": str(eng.device),
            "torch": str(__import__("torch").__version__),
            "cuda": str(__import__("torch").version.cuda or ""),
            "python": sys.version.split()[0],
        },
    )
    on_step("write")
    return eng, ready


def warm_for_image(spec: BakeSpec):
    """In the process to be dumped: warm up, give back the memory of weights and KV cache (CPU:
    their pages dropped; CUDA: the VMM arena holding them released, its addresses kept, so the
    CUDA checkpoint holds none of it either), suspend the EP communicator (no NIXL agent: UCX's
    state is not CRIU's to dump, and its name is no copy's to keep; its host buffers' pages given
    back), then say so through `spec.ready`. Returns the engine."""
    import torch

    from components.engine.memory import host_pages
    from components.engine.rank import RankConfig

    eng, ready = warm(msgspec.convert(spec.config, RankConfig), spec.model_dir)
    if eng.device.type == "cuda":
        from components.engine.exchange.windows import WindowCommunicator

        if isinstance(eng.comm, WindowCommunicator):
            # Its mailbox exporter listens on an abstract socket every copy would restore.
            raise SnapshotError("the criu tier on CUDA needs the NIXL EP transport (ep_transport=nixl)")
        eng.release_memory()
        ready.warm["arena_released_bytes"] = eng.arena.nbytes
        # What the CUDA checkpoint still moves into the image, beside the driver's own state.
        ready.warm["torch_device_bytes"] = {
            "allocated": torch.cuda.memory_allocated(eng.device),
            "reserved": torch.cuda.memory_reserved(eng.device),
        }
    else:
        # Weights (a restored copy pulls them) and the KV cache (zeros, read only where written).
        ready.warm["pages_dropped_bytes"] = host_pages.drop([*eng.weight_tensors().values(), *eng.kv.k, *eng.kv.v])
    eng.comm.suspend()
    tmp = Path(spec.ready + ".tmp")
    tmp.write_bytes(msgspec.json.encode(ready))
    tmp.rename(spec.ready)
    return eng


def warmup_record(ready: BakeReady) -> bytes:
    return (
        json.dumps({"steps_s": ready.steps_s, "warmup_runs_s": ready.warmup_runs_s, **ready.warm}, indent=2) + "\n"
    ).encode()


REPO = Path(__file__).resolve().parents[1]
IMAGE_DIR = "criu"  # the CRIU image inside a criu-tier snapshot
BAKE_LOG = "bake.log"
READY_TIMEOUT_S = 900


def _start_baked(cfg, src: str, work: Path):
    """Start the process to be dumped; returns (Popen, write end of its stdin pipe, BakeReady
    once it is warm). The pipe stays open until the dump: each restored copy is given its own."""
    from snapshot.criu_image import spawn

    ready = work / "ready.json"
    spec = work / "spec.json"
    spec.write_bytes(msgspec.json.encode(BakeSpec(config=msgspec.to_builtins(cfg), model_dir=src, ready=str(ready))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    r, w = os.pipe()
    try:
        proc = spawn(
            [sys.executable, "-m", "components.worker", "--bake", str(spec)], work / BAKE_LOG, env, REPO, stdin=r
        )
    finally:
        os.close(r)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = (work / BAKE_LOG).read_text(errors="replace").strip().splitlines()[-5:]
            why = f"exited with {proc.returncode}" if proc.poll() is not None else f"not warm in {READY_TIMEOUT_S} s"
            os.close(w)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            raise SnapshotError(f"the worker to bake {why}: " + " | ".join(tail))
        time.sleep(0.05)
    return proc, w, msgspec.json.decode(ready.read_bytes(), type=BakeReady)


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
    batch_invariant: bool = DEFAULTS["batch_invariant"],
    cuda_graph_sizes: tuple[int, ...] | None = None,
    model_name: str = "",
    force: bool = False,
    progress: bool = True,
    root: str | os.PathLike | None = None,
    tier: str = "artifacts",
) -> tuple[Path, SnapshotManifest]:
    """Bake a snapshot into `out` (default: <root>/<snapshot id>, root as default_root()).
    Returns (snapshot directory, manifest). Raises CheckpointError (bad model dir), ValueError
    (bad config), SnapshotExists (`out` exists and not `force`), SnapshotError (the criu tier
    cannot be baked here, and why).

    tier "artifacts": the engine is built and warmed in this process, and its configuration and
    warmup record written. tier "criu": a worker process (part of no group: no discovery, no NIXL
    agent, no sockets; stdin a pipe, output to bake.log) builds and warms the engine, then is
    dumped by CRIU into <snapshot>/criu; the weights are allocated but never written, so the
    image holds none (their untouched pages are not dumped). On CUDA the worker's weights, expert
    slots and KV live in a VMM arena that it releases (addresses kept) before this process
    CUDA-checkpoints it (snapshot.cuda_checkpoint: its GPU state moved to host memory), then
    dumps it; the manifest's device_type and driver_version must match where it is restored. A
    joiner restored from it is told its rank and deployment through that stdin pipe
    (components.worker.RestoreIdentity)."""
    from tqdm import tqdm

    if tier not in ("artifacts", "criu"):
        raise ValueError(f"tier must be artifacts or criu, not {tier!r}")
    if device == "cuda":
        device = "cuda:0"
    from components.engine.rank import batched_tokens

    max_batched_tokens = batched_tokens(max_batched_tokens, device)
    if not 1 <= min_ranks <= max_ranks:
        raise ValueError(f"min_ranks ({min_ranks}) must be in 1..max_ranks ({max_ranks})")
    if cuda_graph_sizes and not device.startswith("cuda"):
        raise ValueError(f"cuda_graph_sizes are captured on CUDA only, not on {device}")
    if cuda_graph_sizes and max(cuda_graph_sizes) > max(max_seqs, max_batched_tokens):
        # Decodes use graphs of up to max_seqs rows, prompt chunks (a token a row) up to
        # max_batched_tokens; the engine would drop a larger size without a word.
        raise ValueError(
            f"cuda_graph_sizes: {max(cuda_graph_sizes)} exceeds both max_seqs ({max_seqs}) and "
            f"max_batched_tokens ({max_batched_tokens}), the most rows a step has"
        )
    # Fail before the expensive part.
    if out is not None:
        check_destination(out, force)
    else:
        check_creatable(root or default_root())
    src, name = model_source(model_dir, model_name)
    _check_redundant(src, min_ranks, redundant_experts)
    criu_version = ""
    if tier == "criu":
        from snapshot.criu import criu_status, find_criu
        from snapshot.criu import criu_version as read_version

        ok, why = criu_status()
        if not ok:
            raise SnapshotError(f"the criu tier cannot be baked here: {why}")
        criu_version = read_version(find_criu())[1]
        if device.startswith("cuda"):
            from snapshot import cuda_checkpoint

            ok, why = cuda_checkpoint.available()
            if not ok:
                raise SnapshotError(f"the criu tier on CUDA needs the driver's checkpoint API: {why}")
    extra: dict[str, Any] = {} if cuda_graph_sizes is None else {"cuda_graph_sizes": tuple(cuda_graph_sizes)}
    cuda_image = tier == "criu" and device.startswith("cuda")
    if cuda_image:
        # Weights, expert slots and KV in one VMM arena, released before the CUDA checkpoint:
        # the image holds none of them, and a copy remaps them at the addresses its graphs use.
        extra["vmm"] = True
    cfg = rank_config(
        device=device,
        dtype=dtype,
        max_ranks=max_ranks,
        min_ranks=min_ranks,
        max_seqs=max_seqs,
        max_len=max_len,
        max_batched_tokens=max_batched_tokens,
        redundant_experts=redundant_experts,
        batch_invariant=batch_invariant,
        **extra,
    )
    if cuda_image:
        import torch

        from components.engine.rank import ep_transport, mps_running

        if ep_transport(cfg, torch.device(device)) == "window":
            # Refused here, before the model loads: the driver's checkpoint holds no MPS client and
            # no CUDA IPC memory, and the window exchange's peer windows are that memory.
            why = "MPS is running" if mps_running() else f"max_ranks {max_ranks} fit {torch.cuda.device_count()} GPUs"
            raise SnapshotError(
                f"the criu tier on CUDA needs the NIXL EP transport, and this deployment's ranks would exchange "
                f"through peer windows ({why}): joiners start cold, or are parked"
            )

    bar = tqdm(
        total=3,
        desc="load + warmup (worker)" if tier == "criu" else "load model skeleton",
        unit="step",
        file=sys.stderr,
        disable=not progress,
        bar_format="{desc:<22} {bar} {n_fmt}/{total_fmt} [{elapsed}]",
    )

    def step(desc: str) -> None:
        bar.update(1)
        bar.set_description_str(desc)

    t0 = time.perf_counter()
    eng = proc = None
    work: Path | None = None
    stdin_w = -1
    try:
        if tier == "criu":
            parent = Path(out).absolute().parent if out is not None else Path(root or default_root()).absolute()
            parent.mkdir(parents=True, exist_ok=True)
            work = Path(tempfile.mkdtemp(prefix=".bake-", dir=parent))  # beside it: the image is moved, not copied
            proc, stdin_w, ready = _start_baked(cfg, src, work)
        else:
            eng, ready = warm(cfg, src, step)
        target = ready.target
        sid = new_snapshot_id(name, target.model_identity)
        dest = Path(out) if out is not None else Path(root or default_root()) / sid
        files = {
            ENGINE_FILE: msgspec.json.format(msgspec.json.encode(cfg), indent=2) + b"\n",
            WARMUP_FILE: warmup_record(ready),
            MODEL_CONFIG_FILE: (Path(src) / "config.json").read_bytes(),
        }
        trees = {}
        image_bytes = 0
        if tier == "criu":
            from snapshot.criu_image import dump
            from snapshot.memory_map import anonymous_by_mapping

            # What the image will hold, by mapping: a restore costs about its size (bench.criu_restore).
            ready.warm["image_memory"] = {"warm": anonymous_by_mapping(proc.pid)}
            if cuda_image:
                from snapshot import cuda_checkpoint

                step("CUDA checkpoint + criu dump")
                ready.warm["cuda_checkpoint_s"] = {
                    k: round(v, 6) for k, v in cuda_checkpoint.checkpoint(proc.pid).items()
                }
                # The driver keeps the GPU's memory in the process's: this is what it added.
                ready.warm["image_memory"]["cuda_checkpointed"] = anonymous_by_mapping(proc.pid)
            else:
                step("criu dump")
            files[WARMUP_FILE] = warmup_record(ready)
            image = dump(proc, work / IMAGE_DIR)
            image_bytes = image.image_bytes
            files[BAKE_LOG] = (work / BAKE_LOG).read_bytes()
            trees[IMAGE_DIR] = work / IMAGE_DIR
            step("checksums + write")
        manifest = SnapshotManifest(
            snapshot_id=sid,
            created=now_iso(),
            tier=tier,
            model_name=name,
            architecture=ready.architecture,
            warmup_seconds=ready.warmup_runs_s[0],
            weights_included=False,
            criu_version=criu_version,
            cuda_version=str(ready.warm.get("cuda", "")) if device.startswith("cuda") else "",
            image_bytes=image_bytes,
            bake_seconds=round(time.perf_counter() - t0, 3),
            **msgspec.structs.asdict(target),
        )
        manifest = write_snapshot(dest, manifest, files, force=force, trees=trees)
        bar.update(1)
        bar.set_description_str("done")
    finally:
        bar.close()
        if eng is not None:
            eng.stop()  # stops the loop if started, closes the communicator
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        if stdin_w >= 0:
            os.close(stdin_w)
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
    return dest.absolute(), manifest
