"""The components' configurations, torch-free: `dynamo serve` resolves them, each process decodes
its own, and the router, capacity providers and planner decode the others' with the same types."""

from __future__ import annotations

import re

import msgspec

ROUTER_MODES = ("round-robin", "random")


EP_TRANSPORTS = ("auto", "window", "nixl")
# Where ranks run: "cuda" spreads them over the visible GPUs, "cuda:N" puts them all on GPU N.
DEVICES = r"cpu|cuda(:\d+)?"


class WorkerConfig(msgspec.Struct, forbid_unknown_fields=True):
    model: str = ""  # a Hugging Face checkpoint directory; "" = the built-in model
    served_model_name: str = ""  # "" = the built-in model's name, or the directory's name
    device: str = "cpu"  # "cpu" or "cuda" (rank r takes GPU r % visible GPUs)
    dtype: str = ""  # "" = the checkpoint's
    dp_size: int = 2  # ranks at start
    max_ranks: int = 4  # the most ranks the deployment can grow to (sizes EP buffers)
    min_ranks: int = 1  # the fewest ranks it can shrink to (sizes the expert slots)
    # Expert slots beyond one copy of every expert over min_ranks ranks: replicas, so that a failed
    # rank's experts still serve on the survivors that hold a copy (nothing read from disk). The
    # slots per rank are capped at the model's expert count.
    redundant_experts: int = 0
    max_seqs: int = 16
    max_len: int = 0  # longest sequence; 0 = the model's context length, capped by memory
    # Prompt tokens a step computes beside its decodes; 0 = the device's default (8192 on CUDA,
    # as vLLM's server takes on GPUs of this size; 256 on the CPU: engine.rank.batched_tokens).
    # Decode-only steps do not see it (their own graph); a step carrying that many prompt tokens
    # holds its decodes for its length (some 30 ms on an H100, 5.4 GiB Mixtral-shaped, bf16).
    max_batched_tokens: int = 0
    # Greedy outputs (and seeded samples) that do not change with the load, bit for bit: a step
    # takes every decode and whole pieces of prompts cut where the prompt alone says, and a row's
    # arithmetic does not depend on the step's other rows (components/engine/scheduler.py).
    # False: vLLM's mixed steps and a graph per batch size, whose kernels follow the batch, so
    # bf16 completions change with what else runs.
    batch_invariant: bool = True
    # Baked snapshots (`snapshot-bake bake`, the criu tier) new joiners are restored from; "" =
    # none. One that does not match this deployment, fails its checksums or fails to restore is
    # refused (the reason logged and in the operation's record) and the joiner cold-starts.
    snapshot_root: str = ""
    # CUDA: weights and KV cache in a CUDA VMM arena, released while a rank is parked (its
    # checkpoint then holds no weights) and mapped again at the same addresses on restore.
    # Same-node peers map the arena to pull from it (VMM file descriptors, not CUDA IPC).
    vmm: bool = False
    # How the MoE exchange travels. "window": through same-node peers' memory as device work
    # inside the decode graph (CUDA, every rank on one node); "nixl": the host-driven NIXL
    # all-to-all (CPU, ranks on several nodes); "auto": "window" on CUDA when no two of
    # max_ranks ranks share a GPU or an MPS daemon runs (ranks time-sliced on one GPU without
    # MPS wait through whole time slices), else "nixl".
    ep_transport: str = "auto"

    # The network devices the ranks' NIXL agents may use (UCX_NET_DEVICES), which are also the
    # interfaces their UCX listeners bind: "lo" keeps the data plane on this host, unreachable
    # from others. A deployment across hosts names its NICs ("mlx5_0:1,eth0") or "all"; CUDA and
    # shared-memory transports on one host are not network devices and work either way.
    net_devices: str = "lo"

    def __post_init__(self) -> None:
        if not re.fullmatch(DEVICES, self.device):
            raise ValueError(f'device must be "cpu", "cuda" or "cuda:N" (got {self.device!r})')
        if self.ep_transport not in EP_TRANSPORTS:
            raise ValueError(f"ep_transport must be one of {', '.join(EP_TRANSPORTS)}")
        if not re.fullmatch(r"[A-Za-z0-9_.:\-]+(,[A-Za-z0-9_.:\-]+)*", self.net_devices):
            raise ValueError('net_devices must be "all" or a comma-separated list of devices, e.g. "lo" or "mlx5_0:1"')


