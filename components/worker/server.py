"""A rank's server: the control endpoint, one handler per message, over the engine, its weight
store and its streams (the generate endpoint, served by the rank's streaming process: stream_link)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import msgspec

from components.graph.component import (
    COMPONENT_ENV,
    GRAPH_ENV,
    GraphContext,
    component_config,
    encode_context,
)
from components.protocol.lifecycle import Lifecycle, RankState
from components.protocol.messages import (
    Command,
    Configure,
    Connect,
    ControlReply,
    Describe,
    Disconnect,
    Drain,
    DropSources,
    EndExport,
    Exit,
    ExportWeights,
    LoadExperts,
    LoadWeights,
    Park,
    Pause,
    PullWeights,
    RankStatus,
    Restore,
    Resume,
    SetRoutable,
    Warmup,
    decode_request,
    encode,
)
from components.worker.component import Faults, Worker, model_source, rank_config, started_for
from components.worker.rules import ANY_STATE, HOLDING_WEIGHTS, IN_COMMITS, RULES, StateError, allowed, handles, refusal

if TYPE_CHECKING:
    from components.worker.restore import RestoreIdentity
    from components.worker.stream_link import StreamLink

log = logging.getLogger("components.worker")

EXIT_STEP_LOOP_FAILED = 70  # EX_SOFTWARE: the step loop broke


class RankServer:
    def __init__(self, rank: int, cfg: Worker.Config, ctx: GraphContext, join: bool):
        self.rank, self.cfg, self.ctx, self.join = rank, cfg, ctx, join
        self.started_from = "cold"  # "snapshot" once restored()
        self.nonce = ""  # names its NIXL agents when restored (else its PID does)
        self.pid = os.getpid()  # as the router sees it: a restored copy is told
        self.life = Lifecycle(rank)
        self.faults = Faults.from_env()
        self.routable = False  # listed where the frontend routes to (by the streaming process)
        self.engine = None
        self.store = None
        self.stores_opened = 0
        self.ctl_ep = None
        self.streams: StreamLink | None = None  # the generate endpoint, in a process of its own
        self.exit = asyncio.Event()

    def load(self) -> None:
        from components.engine.rank import EngineRank

        t0 = time.perf_counter()
        if not self.join and self.rank in (self.faults.killed_loading, self.faults.stopped_loading):
            os.kill(os.getpid(), signal.SIGKILL if self.faults.killed_loading == self.rank else signal.SIGSTOP)
        self.model_dir, self.model_name = model_source(self.cfg)
        self.engine = EngineRank(rank_config(self.cfg, self.rank), self.model_dir, load_weights=not self.join)
        self.go_live(t0)

    def go_live(self, t0: float) -> None:
        """The engine built: open its weight store, and start its step loop out of any group."""
        e = self.engine
        e.on_fatal = self.die
        self.identity = e.model_config.identity()
        self.open_store()
        # Not serving anyone until the router puts this rank into a group.
        e.comm.set_active([], 0)
        e.start()
        if self.join:
            self.note(
                started_for(),
                f"joiner up ({self.started_from}) in {time.perf_counter() - t0:.2f} s, waiting for weights from peers",
            )
        else:
            self.life.transition(
                RankState.LOADED, f"cold start from {self.model_dir} in {time.perf_counter() - t0:.2f} s"
            )

    def restored(self, who: RestoreIdentity) -> None:
        """This process was restored from a snapshot image (its engine built and warm, no NIXL
        agent): become the rank `who` names, in its deployment. Every copy of one image has the
        same PID (in its own namespace), so the agents are named by `who.nonce` instead."""
        os.environ.clear()
        os.environ.update(who.env)
        os.environ[GRAPH_ENV] = encode_context(who.context)
        os.environ[COMPONENT_ENV] = Worker.name()
        # UCX cached its PID namespace when it was loaded, before the dump: it would take this
        # copy's namespace for the one it was baked in, and offer peers transports that name
        # processes by PID (cross-memory attach, shared memory through /proc/<pid>/fd), which
        # fail or reach another process across namespaces. Measured: with CMA the first endpoint
        # to a peer fails (NIXL_ERR_BACKEND); without it, shared memory goes by name.
        os.environ.setdefault("UCX_TLS", "^cma")
        os.environ.setdefault("UCX_POSIX_USE_PROC_LINK", "n")
        self.rank, self.ctx, self.nonce, self.pid = who.rank, who.context, who.nonce, who.pid
        self.cfg = component_config(Worker.Config)
        self.model_dir, self.model_name = model_source(self.cfg)
        self.life = Lifecycle(who.rank)
        self.faults = Faults.from_env()
        self.engine.assume_rank(who.rank, f"ep-{who.rank}-{who.nonce}")
        if self.engine.arena is not None:
            # Baked on CUDA with its arena released; the provider restored its CUDA state
            # before telling it who it is. Fresh memory at the addresses its graphs use: the
            # weights come from peers (PullWeights), the KV cache starts zeroed.
            t0 = time.perf_counter()
            self.engine.restore_memory()
            self.note(started_for(), f"VMM arena remapped in {time.perf_counter() - t0:.3f} s")
        self.engine.comm.resume()
        self.started_from = "snapshot"
        self.life.transition(RankState.RESTORED, f"restored from snapshot {who.snapshot}", started_for())

    def die(self, error: BaseException) -> None:
        """The step loop broke: exit, so the router sees a dead rank and fails it over, rather
        than a live process that serves nothing (its requests then migrate)."""
        log.critical("rank %d: step loop failed; exiting", self.rank, exc_info=error)
        logging.shutdown()
        os._exit(EXIT_STEP_LOOP_FAILED)

    def open_store(self) -> None:
        """Register this rank's weights with a fresh NIXL agent (named anew each time: peers may
        still hold the metadata of one closed at park)."""
        from components.engine.weights.store import WeightStore

        e = self.engine
        self.stores_opened += 1
        self.store = WeightStore(
            self.rank,
            e.weight_tensors(),
            device=e.cfg.device,
            arena=e.arena,
            name=f"weights-{self.rank}-{self.nonce or os.getpid()}-{self.stores_opened}",
        )

    def status(self) -> RankStatus:
        e = self.engine
        return RankStatus(
            rank=self.rank,
            pid=self.pid,
            instance_id=self.streams.instance_id,
            metadata=e.comm.metadata(),
            model_identity=self.identity,
            num_experts=e.model_config.num_experts,
            num_moe_layers=len(e.model.moe_layers),
            slots_per_rank=e.slots_per_rank,
            epoch=e.epoch,
            active=list(e.comm.active),
            connected=list(e.comm.connected),
            paused=e.paused,
            routable=self.routable,
            steps=e.steps,
            state=self.life.state,
            load=[moe.load.tolist() for _, moe in e.model.moe_layers],
            running=len(e.sched.running),
            waiting=len(e.sched.waiting),
            requests_total=e.requests_total,
            expert_rows=e.expert_rows,
            graph_captures=e.graphs.captures if e.graphs else 0,
            replays_diverged=e.sched.replays_diverged,
            started_from=self.started_from,
            ep_failed_peers=list(e.ep_failed_peers),
            placement=e.placement,
            joiner=self.join,
            kv_used=e.sched.slots_used,
            kv_total=e.sched.max_seqs,
        )

    async def control(self, raw: dict[str, Any], context: Any = None) -> AsyncIterator[dict[str, Any]]:
        try:
            msg = decode_request(raw)
            if self.faults.exit_on and self.faults.exit_on == raw.get("type"):
                self.note(msg.op, f"injected fault: exiting on {self.faults.exit_on}", logging.ERROR)
                os._exit(17)
            if self.faults.stall_on and self.faults.stall_on == raw.get("type"):
                stall = f"injected fault: stalling {self.faults.stall_on} {self.faults.stall_s:.1f} s"
                self.note(msg.op, stall, logging.ERROR)
                await asyncio.sleep(self.faults.stall_s)
            kind, state = type(msg), self.life.state
            if not allowed(kind, state):
                raise refusal(kind, state)
            reply = await RULES[kind].handler(self, msg) or ControlReply(ok=True)
            reply.status = self.status()
        except Exception as e:  # the router gets the reason; this rank keeps serving
            # A refusal is the router's mistake and changed nothing here: no traceback to show.
            log.error(
                "[op %s] rank %d: control %s failed: %s",
                raw.get("op", "-"),
                self.rank,
                raw.get("type"),
                e,
                exc_info=not isinstance(e, StateError),
            )
            reply = ControlReply(ok=False, error=f"{type(e).__name__}: {e}")
        yield encode(reply)

    def advance(self, msg: Command, to: RankState, reason: str) -> bool:
        """Move to `to` if the rule of `msg` declares that move from the current state; in the
        other states the message is valid in, the rank stays where it is (False)."""
        if RULES[type(msg)].moves.get(self.life.state) is not to:
            return False
        self.life.transition(to, reason, msg.op)
        return True

    def note(self, op: str, what: str, level: int = logging.INFO) -> None:
        """A log line about this rank's part in scale operation `op` ("-": none)."""
        log.log(level, "[op %s] rank %d: %s", op, self.rank, what)

    def on_loop(self, fn) -> asyncio.Future:
        return asyncio.wrap_future(self.engine.call(fn))

    @handles(Describe, ANY_STATE)
    async def on_describe(self, msg: Describe) -> None:
        """Only the status every reply carries: discovery and the router's refresh ask any rank."""

    @handles(
        Connect,
        HOLDING_WEIGHTS,
        {RankState.LOADED: RankState.STAGED, RankState.WARMED: RankState.STAGED},
    )
    async def on_connect(self, msg: Connect) -> None:
        """A joiner, or a first rank (to the others), is staged: connected, still masked. Serving
        ranks connect joiners and stay as they are."""
        # Off the step loop: connecting joiners must not stall serving. The communicator
        # serialises this against a collective in flight.
        await asyncio.to_thread(self.engine.comm.connect, msg.peers, msg.activate)
        what = f"connected to ranks {sorted(msg.peers)}, " + ("active" if msg.activate else "masked")
        if not self.advance(msg, RankState.STAGED, what):
            self.note(msg.op, what)

    @handles(Disconnect, HOLDING_WEIGHTS)
    async def on_disconnect(self, msg: Disconnect) -> None:
        """Serving ranks forget leaving ranks (cleanup) or joiners (abort)."""
        await asyncio.to_thread(self.engine.comm.disconnect, msg.ranks)
        self.note(msg.op, f"disconnected ranks {sorted(msg.ranks)}")

    @handles(Pause, IN_COMMITS)
    async def on_pause(self, msg: Pause) -> None:
        if msg.gone:  # a collective waiting on a dead peer gives up now, so the pause can land
            self.note(msg.op, f"ranks {sorted(msg.gone)} declared gone", logging.WARNING)
            self.engine.comm.declare_gone(msg.gone)
        await asyncio.wrap_future(self.engine.pause())
        self.note(msg.op, "paused at a step boundary", logging.DEBUG)

    @handles(Configure, IN_COMMITS)
    async def on_configure(self, msg: Configure) -> None:
        e = self.engine
        if not e.paused and self.rank in e.comm.active and len(e.comm.active) > 1:
            raise RuntimeError("configure needs the group paused first")
        await self.on_loop(lambda: e.configure(msg.epoch, msg.active, msg.placement))
        self.note(msg.op, f"epoch {msg.epoch}, active {msg.active}")

    @handles(
        Resume,
        IN_COMMITS,
        {RankState.LOADED: RankState.ACTIVE, RankState.WARMED: RankState.ACTIVE, RankState.STAGED: RankState.ACTIVE},
    )
    async def on_resume(self, msg: Resume) -> None:
        """A rank the commit made active serves from here on; a joiner that a rollback configured
        out stays where it was."""
        e = self.engine
        await asyncio.wrap_future(e.resume())
        self.note(msg.op, "resumed", logging.DEBUG)
        if self.rank in e.comm.active:
            self.advance(msg, RankState.ACTIVE, f"epoch {e.epoch}, active {list(e.comm.active)}")
        elif self.life.state is RankState.LEAVING:
            self.note(msg.op, f"out of the active set at epoch {e.epoch}")

    @handles(
        SetRoutable,
        {RankState.ACTIVE, RankState.LEAVING},
        {RankState.ACTIVE: RankState.LEAVING, RankState.LEAVING: RankState.ACTIVE},
    )
    async def on_set_routable(self, msg: SetRoutable) -> None:
        await self.streams.route(msg.routable)
        self.routable = msg.routable
        if not msg.routable:
            self.advance(msg, RankState.LEAVING, "out of routing")
            return
        # A scale-down that aborts puts its leaving ranks back: they never left the active set.
        self.advance(msg, RankState.ACTIVE, "back into routing")

    @handles(LoadExperts, HOLDING_WEIGHTS)
    async def on_load_experts(self, msg: LoadExperts) -> None:
        """The first ranks' cold start (connected to each other by then; joiners pull instead), and
        a serving rank taking over experts whose every replica was on a failed rank (`since`): a
        leaving one too, when a scale-down rolls back without a rank that died in its commit."""
        await self.on_loop(lambda: self.engine.load_experts(msg.placement, msg.since))
        self.note(msg.op, "experts loaded from the checkpoint" + (" where the map changed" if msg.since else ""))

    @handles(
        LoadWeights,
        {RankState.BOOTING, RankState.RESTORED},
        {RankState.BOOTING: RankState.LOADED, RankState.RESTORED: RankState.LOADED},
    )
    async def on_load_weights(self, msg: LoadWeights) -> None:
        """A rank of a deployment rebuilt from scratch: no peer holds weights to pull from."""
        e = self.engine

        def load() -> None:
            e.model.load_dense(e.ckpt)
            e.load_experts(msg.placement)

        await self.on_loop(load)
        self.advance(msg, RankState.LOADED, f"weights loaded from the checkpoint {self.model_dir}")

    # Exporting changes nothing on this rank: allowed in any state.
    @handles(ExportWeights, ANY_STATE)
    async def on_export_weights(self, msg: ExportWeights) -> ControlReply:
        manifest = await self.on_loop(lambda: self.store.manifest(msg.names))
        return ControlReply(ok=True, manifest=manifest)

    @handles(EndExport, ANY_STATE)
    async def on_end_export(self, msg: EndExport) -> None:
        self.store.stop_serving()

    @handles(
        PullWeights,
        {RankState.BOOTING, RankState.RESTORED} | HOLDING_WEIGHTS,
        {RankState.BOOTING: RankState.LOADED, RankState.RESTORED: RankState.LOADED},
    )
    async def on_pull_weights(self, msg: PullWeights) -> ControlReply:
        """A joiner pulls all its weights; a serving rank pulls the expert slots a new map changes
        (migrations, rebalances) and stays as it is. A source lost on the way costs only its
        items, which the router has read from other holders next: a joiner is loaded once that
        pull has brought the rest."""
        from components.engine.weights.store import WeightTransferError

        posted = self.stall_mid_pull(msg.op) if self.faults.stall_mid_pull else None
        stats = await asyncio.to_thread(self.store.pull, msg.items, msg.sources, partial=True, op=msg.op, posted=posted)
        if self.faults.corrupt_pull:
            self.note(msg.op, "injected fault: corrupting a pulled tensor", logging.ERROR)
            name = msg.items[0].dst_name
            t = self.store.tensors[name]
            t.view(-1)[0] += 1
            raise WeightTransferError(
                f"tensor {name} from rank {msg.items[0].src_rank}: checksum mismatch "
                f"after the pull (injected corruption)"
            )
        log.info(
            "[op %s] rank %d: pulled %d tensors, %.1f MB in %.3f s (%.2f GB/s; setup %.3f s, transfer %.3f s "
            "of which mapping peers %.3f s and copying %.3f s, verify %.3f s) from ranks %s",
            msg.op,
            self.rank,
            stats.tensors,
            stats.bytes / 1e6,
            stats.seconds,
            stats.gbps,
            stats.setup_seconds,
            stats.transfer_seconds,
            stats.map_seconds,
            stats.copy_seconds,
            stats.verify_seconds,
            sorted(stats.per_source),
        )
        for loss in stats.lost:
            log.warning(
                "[op %s] rank %d: %d tensors not pulled, source rank %d lost: %s",
                msg.op,
                self.rank,
                len(loss.items),
                loss.src_rank,
                loss.reason,
            )
        if not stats.lost:
            self.advance(msg, RankState.LOADED, f"weights pulled from ranks {sorted(stats.per_source)}")
        return ControlReply(ok=True, pull=stats, seconds=stats.seconds)

    def stall_mid_pull(self, op: str):
        """The injected fault `stall_mid_pull`: once this pull's first READ is posted, the READs
        from the other sources wait (once per process; the re-pull of what was lost does not)."""

        def posted(src: int, waiting: list[int]) -> None:
            if not waiting or not self.faults.stall_mid_pull:
                return
            stall_s, self.faults = self.faults.stall_mid_pull, msgspec.structs.replace(self.faults, stall_mid_pull=0.0)
            what = f"READ from rank {src} posted, from ranks {waiting} not yet"
            self.note(op, f"injected fault: stalling mid-pull {stall_s:.1f} s: {what}", logging.ERROR)
            time.sleep(stall_s)

        return posted

    # Changes nothing but which sources this rank's pulls read from: allowed in any state.
    @handles(DropSources, ANY_STATE)
    async def on_drop_sources(self, msg: DropSources) -> None:
        for agent, why in msg.agents.items():
            log.warning("[op %s] rank %d: reading no more from %s: %s", msg.op, self.rank, agent, why)
        self.store.drop_sources(msg.agents)

    @handles(
        Warmup,
        {RankState.LOADED, RankState.WARMED, RankState.STAGED, RankState.ACTIVE},
        {RankState.LOADED: RankState.WARMED, RankState.STAGED: RankState.WARMED},
    )
    async def on_warmup(self, msg: Warmup) -> ControlReply:
        """Mode C warms a joiner before connecting it; modes A and B warm it once staged, and a
        scale-down's remaining (active) ranks, inside the pause. Warming a WARMED rank again is
        harmless, so allowed."""
        e = self.engine
        seconds = await self.on_loop(lambda: e.warmup(msg.placement, recapture=msg.recapture))
        self.advance(msg, RankState.WARMED, f"alone, remote peers masked, {seconds:.3f} s")
        return ControlReply(ok=True, seconds=seconds)

    @handles(Drain, {RankState.LEAVING})
    async def on_drain(self, msg: Drain) -> ControlReply:
        e = self.engine
        deadline = time.monotonic() + msg.timeout_s
        while (e.sched.running or e.sched.waiting or self.streams.open) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        handed = list(self.streams.open)
        if handed and not msg.targets:
            raise ValueError(f"{len(handed)} request(s) left to hand over and no remaining rank to take them")
        for i, request_id in enumerate(handed):
            self.streams.hand_over(request_id, msg.targets[i % len(msg.targets)], msg.op)
        log.info("[op %s] rank %d: drained; %d request(s) handed over", msg.op, self.rank, len(handed))
        return ControlReply(ok=True, handed_over=len(handed))

    @handles(Park, {RankState.LEAVING}, {RankState.LEAVING: RankState.PARKED})
    async def on_park(self, msg: Park) -> None:
        e = self.engine
        await self.relays_finished(msg.op)
        await asyncio.to_thread(e.comm.disconnect, [r for r in e.comm.connected if r != self.rank])
        if msg.checkpoint:
            # No NIXL agent survives into a CUDA checkpoint: it then finds no transport state
            # (UCX streams, events, peer connections) to save. A warm parked process keeps
            # its agents, which spares its restore new UCX connections.
            await asyncio.to_thread(e.comm.suspend)
            await asyncio.to_thread(self.store.close)
        if e.arena is not None:
            await self.on_loop(e.release_memory)
        self.advance(
            msg,
            RankState.PARKED,
            "out of the group, weights dropped" + (", NIXL agents closed" if msg.checkpoint else ""),
        )

    @handles(Restore, {RankState.PARKED}, {RankState.PARKED: RankState.RESTORED})
    async def on_restore(self, msg: Restore) -> None:
        e = self.engine
        if e.arena is not None:
            await self.on_loop(e.restore_memory)
        if self.store.closed:
            await asyncio.to_thread(e.comm.resume)
            await asyncio.to_thread(self.open_store)
        self.advance(msg, RankState.RESTORED, "unparked")

    @handles(
        Exit,
        {RankState.STAGED, RankState.LEAVING},
        {RankState.STAGED: RankState.EXITED, RankState.LEAVING: RankState.EXITED},
    )
    async def on_exit(self, msg: Exit) -> None:
        await self.relays_finished(msg.op)
        self.advance(msg, RankState.EXITED, "asked to exit")
        self.exit.set()

    async def relays_finished(self, op: str) -> None:
        """Requests handed over still stream through this rank: let them finish (bounded)."""
        deadline = time.monotonic() + 300
        if self.streams.open:
            self.note(op, f"waiting for {len(self.streams.open)} relayed stream(s)")
        while self.streams.open and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
