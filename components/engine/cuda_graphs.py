"""Piecewise CUDA graphs for decode, and for mixed steps: decodes beside prompt pieces laid out
one token a row (a row's context ending at itself makes the decode attention causal; see
Scheduler.rows's per_token).

Batch invariance (`split`, `piece`): a decode-only step runs the graph of max_seqs rows, as it
always did (its speed is the decode floor's). A step with prompt tokens runs the smallest mixed
graph that holds them, of max_seqs + k pieces of rows (RankConfig.prompt_piece, up to the budget):
decodes in rows [0, max_seqs), padding behind them, prompt tokens from row max_seqs on, padding
behind those. Every kernel but cuBLAS's computes a row from that row alone (the Triton experts,
attention, norms, rotary, routing and combine); cuBLAS picks a kernel, and so a row's rounding, by
the row count, so a mixed graph runs every dense projection as a GEMM of the max_seqs decode rows
and one GEMM per piece behind them (layers.split_rows): the decode rows meet the very kernels of
the decode graph, and a prompt token those of one piece, whatever the step holds and whichever
mixed graph it runs in. The cost: a mixed step pays its last piece's padding rows in the dense
projections and lm_head (they attend over one key and go to no expert), and a launch per piece
per projection; prompt tokens still run as GEMMs of a piece's rows at tensor-core speed, and a
step with a few prompt tokens beside the decodes costs one piece, not the budget. (The alternative, one
Triton GEMM with a fixed tiling for every row count, as expert_gemm is, would put the decode step's
dense projections on kernels slower than cuBLAS's at 32 rows.) Prompt rows draw one at a time, as
rows of one (their draw, too, does not depend on the step); decode rows in the sampling graph of
the decode graph's size, as in a decode-only step.

The EP all-to-all is driven from the host (variable sizes, notifications), so it cannot live in a
graph. A decode step is therefore captured as segments split at each expert-parallel feed-forward,
and only the exchange runs eagerly between them: [embed, attend 0, dispatch 0] -> exchange 0 ->
[combine 0, residual + norm, attend 1, dispatch 1] -> ... -> [combine, residual + norm, lm_head].
Routing, the EP mask, the sort by destination and the combine are inside the graphs; dense
feed-forwards stay in their segment. One set per batch size, captured once; every input is a
static buffer that is copied into, and the graphs read the EP mask, expert map, expert slots, KV
cache and weights at fixed addresses, so new members, placements and weights need no recapture.

Where the exchange is device work (same-node peer windows, exchange/windows.py), nothing is left to the
host: the segments and the exchanges between them are captured as one graph per batch size.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager

import numpy as np
import torch
from torch import nn

from components.engine.kernels.expert_gemm import PROMPT_TILES, TILES, expert_tiles
from components.engine.models.layers import ForwardBatch, KVCache, SplitLinear, StepRows, rows_split_at, with_pending
from components.engine.models.moe import Dispatch
from components.engine.sampler import SampleParams, sample

log = logging.getLogger(__name__)


class DecodeGraphs:
    def __init__(self, model, kv: KVCache, batch_sizes: list[int], scratch_slot: int, split: int = 0, piece: int = 0):
        """`split` (batch-invariant): the decode rows of a mixed step, max_seqs; each graph larger
        than it is a mixed graph, its dense projections split there and behind it into calls of
        `piece` prompt rows each."""
        self.model, self.kv = model, kv
        self.sizes = sorted(batch_sizes)
        self.split, self.piece = split, piece
        if split:
            for m in model.modules():
                if type(m) is nn.Linear:  # the same parameters, computed in two parts under rows_split_at
                    m.__class__ = SplitLinear
        self.scratch_slot = scratch_slot  # KV slot that padded rows write into
        dev = model.lm_head.weight.device
        B, H = self.sizes[-1], model.cfg.hidden_size
        dtype = model.lm_head.weight.dtype
        # The inputs, a row each: token ids, positions, KV slots, context lengths, real (1) or
        # padding (0), and -1 or the row of `drawn` that holds the id (StepRows.src). One copy
        # from pinned memory fills them: a tensor per field would cost a host->device copy each,
        # and host work is the part of a step a graph cannot hide. Each capture starts them as
        # padding (`_capture`). A seventh row holds, in its first columns, the mixed graph's rows
        # whose logits a step wants besides the decodes' (`heads`).
        self.inputs = torch.zeros(7, B, dtype=torch.int64, device=dev)
        self.ids, self.pos, self.slots, self.ctx, self.real, self.src, self.heads = self.inputs
        # The tokens the step before drew, for rows whose id it was still drawing when queued.
        self.drawn = torch.zeros(B, dtype=torch.int64, device=dev)
        # Padding rows attend over the one scratch token and are never dispatched.
        self.padding = np.array([[0], [0], [scratch_slot], [1], [0], [-1], [0]], dtype=np.int64)
        # Every row past a step's batch stays padding: a larger graph's capture runs over all its
        # rows, and zeros there (KV slot 0, no context) would write a live sequence's first token
        # and attend over nothing. Two buffers, steps taking turns: a step is staged while the
        # one before may not have started, and its copy read the other buffer.
        self.staging = [torch.from_numpy(np.repeat(self.padding, B, axis=1)).pin_memory() for _ in range(2)]
        self._staged = [torch.cuda.Event() for _ in range(2)]  # each buffer read by its last copy
        self.valid = torch.zeros(B, dtype=torch.bool, device=dev)  # `real`, as the dispatch takes it
        self.greedy = torch.zeros(max(B, 2 * split), dtype=torch.int64, device=dev)  # each logits row's argmax
        blocks = list(model.model.layers)
        self.cuts = [i for i, b in enumerate(blocks) if b.moe is not None]
        self.moes = [blocks[i].moe for i in self.cuts]
        # Per MoE block: the residual h and the normed input n, kept for the combine, and y, the
        # exchange's output rows in dispatch order.
        self.h = [torch.zeros(B, H, dtype=dtype, device=dev) for _ in self.cuts]
        self.n = [torch.zeros(B, H, dtype=dtype, device=dev) for _ in self.cuts]
        self.y = [torch.zeros(B * m.top_k, H, dtype=dtype, device=dev) for m in self.moes]
        # A mixed graph computes logits for its decode rows and for the last row of each prompt
        # piece only, gathered behind them (`heads`): the rest of a piece draws nothing, and the
        # lm_head over every prompt row was a fifth of a prompt's FLOPs (Mixtral's 32k vocabulary;
        # DeepSeek's 129k more than its experts'). Each prompt piece belongs to a sequence of its
        # own, so there are at most `split` of them, and the gathered rows meet the lm_head as one
        # GEMM of `split` rows whatever the step holds.
        self.logit_rows = 2 * split if split and self.sizes[-1] > split else B
        self.logits = torch.zeros(max(B, self.logit_rows), model.cfg.vocab_size, dtype=torch.float32, device=dev)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        # Each segment's dispatch layout, by batch size: tensors a graph wrote during capture live
        # at fixed addresses in its pool, so the eager exchange and the next segment read them.
        self.dispatch: dict[int, list[Dispatch | None]] = {}
        self.captures = 0
        self.replays = 0  # decode steps served by graphs
        self.pool = None
        # One stream for every eager warm-up before a capture: cuBLAS keeps a 32 MiB workspace
        # for each stream it ever ran on, for the life of the process (and of a snapshot image).
        self._warmup_stream = torch.cuda.Stream()
        self._last = 0  # the size of the graph the last step ran
        self._heads: dict[int, int] = {}  # the last mixed step's piece ends: step row -> logits row
        # Decode steps with sampled rows draw in a graph of their own per size, captured at its
        # first use (it reads the logits and these parameters, all at fixed addresses): the
        # draw's twenty-odd kernels (scale, sort, softmax, cumsum, noise) in one launch. Rows:
        # temperature and top_p; top_k, seed and the position being sampled.
        self.sample_floats = torch.zeros(2, B, dtype=torch.float32, device=dev)
        self.sample_ints = torch.zeros(3, B, dtype=torch.int64, device=dev)
        self.sample_staging = [  # in turns, as the inputs' staging
            (torch.zeros(2, B, dtype=torch.float32).pin_memory(), torch.zeros(3, B, dtype=torch.int64).pin_memory())
            for _ in range(2)
        ]
        self.sampled = torch.zeros(B, dtype=torch.int64, device=dev)
        self.samplers: dict[int, torch.cuda.CUDAGraph] = {}
        for b in reversed(self.sizes):  # largest first so smaller graphs share its memory pool
            self._capture(b)
        segments = len(self.graphs[self.sizes[0]])  # one graph where the exchange runs inside it
        log.info("captured decode graphs for batch sizes %s (%d segments each)", self.sizes, segments)

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
        )

    def _segments(self, b: int):
        """Closures, one per segment, each reading and writing only static buffers."""
        m, batch, blocks = self.model, self._batch(b), list(self.model.model.layers)
        bounds = [-1, *self.cuts, len(blocks)]
        layouts = self.dispatch.setdefault(b, [None] * len(self.cuts))

        def norm_of(i):  # the norm that reads the residual stream in front of block i, or past the last
            return blocks[i].input_layernorm if i < len(blocks) else m.model.norm

        def segment(k):
            def run():
                # Every residual add but the attention's is fused into the norm that reads its sum
                # next (one kernel on CUDA), and the block takes that normed input as it is.
                if k == 0:
                    torch.ne(self.real[:b], 0, out=self.valid[:b])
                    ids = with_pending(batch.input_ids, self.src[:b], self.drawn)
                    x, x_normed = m.model.embed_tokens(ids), None  # block 0 norms its own
                else:
                    moe = self.moes[k - 1]
                    out = moe.combine(self.n[k - 1][:b], layouts[k - 1], self.y[k - 1][: b * moe.top_k])
                    x, x_normed = norm_of(bounds[k] + 1).add_and_norm(out, self.h[k - 1][:b])
                for i in range(bounds[k] + 1, bounds[k + 1] + (1 if k < len(self.cuts) else 0)):
                    h, n = blocks[i].attend(x, batch, self.kv, normed=x_normed)
                    if blocks[i].moe is not None:
                        self.h[k][:b].copy_(h)
                        self.n[k][:b].copy_(n)
                        layouts[k] = blocks[i].moe.dispatch(self.n[k][:b], self.valid[:b])
                        return
                    x, x_normed = norm_of(i + 1).add_and_norm(blocks[i].ffn(n), h)
                rows = b
                if self.split and b > self.split:
                    x_normed = torch.cat((x_normed[: self.split], x_normed.index_select(0, self.heads[: self.split])))
                    rows = 2 * self.split
                self.logits[:rows].copy_(m.lm_head(x_normed).float())
                torch.argmax(self.logits[:rows], dim=-1, out=self.greedy[:rows])

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
        # Warm-up and capture run every row: the last step's real rows would write their KV again.
        self.inputs.copy_(torch.from_numpy(self.padding).expand_as(self.inputs))
        # Captured alone (nothing is active yet): pairs have nowhere to go, which is no error.
        ep.set_masked_warmup(True)
        stream = self._warmup_stream
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), self._split(b):
            for seg in segs:  # warm up kernels (and their autotuning) outside the capture
                seg()
        torch.cuda.current_stream().wait_stream(stream)
        graphs = []
        for seg in segs:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool), self._split(b):
                seg()
            self.pool = g.pool()
            graphs.append(g)
        ep.set_masked_warmup(False)
        self.graphs[b] = graphs
        self.captures += 1

    @contextmanager
    def _split(self, b: int):
        """How the graph of `b` rows computes: a mixed graph's dense projections split (above),
        its experts in the tiling for prompt rows; a decode graph's as one GEMM and the decode
        tiling."""
        mixed = self.split and b > self.split
        top_k = self.moes[0].top_k if self.moes else 1
        with rows_split_at(*((self.split, self.piece) if mixed else (0,))):
            with expert_tiles(*((PROMPT_TILES, b * top_k) if mixed else (TILES,))):
                yield

    def recapture(self) -> None:
        """Capture every size again (what a design without graph reuse pays on each scale)."""
        self.graphs.clear()
        self.dispatch.clear()
        self.pool = None  # the pool went with the last graph that used it
        for b in reversed(self.sizes):
            self._capture(b)

    def fits(self, rows: StepRows, decodes: int | None = None) -> bool:
        """Whether the step of `rows` has a graph: decode rows; or (`decodes`: its leading decode
        rows, prompt pieces one token a row behind them) a mixed graph's."""
        if decodes is None:
            return rows.decode_only and len(rows.q_lens) <= self.sizes[-1]
        return bool(self.split) and decodes <= self.split and len(rows.ids) - decodes <= self.sizes[-1] - self.split

    def run(
        self, rows: StepRows, drawn: torch.Tensor | None = None, decodes: int | None = None, heads: list[int] = ()
    ) -> torch.Tensor:
        """Queue the step of `rows` (decode rows; or, with `decodes`, that many decode rows and
        prompt pieces one token a row behind them, in the mixed graph, `heads` the step's rows
        that end a piece); returns its logits, and `greedy` holds each logits row's argmax, both
        valid once the stream gets there: a row each of a decode graph; in a mixed graph the
        decode rows, then the `heads` (`logits_row` maps the step's rows there). `drawn`: the
        draws of the step before, where rows with a `src` read their ids."""
        real = len(rows.ids)
        if decodes is None:
            b = next(s for s in self.sizes if s >= real)
        elif self.piece:  # the smallest mixed graph that holds the prompt rows
            b = next(s for s in self.sizes if s > self.split and s - self.split >= real - decodes)
        else:
            b = self.sizes[-1]
        turn = self.replays % 2
        self._staged[turn].synchronize()  # long done: the caller waited for the step that read it
        host = self.staging[turn].numpy()
        src = rows.src if rows.src is not None else [-1] * real
        fields = (rows.ids, rows.positions, rows.token_slots, rows.ctx_lens, [1] * real, src)
        if decodes is None:
            host[:6, :real] = fields
            host[:, real:b] = self.padding
        else:
            assert len(heads) <= self.split, (len(heads), self.split)
            host[:, :b] = self.padding
            host[:6, [self.row(i, decodes) for i in range(real)]] = fields
            host[6, : len(heads)] = [self.row(i, decodes) for i in heads]
            self._heads = {i: self.split + j for j, i in enumerate(heads)}
        self.inputs.copy_(self.staging[turn], non_blocking=True)
        self._staged[turn].record()
        if rows.reads_pending:
            self.drawn[: len(drawn)].copy_(drawn)
        self.model.ep.sync_mask()
        graphs, layouts = self.graphs[b], self.dispatch[b]
        self.replays += 1
        self._last = b if decodes is None else self.split  # the decode rows' sampling graph
        if len(graphs) == 1:  # the exchanges are inside
            graphs[0].replay()
        else:
            with self._split(b):  # the experts run in the exchange, eagerly: as if captured
                for k, moe in enumerate(self.moes):
                    graphs[k].replay()
                    moe.exchange(layouts[k], self.y[k][: b * moe.top_k])
            graphs[-1].replay()
        return self.logits[:real] if decodes is None else self.logits[: self.logit_rows]

    def row(self, i: int, decodes: int) -> int:
        """The mixed graph's row of a step's row i, its first `decodes` rows decodes."""
        return i if i < decodes else self.split + i - decodes

    def logits_row(self, i: int, decodes: int | None) -> int:
        """The logits row of the last step's row i: its own in a decode graph; in a mixed graph
        (`decodes`) a decode's own, a piece's last row where `run` gathered it."""
        return i if decodes is None or i < decodes else self._heads[i]

    def sample(self, params: SampleParams) -> torch.Tensor:
        """Draw a token for each decode row of the step just queued (`run`), with `params` a row
        each, in the sampling graph of that step's decode size (a mixed step's: max_seqs, its
        decode rows); returns the ids, valid once the stream gets there. Padding rows draw
        greedily and are not returned."""
        real, b = len(params.seed), self._last
        # This turn's staging was last read by the copies of the step before the one before,
        # whose ids were read before this step was queued.
        staging = self.sample_staging[(self.replays - 1) % 2]
        floats, ints = (t.numpy() for t in staging)
        floats[:, :real] = (params.temperature, params.top_p)
        floats[:, real:b] = 0.0
        ints[:, :real] = (params.top_k, params.seed, params.position)
        ints[:, real:b] = 0
        self.sample_floats.copy_(staging[0], non_blocking=True)
        self.sample_ints.copy_(staging[1], non_blocking=True)
        if b not in self.samplers:
            self.samplers[b] = self._capture_sampler(b)
        self.samplers[b].replay()
        return self.sampled[:real]

    def _capture_sampler(self, b: int) -> torch.cuda.CUDAGraph:
        def draw():
            f, i = self.sample_floats[:, :b], self.sample_ints[:, :b]
            self.sampled[:b].copy_(sample(self.logits[:b], f[0], f[1], i[0], i[1], i[2]))

        stream = self._warmup_stream
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            draw()  # outside the capture first, as every graph here
        torch.cuda.current_stream().wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):  # a pool of its own: its scratch outlives no step
            draw()
        log.info("captured the sampling graph for batch size %d", b)
        return g