class RouterConfig(msgspec.Struct, forbid_unknown_fields=True):
    host: str = "127.0.0.1"
    port: int = 8001
    token: str = ""  # bearer token for the control API; required when host is not loopback
    bootstrap_timeout_s: float = 300.0
    status_interval_s: float = 1.0  # how often the router asks every rank for its status
    # A serving rank that has not answered for this long, whose process died, or whose EP peers
    # report it gone is failed over: fenced, masked out, its experts reloaded on the survivors,
    # and a replacement requested.
    rank_timeout_s: float = 3.0
    prepare_timeout_s: float = 120.0  # a joiner that takes longer to start, load or warm up aborts the op
    commit_timeout_s: float = 10.0  # a rank that misses it rolls the commit back
    # A scale-up whose joiner dies before the commit starts a new one for that rank, up to this
    # many times, before it aborts (each retry in the operation's record, `joiner_retries`).
    joiner_retries: int = 2
    # A joiner that has not answered its status for this long (and never less than rank_timeout_s)
    # before the commit is stalled: it is stopped and replaced as a dead one is. Longer than
    # rank_timeout_s: a joiner loads and compiles, and a false alarm costs a whole new joiner.
    joiner_timeout_s: float = 10.0
    # A failover or rebuild that fails is tried again after a pause that doubles each time, from
    # status_interval_s up to this: a deployment that cannot come back does not spin.
    retry_backoff_max_s: float = 30.0
    drain_timeout_s: float = 30.0  # leaving ranks' requests still running after this are handed over
    rebalance: bool = True  # async EPLB after each scale operation
    park_leaving: bool = True  # keep leaving ranks' processes parked for the next scale-up
    # CUDA: also checkpoint a parked rank's GPU state with the driver API, so it holds no GPU
    # memory. Needs Worker.vmm (the weights are released first, never exported for CUDA IPC).
    # A failed restore falls back to a cold start.
    checkpoint_parked: bool = False
    # Copies of the chosen snapshot (Worker.snapshot_root) restored ahead of any scale-up, each
    # waiting with no rank (on CUDA its state still checkpointed: host memory, no GPU memory) to
    # be the next joiner: a scale-up then skips the CRIU restore. Each holds about its image's
    # size in host memory.
    standby_copies: int = 0
    # Where joining ranks come from: "local" processes on this host, or "kubernetes" pods of the
    # worker StatefulSet ($ELASTIC_EP_CAPACITY overrides, as the manifests in deploy/ do).
    capacity: str = "local"
    allow_fault_injection: bool = False  # lets POST /scale inject faults into joiners (tests only)
    # A router whose /health has not answered for this long is hung (stopped, its event loop
    # blocked): `dynamo serve` kills it and starts another, which adopts what the ranks serve.
    liveness_timeout_s: float = 5.0
    # One whose /health has not answered this long after its start, not even once, hangs in its
    # start (an import or the runtime's connection stuck): killed and started again the same way.
    startup_timeout_s: float = 60.0
    # Where the router keeps its operation history (operations.jsonl), which a restarted router
    # reloads; "" keeps it in the graph's run directory (`dynamo serve`'s, gone when it stops).
    state_dir: str = ""

    @property
    def health_url(self) -> str:
        """Its /health, as a client on this host reaches it (a wildcard address on loopback)."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://{f'[{host}]' if ':' in host else host}:{self.port}/health"

    def __post_init__(self) -> None:
        if not self.liveness_timeout_s > 0:
            raise ValueError("liveness_timeout_s must be > 0")
        if not self.startup_timeout_s > 0:
            raise ValueError("startup_timeout_s must be > 0")
        if self.standby_copies < 0:
            raise ValueError("standby_copies must be >= 0")
        if self.joiner_retries < 0:
            raise ValueError("joiner_retries must be >= 0")
        if not self.joiner_timeout_s > 0:
            raise ValueError("joiner_timeout_s must be > 0")
        if not self.retry_backoff_max_s > 0:
            raise ValueError("retry_backoff_max_s must be > 0")
        # What a bearer token may be (RFC 6750 b64token): anything else could not be sent as is.
        if self.token and not re.fullmatch(r"[A-Za-z0-9\-._~+/]+=*", self.token):
            raise ValueError("token must be printable ASCII: letters, digits and -._~+/ (then = padding)")


class FrontendConfig(msgspec.Struct, forbid_unknown_fields=True):
    host: str = "127.0.0.1"
    port: int = 8000
    # Requests on a worker that died mid-stream are retried elsewhere up to this many
    # times; with 0 the client sees the failure while a dead entry is still routable.
    migration_limit: int = 3
    router_mode: str = "round-robin"
    # Seconds a request's whole body may take to arrive: a client that sends less than its
    # Content-Length gets a 408 then, instead of holding the connection for as long as it likes.
    body_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        # Raised here so `dynamo serve` rejects a bad value before anything starts.
        if not self.body_timeout_s > 0:
            raise ValueError("body_timeout_s must be > 0")
        if self.router_mode not in ROUTER_MODES:
            raise ValueError(f"router_mode must be one of {', '.join(ROUTER_MODES)}")
        if not 0 <= self.port <= 65535:
            raise ValueError("port must be in 0..65535")
        if self.migration_limit < 0:
            raise ValueError("migration_limit must be >= 0")
