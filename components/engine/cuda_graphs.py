"""Piecewise CUDA graphs for decode, and for prompt chunks laid out one token a row (a row's
context ending at itself makes the decode attention causal; see scheduler.batch's per_token).

The EP all-to-all is driven from the host (variable sizes, notifications), so it cannot live in a
graph. A decode step is therefore captured as segments split at each expert-parallel feed-forward,
and only the exchange runs eagerly between them: [embed, attend 0, dispatch 0] -> exchange 0 ->
[combine 0, residual, attend 1, dispatch 1] -> ... -> [combine, norm, lm_head]. Routing, the EP
mask, the sort by destination and the combine are inside the graphs; dense feed-forwards stay in
their segment. One set per batch size, captured once; every input is a static buffer that is
copied into, and the graphs read the EP mask, expert map, expert slots, KV cache and weights at
fixed addresses, so new members, placements and weights need no recapture.

Where the exchange is device work (same-node peer windows, ep_window.py), nothing is left to the
host: the segments and the exchanges between them are captured as one graph per batch size.
"""

from __future__ import annotations

import logging

import torch

from components.engine.layers import ForwardBatch, KVCache
from components.engine.moe import Dispatch

log = logging.getLogger(__name__)


class DecodeGraphs:
    def __init__(self, model, kv: KVCache, batch_sizes: list[int], scratch_slot: int):
        self.model, self.kv = model, kv
        self.sizes = sorted(batch_sizes)
        self.scratch_slot = scratch_slot  # KV slot that padded rows write into
        dev = model.lm_head.weight.device
        B, H = self.sizes[-1], model.cfg.hidden_size
        dtype = model.lm_head.weight.dtype
        self.ids = torch.zeros(B, dtype=torch.int64, device=dev)
        self.pos = torch.zeros(B, dtype=torch.int64, device=dev)
        self.slots = torch.full((B,), scratch_slot, dtype=torch.int64, device=dev)
        self.ctx = torch.ones(B, dtype=torch.int64, device=dev)
        self.valid = torch.zeros(B, dtype=torch.bool, device=dev)  # real rows; padding is never dispatched
        blocks = list(model.model.layers)
        self.cuts = [i for i, b in enumerate(blocks) if b.moe is not None]
        self.moes = [blocks[i].moe for i in self.cuts]
        # Per MoE block: the residual h and the normed input n, kept for the combine, and y, the
        # exchange's output rows in dispatch order.
        self.h = [torch.zeros(B, H, dtype=dtype, device=dev) for _ in self.cuts]
        self.n = [torch.zeros(B, H, dtype=dtype, device=dev) for _ in self.cuts]
        self.y = [torch.zeros(B * m.top_k, H, dtype=dtype, device=dev) for m in self.moes]
        self.logits = torch.zeros(B, model.cfg.vocab_size, dtype=torch.float32, device=dev)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        # Each segment's dispatch layout, by batch size: tensors a graph wrote during capture live
        # at fixed addresses in its pool, so the eager exchange and the next segment read them.
        self.dispatch: dict[int, list[Dispatch | None]] = {}
        self.captures = 0
        self.replays = 0  # decode steps served by graphs
        self.pool = None
        for b in reversed(self.sizes):  # largest first so smaller graphs share its memory pool
            self._capture(b)
        log.info("captured decode graphs for batch sizes %s (%d segments each)", self.sizes, len(self.cuts) + 1)

    def _batch(self, b: int) -> ForwardBatch:
        return ForwardBatch(
            input_ids=self.ids[:b],
            positions=self.pos[:b],
            token_slots=self.slots[:b],
            slots=self.slots[:b],
            ctx_lens=self.ctx[:b],
            last_index=torch.arange(b, device=self.ids.device),
            q_lens=[1] * b,
            ctx_lens_list=[],
            slots_list=[],
            kv_len=self.kv.max_len,
        )

    def _segments(self, b: int):
        """Closures, one per segment, each reading and writing only static buffers."""
        m, batch, blocks = self.model, self._batch(b), list(self.model.model.layers)
        bounds = [-1, *self.cuts, len(blocks)]
        layouts = self.dispatch.setdefault(b, [None] * len(self.cuts))

        def segment(k):
            def run():
                if k == 0:
                    x = m.model.embed_tokens(batch.input_ids)
                else:
                    moe = self.moes[k - 1]
                    x = self.h[k - 1][:b] + moe.combine(
                        self.n[k - 1][:b], layouts[k - 1], self.y[k - 1][: b * moe.top_k]
                    )
                for i in range(bounds[k] + 1, bounds[k + 1] + (1 if k < len(self.cuts) else 0)):
                    h, n = blocks[i].attend(x, batch, self.kv)
                    if blocks[i].moe is not None:
                        self.h[k][:b].copy_(h)
                        self.n[k][:b].copy_(n)
                        layouts[k] = blocks[i].moe.dispatch(self.n[k][:b], self.valid[:b])
                        return
                    x = h + blocks[i].ffn(n)
                self.logits[:b].copy_(m.lm_head(m.model.norm(x)).float())

            return run

        return [segment(k) for k in range(len(self.cuts) + 1)]

    def _capture(self, b: int) -> None:
        segs = self._segments(b)
        if self.model.ep.windows is not None:
            layouts, parts = self.dispatch[b], segs

            def step():
                for k, seg in enumerate(parts):
                    seg()
                    if k < len(self.moes):
                        self.moes[k].exchange(layouts[k], self.y[k][: b * self.moes[k].top_k])

            segs = [step]
        ep = self.model.ep
        # Captured alone (nothing is active yet): pairs have nowhere to go, which is no error.
        ep.set_masked_warmup(True)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for seg in segs:  # warm up kernels (and their autotuning) outside the capture
                seg()
        torch.cuda.current_stream().wait_stream(stream)
        graphs = []
        for seg in segs:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                seg()
            self.pool = g.pool()
            graphs.append(g)
        ep.set_masked_warmup(False)
        self.graphs[b] = graphs
        self.captures += 1

    def recapture(self) -> None:
        """Capture every size again (what a design without graph reuse pays on each scale)."""
        self.graphs.clear()
        self.dispatch.clear()
        self.pool = None  # the pool went with the last graph that used it
        for b in reversed(self.sizes):
            self._capture(b)

    def fits(self, batch: ForwardBatch) -> bool:
        return batch.decode_only and len(batch.q_lens) <= self.sizes[-1]

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        real = len(batch.q_lens)
        b = next(s for s in self.sizes if s >= real)
        self.ids[:real].copy_(batch.input_ids)
        self.pos[:real].copy_(batch.positions)
        self.slots[:real].copy_(batch.slots)
        self.ctx[:real].copy_(batch.ctx_lens)
        # Padded rows attend over one scratch token and are never dispatched.
        self.slots[real:b].fill_(self.scratch_slot)
        self.pos[real:b].zero_()
        self.ctx[real:b].fill_(1)
        self.valid[:real].fill_(True)
        self.valid[real:b].fill_(False)
        self.model.ep.sync_mask()
        graphs, layouts = self.graphs[b], self.dispatch[b]
        self.replays += 1
        if len(graphs) == 1:  # the exchanges are inside
            graphs[0].replay()
            return self.logits[:real]
        for k, moe in enumerate(self.moes):
            graphs[k].replay()
            moe.exchange(layouts[k], self.y[k][: b * moe.top_k])
        graphs[-1].replay()
        return self.logits[:real]
