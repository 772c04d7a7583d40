"""One DP/EP rank: its own requests (data-parallel attention), a share of the experts, and a step
loop that moves in lockstep with the other active ranks.

Every step starts with a tiny all-to-all of (has_work, wants_pause) among the active ranks. All
ranks see the same headers, so they take the same decision: run a step (a rank with no requests of
its own runs a dummy step so that MoE collectives never hang), idle, or pause. Pausing through the
header is what lets a controller stop a whole group at one step boundary without a separate
barrier: a rank that has not yet heard the pause request stops because its peers asked.
Control work (new active set, expert placement, weight loads) runs on the loop thread while
paused, or between steps when it only touches this rank.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import queue
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import NamedTuple

import msgspec
import torch

from components.engine.exchange.communicator import EPCommunicator, EPError
from components.engine.exchange.expert_map import ExpertMap
from components.engine.memory import stack_reserve
from components.engine.models.checkpoint import Checkpoint
from components.engine.models.layers import KVCache, StepRows
from components.engine.models.moe import ExpertParallel
from components.engine.models.registry import family
from components.engine.models.transformer import build_model
from components.engine.request import GenerateRequest, RequestError, TokenOutput
from components.engine.sampler import SampleParams, sample
from components.engine.scheduler import Scheduler, Sequence
from components.protocol.placement import Placement, balanced_placement, slots_needed
from components.protocol.prompt import out_of_vocabulary
from components.protocol.transfer import expert_slot_name

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class RankConfig(msgspec.Struct, frozen=True):
    rank: int = 0
    max_ranks: int = 1
    device: str = "cpu"
    dtype: str = ""  # "" = the checkpoint's dtype
    max_seqs: int = 16
    max_len: int = 0  # 0 = the model's context length, capped by memory (context_length)
    max_batched_tokens: int = 256
    # Rows of one prompt GEMM in a mixed step (cuda_graphs.py): large enough for tensor-core rate
    # in the dense projections, small enough that a step with a few prompt tokens pads little.
    # 512 against 256: the dense projections of 32 x 1024 prompt tokens 10.4 against 15.6 ms of
    # device time, the burst 266k against 256k prompt tok/s (one H100, budget 8192).
    prompt_piece: int = 512
    min_ranks: int = 1  # fewest active ranks that must hold every expert: sizes the expert slots
    redundant_experts: int = 0
    # Outputs that do not change with the load (Scheduler's batch-invariant policy; graphs as
    # decode_graph_sizes chooses them); False: mixed steps and a graph per power of two, outputs
    # in bf16 then change with what else runs.
    batch_invariant: bool = True
    # Row counts captured as CUDA graphs; None: decode_graph_sizes's choice; (): eager.
    cuda_graph_sizes: tuple[int, ...] | None = None
    idle_wait_s: float = 0.002
    ep_timeout_s: float = 30.0
    vmm: bool = False  # CUDA: weights, expert slots and KV in one VMM arena (release_memory/restore_memory)
    # The MoE exchange: "window" through same-node peer windows (exchange/windows) as device work;
    # "nixl" host-driven over NIXL; "auto" windows on CUDA where no two ranks share a GPU or MPS
    # runs (ranks time-sliced on one GPU without MPS make a device-side wait spin through whole
    # time slices: 4.6 ms a layer for two ranks on an H200, against 84 us across two GPUs).
    ep_transport: str = "auto"


# The share of the memory free at start a default-sized KV cache may take. Ranks can share a GPU,
# and weights pulled later land in the same memory, so it stays well below what vLLM takes alone.
KV_MEMORY_FRACTION = 0.25


def context_length(requested: int, mc, max_seqs: int, dtype: torch.dtype, device: torch.device) -> int:
    """The longest sequence a rank serves: `requested`, or (0) the model's own context length, as
    vLLM defaults it, capped so that the KV cache of `max_seqs` sequences fits in memory."""
    positions = mc.max_position_embeddings
    if requested:
        if requested > positions:
            raise ValueError(f"max_len {requested} exceeds the model's {positions} positions")
        return requested
    per_token = (max_seqs + 1) * family(mc).kv_layout(mc).bytes_per_token(mc.num_layers, dtype.itemsize)
    fit = int(_free_memory(device) * KV_MEMORY_FRACTION) // per_token
    if fit >= positions:
        return positions
    length = fit // 256 * 256
    if length < 256:
        raise ValueError(
            f"the KV cache of {max_seqs} sequences does not fit in {device.type} memory even at "
            f"256 tokens each: lower Worker.max_seqs or set Worker.max_len"
        )
    log.warning(
        "max_len %d instead of the model's %d positions: a KV cache of %d sequences that long needs "
        "%.1f GB (set Worker.max_len or lower Worker.max_seqs to choose)",
        length,
        positions,
        max_seqs,
        per_token * positions / 1e9,
    )
    return length


def batched_tokens(given: int, device: str) -> int:
    """Worker.max_batched_tokens as a rank runs it: 0 takes the device's default, 8192 on CUDA (32
    prompts of 1024 at once, one H100, 5.4 GiB Mixtral-shaped: 237k prompt tok/s at 2048, 253k
    at 4096, 256k at 8192 in process, bench/results/burst_h100_budgets.json; fewer steps, and the
    experts' GEMMs run larger), 256 on the CPU (where a step's time, and so every decode's, grows
    with its tokens)."""
    return given or (8192 if device.startswith("cuda") else 256)


def prompt_piece(cfg: RankConfig) -> int:
    return min(cfg.prompt_piece, cfg.max_batched_tokens)


def decode_graph_sizes(cfg: RankConfig) -> list[int]:
    """The row counts a CUDA rank captures graphs for. Batch-invariant: max_seqs for every
    decode-only step, so a decode is the same graph under any load (padding rows are dispatched to
    no expert and attend over one key block), and for steps with prompt tokens max_seqs plus one,
    two, ... pieces of prompt rows up to the budget (cuda_graphs.py: decodes, then prompt tokens
    one a row, the step in the smallest that holds them). Otherwise powers of two up to max_seqs,
    and max_seqs itself, so no decode batch falls back to eager kernels."""
    top = cfg.max_seqs
    if cfg.cuda_graph_sizes is not None:
        return sorted(b for b in cfg.cuda_graph_sizes if b <= step_rows(cfg))
    if cfg.batch_invariant:
        return [top, *range(top + prompt_piece(cfg), step_rows(cfg) + 1, prompt_piece(cfg))]
    return sorted({*(1 << i for i in range(top.bit_length()) if 1 << i < top), top})


def step_rows(cfg: RankConfig) -> int:
    """The most rows one step computes: the budget, and under batch invariance every decode
    beside it (Scheduler), its prompt rows a whole number of pieces on CUDA."""
    if not cfg.batch_invariant:
        return cfg.max_batched_tokens
    piece = prompt_piece(cfg)
    return cfg.max_seqs + -(-cfg.max_batched_tokens // piece) * piece


def _free_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        info = dict(line.split(":", 1) for line in f)
    return int(info["MemAvailable"].split()[0]) * 1024


def cuda_unusable(device: str) -> str:
    """Why this process cannot run on `device` ("cuda" or "cuda:N"); "" when it can."""
    n = torch.cuda.device_count()
    if torch.version.cuda is None:
        return f"this torch ({torch.__version__}) is built without CUDA"
    if n == 0:
        return f"no CUDA device is visible (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})"
    if device != "cuda" and int(device.split(":")[1]) >= n:
        return f"{n} CUDA device{'s' if n > 1 else ''} visible"
    return ""


def rank_device(device: str, rank: int) -> str:
    """Where rank `rank` runs: "cuda" spreads ranks over the visible GPUs (rank r on GPU r % n).
    A CUDA device this process cannot use is a ValueError that says why, so the rank cannot start
    with that reason rather than fail inside torch's first CUDA call."""
    if not device.startswith("cuda"):
        return device
    if why := cuda_unusable(device):
        raise ValueError(f"device {device}: {why}; --Worker.device=cpu runs on the CPU")
    return f"cuda:{rank % torch.cuda.device_count()}" if device == "cuda" else device


