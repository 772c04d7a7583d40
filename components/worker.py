"""Worker: one DP/EP rank as a Dynamo process.

Serves two endpoints: `<ns>.worker.generate` (registered with the model, so the frontend routes
to it once it is routable) and `<ns>.worker.control` (the router's commands, addressed to this
instance). A rank starts out of routing; the router makes it routable after it joined a group.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import uuid
from pathlib import Path
from typing import Any, AsyncIterator, ClassVar

import msgspec

from components.component import Component, GraphContext, ProcessSpec, component_config, load_context
from components.control import (
    Configure, Connect, ControlReply, Describe, Disconnect, Pause, RankStatus, Resume, SetRoutable,
    decode_request, encode,
)
from components.lifecycle import Lifecycle, RankState

log = logging.getLogger("components.worker")


class Worker(Component):
    class Config(msgspec.Struct, forbid_unknown_fields=True):
        model: str = ""  # a Hugging Face checkpoint directory; "" = the built-in model
        served_model_name: str = ""  # "" = the built-in model's name, or the directory's name
        device: str = "cpu"  # "cpu" or "cuda" (rank r takes GPU r % visible GPUs)
        dtype: str = ""  # "" = the checkpoint's
        dp_size: int = 2  # ranks at start
        max_ranks: int = 4  # the most ranks the deployment can grow to (sizes EP buffers)
        min_ranks: int = 1  # the fewest ranks it can shrink to (sizes the expert slots)
        max_seqs: int = 16
        max_len: int = 1024
        max_batched_tokens: int = 256

    module: ClassVar[str] = "components.worker"

    @classmethod
    def check(cls, c: "Worker.Config") -> None:
        if not 1 <= c.min_ranks <= c.max_ranks:
            raise ValueError(f"Worker.min_ranks ({c.min_ranks}) must be in 1..max_ranks ({c.max_ranks})")
        if not c.min_ranks <= c.dp_size <= c.max_ranks:
            raise ValueError(f"Worker.dp_size ({c.dp_size}) must be in min_ranks..max_ranks ({c.min_ranks}..{c.max_ranks})")
        if c.device not in ("cpu", "cuda"):
            raise ValueError(f"Worker.device must be 'cpu' or 'cuda', not {c.device!r}")

    @classmethod
    def rank_process(cls, rank: int) -> ProcessSpec:
        return ProcessSpec(label=f"Worker.{rank}", argv=[sys.executable, "-m", cls.module, "--rank", str(rank)],
                           critical=False)

    @classmethod
    def processes(cls, config: Any, ctx: GraphContext) -> list[ProcessSpec]:
        cls.check(config)
        return [cls.rank_process(r) for r in range(config.dp_size)]


def model_source(cfg: Worker.Config) -> tuple[str, str]:
    """(checkpoint directory, served model name)."""
    if cfg.model:
        return cfg.model, cfg.served_model_name or Path(cfg.model).resolve().name
    from components.engine.builtin import BUILTIN_MODEL_NAME, builtin_model_dir

    return str(builtin_model_dir()), cfg.served_model_name or BUILTIN_MODEL_NAME


def to_request(raw: dict[str, Any], max_len: int):
    """Dynamo's preprocessed request -> the engine's GenerateRequest."""
    from components.engine.request import GenerateRequest

    stop = raw.get("stop_conditions") or {}
    samp = raw.get("sampling_options") or {}
    prompt = list(raw.get("token_ids") or [])
    max_tokens = stop.get("max_tokens")
    return GenerateRequest(
        request_id=uuid.uuid4().hex,
        prompt=prompt,
        max_tokens=max_tokens if max_tokens is not None else max(1, max_len - len(prompt)),
        temperature=samp.get("temperature") or 0.0,
        top_p=samp.get("top_p") if samp.get("top_p") is not None else 1.0,
        seed=samp.get("seed"),
        stop_token_ids=list(stop.get("stop_token_ids_hidden") or []),
        ignore_eos=bool(stop.get("ignore_eos")),
    )


class RankServer:
    def __init__(self, rank: int, cfg: Worker.Config, ctx: GraphContext):
        self.rank, self.cfg, self.ctx = rank, cfg, ctx
        self.life = Lifecycle(rank)
        self.routable = asyncio.Event()
        self.engine = None
        self.gen_ep = self.ctl_ep = None

    def load(self) -> None:
        import torch

        from components.engine.rank import EngineRank, RankConfig

        model_dir, self.model_name = model_source(self.cfg)
        self.model_dir = model_dir
        device = self.cfg.device
        if device == "cuda":
            device = f"cuda:{self.rank % torch.cuda.device_count()}"
        c = self.cfg
        self.engine = EngineRank(
            RankConfig(rank=self.rank, max_ranks=c.max_ranks, device=device, dtype=c.dtype,
                       max_seqs=c.max_seqs, max_len=c.max_len, max_batched_tokens=c.max_batched_tokens,
                       min_ranks=c.min_ranks),
            model_dir,
        )
        # Not serving anyone until the router puts this rank into a group.
        self.engine.comm.set_active([], 0)
        self.engine.start()
        self.life.transition(RankState.LOADED, f"cold start from {model_dir}")

    def status(self) -> RankStatus:
        e = self.engine
        return RankStatus(
            rank=self.rank, instance_id=self.gen_ep.connection_id(), metadata=e.comm.metadata(),
            model_identity=e.model_config.identity(), num_experts=e.model_config.num_experts,
            num_moe_layers=len(e.model.moe_layers), slots_per_rank=e.slots_per_rank, epoch=e.epoch,
            active=list(e.comm.active), connected=list(e.comm.connected), paused=e.paused,
            routable=self.routable.is_set(), steps=e.steps, running=len(e.sched.running),
            waiting=len(e.sched.waiting), requests_total=e.requests_total, expert_rows=e.expert_rows,
        )

    async def generate(self, raw: dict[str, Any], context: Any = None) -> AsyncIterator[dict[str, Any]]:
        from components.engine.request import RequestError

        await self.routable.wait()
        loop = asyncio.get_running_loop()
        out: asyncio.Queue = asyncio.Queue()
        req = to_request(raw, self.cfg.max_len)
        try:
            self.engine.submit(req, lambda o: loop.call_soon_threadsafe(out.put_nowait, o))
        except RequestError as e:
            # A request the engine cannot serve is the client's fault: 400, not a 500.
            from dynamo.llm.exceptions import InvalidArgument

            raise InvalidArgument(str(e)) from None
        produced = 0
        try:
            while True:
                o = await out.get()
                produced += len(o.token_ids)
                chunk: dict[str, Any] = {"token_ids": o.token_ids}
                if o.finish_reason:
                    chunk["finish_reason"] = o.finish_reason
                    chunk["completion_usage"] = {
                        "prompt_tokens": len(req.prompt), "completion_tokens": produced,
                        "total_tokens": len(req.prompt) + produced,
                    }
                yield chunk
                if o.finish_reason:
                    return
        finally:
            if not (out.qsize() == 0 and produced and o.finish_reason):
                self.engine.cancel(req.request_id)

    async def control(self, raw: dict[str, Any], context: Any = None) -> AsyncIterator[dict[str, Any]]:
        try:
            msg = decode_request(raw)
            await self._apply(msg)
            reply = ControlReply(ok=True, status=self.status())
        except Exception as e:  # the router gets the reason; this rank keeps serving
            log.exception("rank %d: control %s failed", self.rank, raw.get("type"))
            reply = ControlReply(ok=False, error=f"{type(e).__name__}: {e}")
        yield encode(reply)

    async def _apply(self, msg) -> None:
        e = self.engine
        run = lambda fut: asyncio.wrap_future(fut)  # noqa: E731
        if isinstance(msg, Describe):
            return
        if isinstance(msg, Connect):
            await run(e.call(lambda: e.comm.connect(msg.peers, activate=msg.activate)))
        elif isinstance(msg, Disconnect):
            await run(e.call(lambda: e.comm.disconnect(msg.ranks)))
        elif isinstance(msg, Pause):
            await run(e.pause())
        elif isinstance(msg, Configure):
            if not e.paused and self.rank in e.comm.active and len(e.comm.active) > 1:
                raise RuntimeError("configure needs the group paused first")
            def configure():
                # EngineRank.configure only installs the map now: fill the slots from the
                # checkpoint too (a cold-started rank has nothing in them otherwise).
                e.load_experts(msg.placement)
                e.configure(msg.epoch, msg.active, msg.placement)

            await run(e.call(configure))
        elif isinstance(msg, Resume):
            await run(e.resume())
            if self.rank in e.comm.active and self.life.state is RankState.LOADED:
                self.life.transition(RankState.ACTIVE, f"epoch {e.epoch}, active {list(e.comm.active)}")
        elif isinstance(msg, SetRoutable):
            if msg.routable:
                await self.gen_ep.register_endpoint_instance()
                self.routable.set()
            else:
                await self.gen_ep.unregister_endpoint_instance()
                self.routable.clear()


async def serve(rank: int) -> None:
    from dynamo.llm import ModelInput, ModelType, WorkerType, register_model

    from components.runtime import make_runtime

    ctx, _ = load_context()
    cfg = component_config(Worker.Config)
    server = RankServer(rank, cfg, ctx)
    await asyncio.to_thread(server.load)
    loop = asyncio.get_running_loop()
    rt = make_runtime(loop, ctx)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, rt.shutdown)
    server.gen_ep = rt.endpoint(f"{ctx.namespace}.worker.generate")
    server.ctl_ep = rt.endpoint(f"{ctx.namespace}.worker.control")
    await register_model(ModelInput.Tokens, ModelType.Chat | ModelType.Completions, server.gen_ep,
                         server.model_dir, server.model_name, worker_type=WorkerType.Aggregated)
    log.info("rank %d: serving %r (instance %x), waiting for the router", rank, server.model_name,
             server.gen_ep.connection_id())
    gen = asyncio.ensure_future(server.gen_ep.serve_endpoint(server.generate))
    await asyncio.sleep(0.2)
    await server.gen_ep.unregister_endpoint_instance()
    try:
        await asyncio.gather(gen, server.ctl_ep.serve_endpoint(server.control))
    finally:
        server.engine.stop()
        log.info("rank %d: stopped", rank)


def main() -> None:
    p = argparse.ArgumentParser(description="One DP/EP worker rank (started by `dynamo serve`).")
    p.add_argument("--rank", type=int, required=True)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(args.rank))


if __name__ == "__main__":
    main()