def nixl_comm(rank: int, max_ranks: int, capacity_bytes: int, timeout_s: float = 30.0):
    """The EP communicator, its buffers in host memory on every device. The collective is
    host-driven either way; in device memory, peers' UCX maps the buffers over CUDA IPC and keeps
    the mappings after a disconnect, and a CUDA checkpoint of a parked rank whose memory a peer
    still maps cannot be restored (cuCheckpointProcessRestore: CUDA_ERROR_INVALID_VALUE)."""
    from components.engine.exchange.nixl import NixlCommunicator

    return NixlCommunicator(rank, max_ranks, capacity_bytes, device="cpu", timeout_s=timeout_s)


def mps_running() -> bool:
    """Whether an MPS control daemon serves this process's CUDA clients (its pipe directory holds
    the control socket): processes sharing a GPU then run their kernels side by side."""
    pipes = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
    return os.path.exists(os.path.join(pipes, "control"))


def ep_transport(cfg: RankConfig, device: torch.device) -> str:
    """The MoE exchange a rank of `cfg` runs on `device`: "window" (same-node peer windows) on CUDA
    with `ep_transport` "window", or "auto" where no two of `max_ranks` ranks share a GPU or MPS
    runs them side by side; else "nixl". (Under MPS a CUDA checkpoint is refused, so parked ranks
    stay resident there.)"""
    if device.type != "cuda":
        return "nixl"
    side_by_side = cfg.max_ranks <= torch.cuda.device_count() or mps_running()
    return "window" if cfg.ep_transport == "window" or (cfg.ep_transport == "auto" and side_by_side) else "nixl"


def ep_communicator(cfg: RankConfig, device: torch.device, mc, dtype: torch.dtype, capacity_bytes: int):
    """NIXL for the host-side collectives; with the "window" transport (`ep_transport`), the MoE
    exchange through same-node peer windows too."""
    host = nixl_comm(cfg.rank, cfg.max_ranks, capacity_bytes, cfg.ep_timeout_s)
    if ep_transport(cfg, device) != "window":
        if device.type == "cuda" and cfg.ep_transport == "auto":
            log.warning(
                "rank %d: the MoE exchange is host-driven NIXL (max_ranks %d on %d GPUs, no MPS daemon): steps "
                "are slower even at one rank; start MPS (nvidia-cuda-mps-control -d) for the exchange inside "
                "the decode graph, or set Worker.ep_transport=nixl to say this is meant",
                cfg.rank,
                cfg.max_ranks,
                torch.cuda.device_count(),
            )
        return host
    from components.engine.exchange.windows import PeerWindows, WindowCommunicator
    from components.engine.weights.same_node import node_id

    rows = max(step_rows(cfg), cfg.max_seqs) * mc.top_k  # the most one step sends one peer
    windows = PeerWindows(cfg.rank, cfg.max_ranks, rows, mc.hidden_size, dtype, device, node_id(), cfg.ep_timeout_s)
    return WindowCommunicator(host, windows)


class Launched(NamedTuple):
    """A step queued on the device whose draws the host has not read yet."""

    work: list[tuple[Sequence, int]]
    positions: list[int]  # Scheduler.advance's: where each row's draw goes in its sequence
    ids: torch.Tensor | None  # the draws on the device, a row each (a dummy step: None)
    host: torch.Tensor  # their copy on the host, then the EP's two counters (ExpertParallel.counters)
    done: torch.cuda.Event | None  # recorded after the copies (CUDA)


class EngineRank:
    def __init__(self, cfg: RankConfig, model_dir: str, comm: EPCommunicator | None = None, load_weights: bool = True):
        self.cfg = cfg
        self.ckpt = Checkpoint.open(model_dir)
        mc = self.model_config = self.ckpt.config
        self.dtype = DTYPES[cfg.dtype or mc.dtype]
        self.device = torch.device(cfg.device)
        if self.device.type == "cuda":
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            # Graph capture and replay, streams and syncs without a device argument use the
            # thread's current device; the loop thread sets it too.
            torch.cuda.set_device(self.device)
        self.max_len = context_length(cfg.max_len, mc, cfg.max_seqs, self.dtype, self.device)
        self.slots_per_rank = min(mc.num_experts, slots_needed(mc.num_experts, cfg.min_ranks, cfg.redundant_experts))
        # The largest message of a step: every token's top-k rows to one peer (row + int32 slot).
        row = mc.hidden_size * self.dtype.itemsize + 4
        capacity = max(64, max(step_rows(cfg), cfg.max_seqs) * mc.top_k * row)
        self.comm = comm or ep_communicator(cfg, self.device, mc, self.dtype, capacity)
        self.expert_map = ExpertMap(mc.num_moe_layers, mc.num_experts, cfg.max_ranks, self.slots_per_rank, self.device)
        self.model = build_model(mc, ExpertParallel(self.comm, self.expert_map), self.max_len, self.dtype, self.device)
        if load_weights:  # a joiner leaves them empty and pulls them from peers instead
            self.model.load_dense(self.ckpt)
        # One slot beyond max_seqs: the scratch slot padded graph rows write into.
        self.kv = KVCache(
            mc.num_layers, cfg.max_seqs + 1, self.max_len, family(mc).kv_layout(mc), self.dtype, self.device
        )
        self.arena = None  # VmmArena holding params, expert slots and KV when cfg.vmm on CUDA
        self._stack_per_thread: int | None = None  # stack_reserve's limit while memory is released
        if cfg.vmm and self.device.type == "cuda":
            from components.engine.memory.vmm import place_engine_memory

            self.arena = place_engine_memory(self.model, self.kv, self.device)  # before graph capture
        self.graphs = None
        sizes = decode_graph_sizes(cfg)
        if self.device.type == "cuda" and sizes:
            from components.engine.cuda_graphs import DecodeGraphs

            split = cfg.max_seqs if cfg.batch_invariant and sizes[-1] > cfg.max_seqs else 0
            # Prompt rows in pieces where every mixed graph is a whole number of them (sizes of
            # one's own choosing may not be: then the largest takes every mixed step, as one piece).
            piece = prompt_piece(cfg)
            piece = piece if split and all((b - split) % piece == 0 for b in sizes if b > split) else 0
            self.graphs = DecodeGraphs(self.model, self.kv, sizes, scratch_slot=cfg.max_seqs, split=split, piece=piece)
        if self.device.type == "cuda":
            # A weight pull's kernels, loaded now rather than in a joiner's first pull (and so
            # held by a snapshot's image).
            from components.engine.weights.checksum import warm_kernels

            warm_kernels(self.device)
        self.sched = Scheduler(
            cfg.max_seqs, self.max_len, cfg.max_batched_tokens, mc.eos_token_ids, invariant=cfg.batch_invariant
        )
        self.epoch = 0
        self.placement: Placement | None = None  # the one configured with `epoch`
        self.steps = 0  # forward steps taken (dummy steps included)
        self.requests_total = 0  # requests accepted by this rank
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._pause_wanted = False
        self._paused = False
        self._pause_waiters: list[Future] = []
        self._peers_busy = False
        self.ep_failed_peers: list[int] = []  # peers a collective failed on since the last configure
        self._expert_rows = 0  # the device counter as of the last step
        self._launched: Launched | None = None  # the step in flight
        # Outputs of the step read back last, held until the next step is queued (_release).
        self._held: list[tuple[Callable[[TokenOutput], None], TokenOutput]] = []
        # Where the draws of the step in flight, and of the one queued behind it, come back.
        pinned = self.device.type == "cuda"
        self._host = [torch.zeros(cfg.max_seqs + 2, dtype=torch.int64, pin_memory=pinned) for _ in range(2)]
        self._done = [torch.cuda.Event() for _ in range(2)] if pinned else []
        self._turn = 0
        # Called with what broke the step loop (a bug, not a peer); None: the loop thread raises.
        self.on_fatal: Callable[[BaseException], None] | None = None
        # Called on the loop thread after a release emitted anything: a sink that batches what it
        # is given (the worker's link to its streaming process) sends the batch then.
        self.on_released: Callable[[], None] | None = None
        self._stop = False
        self._thread: threading.Thread | None = None

    # ---- setup -------------------------------------------------------------------------------
    def assume_rank(self, rank: int, agent_name: str) -> None:
        """Become rank `rank` before the step loop starts, the communicator suspended (a rank
        restored from a snapshot image, built as rank 0): nothing else depends on the rank until
        weights and experts are placed."""
        if self._thread is not None:
            raise RuntimeError("assume_rank before start()")
        self.comm.assume_rank(rank, agent_name)
        self.cfg = msgspec.structs.replace(self.cfg, rank=rank)

    def load_experts(self, placement: Placement, since: Placement | None = None) -> None:
        """Fill this rank's slots from the checkpoint as `placement` says (a cold start); with
        `since`, only those that changed (experts whose every replica was on a failed rank)."""
        self.model.load_experts(self.ckpt, placement, self.cfg.rank, since)

    def configure(self, epoch: int, active, placement: Placement) -> None:
        """New active set and expert map, in place; run on the loop thread while the group is
        paused. Slot contents are not touched: they were loaded or pulled before the commit."""
        self.comm.set_active(active, epoch)
        self.expert_map.install(placement)
        self.epoch, self.placement = epoch, placement
        self.ep_failed_peers = []

    def warmup(self, placement: Placement, recapture: bool = False) -> float:
        """Run this rank alone (remote peers masked) through a prefill and every decode batch
        size under `placement`, so kernels, allocator and graphs are ready before the commit.
        Returns the seconds it took."""
        t0 = time.perf_counter()
        ep = self.model.ep
        if recapture and self.graphs is not None:
            self.graphs.recapture()
        self.comm.mask_remote()
        self.expert_map.install(placement)
        ep.set_masked_warmup(True)
        try:
            scratch = self.cfg.max_seqs
            sizes = self.graphs.sizes if self.graphs else [1, min(8, self.cfg.max_seqs)]
            for b, n in [(1, min(16, self.cfg.max_batched_tokens))] + [(b, 1) for b in sizes]:
                rows = StepRows(
                    ids=[1] * (b * n),
                    positions=list(range(n)) * b,
                    token_slots=[scratch] * (b * n),
                    slots=[scratch] * b,
                    ctx_lens=[n] * b,
                    last_index=list(range(n - 1, b * n, n)),
                    q_lens=[n] * b,
                )
                if self.graphs is not None and self.graphs.fits(rows):
                    self.graphs.run(rows)
                else:
                    self.model(rows.on(self.device), self.kv)
            for _, moe in self.model.moe_layers:
                moe.load.zero_()
        finally:
            ep.set_masked_warmup(False)
        return time.perf_counter() - t0

    def release_memory(self) -> None:
        """Free the physical memory of weights, expert slots and KV (addresses kept), the
        context's stack reserve (stack_reserve.py), cuBLAS's workspaces and torch's free cached
        blocks: a CUDA checkpoint (parked rank, snapshot image) saves whatever device memory is
        left. Call only while this rank is not stepping (paused or not started); the caller pauses."""
        if self.arena is None:
            raise RuntimeError("release_memory needs RankConfig(vmm=True) on a CUDA device")
        torch.cuda.synchronize(self.device)
        self.arena.release()
        if self._stack_per_thread is None:  # released twice: keep the limit from before the first
            self._stack_per_thread = stack_reserve.lower(self.device)
        # cuBLAS keeps a 32 MiB workspace for each stream it ran on (64 MiB here: the default and
        # the warm-up stream); the next matmul on a stream allocates it again. The capture
        # stream's, which the graphs' kernels were captured with, is freed into the graphs' own
        # pool, which stays reserved while they live and serves only captures into it (none after
        # DecodeGraphs is built; recapture starts a new pool).
        torch._C._cuda_clearCublasWorkspaces()
        torch.cuda.empty_cache()

    def restore_memory(self) -> None:
        """Map fresh memory at the same addresses, set the stack reserve back (stack_reserve.py)
        and zero the KV cache; the caller refills the weights (from peers, or model.load_dense +
        load_experts) before the next step."""
        if self.arena is None:
            raise RuntimeError("restore_memory needs RankConfig(vmm=True) on a CUDA device")
        self.arena.remap()
        if self._stack_per_thread is not None:
            stack_reserve.restore(self.device, self._stack_per_thread)
            self._stack_per_thread = None
        for t in self.kv.k + self.kv.v:
            t.zero_()

    def weight_tensors(self) -> dict[str, torch.Tensor]:
        """Everything a peer may pull from this rank: the parameters, and each expert slot by name
        (a slot's logical expert changes with the map; its name does not)."""
        tensors = dict(self.model.named_parameters())
        for row, moe in self.model.moe_layers:  # named by placement row, as the router plans pulls
            for slot in range(self.slots_per_rank):
                for part, buf in (("gate", moe.w_gate), ("up", moe.w_up), ("down", moe.w_down)):
                    tensors[expert_slot_name(row, slot, part)] = buf[slot]
        return tensors

    @property
    def expert_rows(self) -> int:
        return self._expert_rows

    def default_placement(self, active) -> Placement:
        mc = self.model_config
        return balanced_placement(mc.num_moe_layers, mc.num_experts, self.cfg.max_ranks, self.slots_per_rank, active)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name=f"rank{self.cfg.rank}", daemon=True)
        self._thread.start()

    def stop(self, grace_s: float = 2.0) -> None:
        """Stop the step loop and close the communicator. A loop stuck in a collective whose peer
        is already gone is left to die with the process: closing under it would block until the
        EP timeout."""
        if self._thread and self._thread.is_alive():
            try:  # when the whole group stops together, this lets it agree on a last step boundary
                self.pause().result(timeout=grace_s)
            except TimeoutError:
                pass
        self._stop = True
        self._wake.set()
        if self._thread:
            self._thread.join(timeout=grace_s)
            if self._thread.is_alive():
                log.warning(
                    "rank %d: step loop still in a collective at shutdown (a peer is gone); "
                    "leaving it to the process exit",
                    self.cfg.rank,
                )
                return
        self.comm.close()

    # ---- requests (any thread) -----------------------------------------------------------------
    def validate(self, req: GenerateRequest) -> None:
        n, L, V = len(req.prompt), self.max_len, self.model_config.vocab_size
        if n == 0:
            raise RequestError("the prompt is empty")
        if req.max_tokens < 1:
            raise RequestError(f"max_tokens must be at least 1, got {req.max_tokens}")
        if n + req.max_tokens > L:
            raise RequestError(
                f"this model's context is {L} tokens; the prompt has {n} and max_tokens is "
                f"{req.max_tokens} ({n + req.max_tokens} in all)"
            )
        bad = out_of_vocabulary(req.prompt, V)
        if bad:
            raise RequestError(f"prompt {bad}")
        if not 0 <= req.replay < n:
            raise RequestError(f"replay must leave at least one prompt token: 0 <= replay < {n}, got {req.replay}")
        if req.temperature < 0 or not 0 < req.top_p <= 1:
            raise RequestError(f"temperature must be >= 0 and top_p in (0, 1]; got {req.temperature}, {req.top_p}")
        if req.top_k < 0:
            raise RequestError(f"top_k must be >= 0 (0: no top-k cut); got {req.top_k}")

    def submit(self, req: GenerateRequest, emit: Callable[[TokenOutput], None]) -> None:
        """Queue a request; `emit` is called on the loop thread with each new token and the end."""
        self.validate(req)
        seed = req.seed if req.seed is not None else secrets.randbits(63)
        seq = Sequence(
            req=req, emit=functools.partial(self._hold, emit), tokens=list(req.prompt), seed=seed % (1 << 63)
        )
        self.requests_total += 1
        self._post(lambda: self.sched.add(seq))

    def cancel(self, request_id: str) -> None:
        self._post(lambda: self.sched.cancel(request_id))

    # ---- control (any thread) ------------------------------------------------------------------
    def call(self, fn: Callable[[], object]) -> Future:
        """Run `fn` on the loop thread between steps (or while paused); returns its result."""
        fut: Future = Future()

        def run():
            try:
                fut.set_result(fn())
            except BaseException as e:  # surfaced to the caller, the loop goes on
                fut.set_exception(e)

        self._post(run)
        return fut

    def pause(self) -> Future:
        """Resolves once the whole active group stands at one step boundary."""
        fut: Future = Future()

        def ask():
            if self._paused:
                fut.set_result(self.steps)
            else:
                self._pause_wanted = True
                self._pause_waiters.append(fut)

        self._post(ask)
        return fut

    def resume(self) -> Future:
        def go():
            self._paused = False

        return self.call(go)

    @property
    def paused(self) -> bool:
        return self._paused

    # ---- loop ----------------------------------------------------------------------------------
    def _post(self, fn: Callable[[], None]) -> None:
        self._inbox.put(fn)
        self._wake.set()

    def _drain(self) -> None:
        while True:
            try:
                fn = self._inbox.get_nowait()
            except queue.Empty:
                return
            fn()

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        while not self._stop:
            self._drain()
            if self._launched is None:  # what the drain emitted (a cancel): no step to queue first
                self._release()
            if not self._paused and self._pause_wanted and self.cfg.rank not in self.comm.active:
                self._enter_pause()  # not in any collective: nobody else to agree with
            if self._paused or self.cfg.rank not in self.comm.active:
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            has_work = self.sched.has_work()
            if not has_work and not self._peers_busy and not self._pause_wanted and self._launched is None:
                # Nobody had work last time: wait a little for ours before asking again; a rank
                # alone in the group has nobody to ask, and waits until something is posted.
                alone = len(self.comm.active) == 1
                if self._wake.wait(None if alone else self.cfg.idle_wait_s):
                    self._wake.clear()
                    self._drain()
                has_work = self.sched.has_work()
            try:
                self._step(has_work)
            except EPError as e:
                # The step did not complete: its sequences did not advance, and it runs again once
                # the router installed a topology without the failed peers (a new epoch). A step
                # still in flight (a later collective failed: the header's, or a host-driven
                # exchange of the step behind it) completes first, or is retracted if its own
                # exchange gave up too: nothing stays queued through the pause.
                failed = set(e.peers)
                try:
                    self._complete()
                except EPError as also:
                    failed.update(also.peers)
                log.error("rank %d: EP collective failed, pausing until the router acts: %s", self.cfg.rank, e)
                self.ep_failed_peers = sorted({*self.ep_failed_peers, *failed})
                self._enter_pause()
            except Exception as e:
                if self.on_fatal is None:
                    raise
                self.on_fatal(e)  # a rank whose step loop is gone must not look alive
            if self._launched is None:  # no step in flight, so none to queue before them
                self._release()

    def _enter_pause(self) -> None:
        self._pause_wanted, self._paused, self._peers_busy = False, True, False
        waiters, self._pause_waiters = self._pause_waiters, []
        for fut in waiters:
            fut.set_result(self.steps)

    def _settle(self, step: Launched) -> None:
        """Wait for `step`'s device work, then raise if a device exchange gave up (EPError) or a
        pair was routed outside the active set, before anything of the step is used. The wait
        blocks with the GIL released (Event.synchronize): a wait kernel may spin for a slow peer
        for seconds, and the worker's status and Pause(gone) handlers must answer meanwhile,
        without this thread taking the GIL back to poll every few microseconds."""
        self._wait(step)
        ep = self.model.ep
        rows_computed, misrouted = step.host[-2:].tolist()
        if ep.windows is not None:
            ep.windows.check()
            ep.check_routes(misrouted)
        self._expert_rows = rows_computed

    def _step(self, has_work: bool) -> None:
        """One step of the group. A step is queued before the one before it is read back: the
        host's work for a step (schedule, inputs, launch, reading ids, emitting tokens) runs while
        the device computes the previous one, and rows needing a token still being drawn read it
        on the device. Whatever stops stepping (a pause, nobody busy) completes it first."""
        if len(self.comm.active) == 1:
            # Nobody to agree with: the header is this rank's own, without the collective's dozen
            # small tensor ops, each of which releases the GIL and may wait to get it back.
            wants_pause, self._peers_busy = self._pause_wanted, has_work
        else:
            header = torch.tensor([int(has_work), int(self._pause_wanted)], dtype=torch.int64)
            raw = header.view(torch.uint8)
            heads = self.comm.all_to_all({r: raw for r in self.comm.active})
            flags = torch.stack([h.view(torch.int64) for h in heads.values()])
            wants_pause, self._peers_busy = bool(flags[:, 1].any()), bool(flags[:, 0].any())
        if wants_pause:
            self._complete()
            self._enter_pause()
            return
        if not self._peers_busy:
            self._complete()
            return
        self.steps += 1
        work = self.sched.schedule()
        if not work and self._launched is not None:  # what follows may depend on how it ends
            self._complete()
            work = self.sched.schedule()
        step = self._launch(work)  # a host-driven exchange's EPError: the loop completes the step before
        try:
            self._complete()
        except EPError:
            self._abandon(step)
            raise
        self._launched = step
        if step.done is None:  # computed as it was queued (CPU): its tokens go out now, not a step later
            self._complete()

    def _launch(self, work: list[tuple[Sequence, int]]) -> Launched:
        """Queue the step of `work` (none: a dummy step, taking part in the collectives) and the
        copy of its draws to the host; the scheduler counts its tokens as computed."""
        drawn = self._launched.ids if self._launched is not None else None
        if not work:
            self.model.dummy_step()
            ids = None
        else:
            # A batch-invariant step with prompt pieces runs in the mixed graph, its prompt
            # tokens one a row behind the decodes (cuda_graphs.py).
            decodes = self.sched.decode_rows(work) if self.cfg.batch_invariant else len(work)
            mixed = self.graphs is not None and decodes < len(work)
            step = self.sched.rows(work, per_token=mixed)
            params = self._sample_params(work)
            if mixed and self.graphs.fits(step, decodes):
                ids = self._run_mixed(work, step, decodes, params, drawn)
            elif not mixed and self.graphs is not None and self.graphs.fits(step):
                logits, greedy = self.graphs.run(step, drawn), self.graphs.greedy[: len(step.ids)]
                ids = greedy if params is None else self.graphs.sample(params)
            else:
                if mixed:  # graphs too small for the step: the chunked layout, eagerly
                    step = self.sched.rows(work)
                sampling = params.on(self.device) if params is not None else None  # copied in before the forward
                logits = self.model(step.on(self.device, drawn), self.kv)
                ids = torch.argmax(logits, dim=-1) if params is None else sample(logits, *sampling)
        self._turn ^= 1
        host = self._host[self._turn]
        if ids is not None:
            host[: len(ids)].copy_(ids, non_blocking=True)
        host[-2:].copy_(self.model.ep.counters, non_blocking=True)
        done = None
        if self.device.type == "cuda":
            done = self._done[self._turn]
            done.record()
        return Launched(work, self.sched.advance(work), ids, host, done)

    def _run_mixed(self, work, step: StepRows, decodes: int, params: SampleParams | None, drawn) -> torch.Tensor:
        """Queue `work` (its first `decodes` entries decodes) in the mixed graph; returns each
        entry's draw on the device. Decode rows draw as in a decode-only step (the sampling graph
        of max_seqs rows), each prompt piece at its last token, a row alone: no draw depends on
        what shares the step."""
        graphs = self.graphs
        heads = [decodes + e - 1 for e in itertools.accumulate(n for _, n in work[decodes:])]
        logits = graphs.run(step, drawn, decodes, heads)
        last = [graphs.logits_row(i, decodes) for i in heads]
        if params is None:
            at = torch.tensor([*range(decodes), *last], dtype=torch.int64).to(self.device, non_blocking=True)
            return graphs.greedy.index_select(0, at)
        parts = [graphs.sample(SampleParams(*(f[:decodes] for f in params)))] if decodes else []
        for j, r in enumerate(last, start=decodes):
            parts.append(sample(logits[r : r + 1], *SampleParams(*(f[j : j + 1] for f in params)).on(self.device)))
        return torch.cat(parts)

    def _complete(self) -> None:
        """Wait for the step in flight, then give its sequences their tokens; if its exchange
        gave up, its sequences do not advance (EPError, for the loop). The outputs held from the
        step before go out first: whatever this thread queued next is on the device by now."""
        self._release()
        step, self._launched = self._launched, None
        if step is None:
            return
        try:
            self._settle(step)
        except EPError:
            self.sched.retract(step.work, step.positions)
            raise
        self.sched.update(step.work, step.positions, step.host[: len(step.work)].tolist())

    def _abandon(self, step: Launched) -> None:
        """Drop a step queued behind one whose exchange gave up: its device waits are aborted
        (the next epoch's reset clears that), and its sequences do not advance."""
        if self.model.ep.windows is not None:  # its waits for the failed peers would time out again
            self.model.ep.windows.declare_gone()
        self._wait(step)
        self.sched.retract(step.work, step.positions)

    @staticmethod
    def _wait(step: Launched) -> None:
        if step.done is not None:
            step.done.synchronize()

    def _hold(self, emit: Callable[[TokenOutput], None], out: TokenOutput) -> None:
        self._held.append((emit, out))

    def _release(self) -> None:
        """Emit the outputs held since the last step was read back: held until the next step is
        queued, or until this thread waits for the device with none queued, handing them to the
        streams does not delay the launch. (Measured when the streams were served in this process,
        against neither this nor _wait's blocking sync, alternating runs on one H100, 32 clients,
        512-token prompts, 64 out: 9.8k -> 10.0k output tok/s, TTFT p50 52 -> 46 ms.)"""
        held, self._held = self._held, []
        for emit, out in held:
            emit(out)
        if held and self.on_released is not None:
            self.on_released()

    def _sample_params(self, work: list[tuple[Sequence, int]]) -> SampleParams | None:
        """The batch's sampling parameters, for one batched draw after the forward (rows of a
        prefill chunk that is not the last are drawn and ignored); None: all greedy."""
        reqs = [seq.req for seq, _ in work]
        if all(r.temperature <= 0 for r in reqs):
            return None
        return SampleParams(
            temperature=[r.temperature for r in reqs],
            top_p=[r.top_p for r in reqs],
            top_k=[r.top_k for r in reqs],
            seed=[seq.seed for seq, _ in work],
            position=[seq.num_computed + n for seq, n in work],
        )
