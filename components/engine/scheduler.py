"""Continuous batching, in one of two policies.

Mixed (vLLM's default shape): each step takes every decode, then prefill chunks up to a token
budget, cut where the budget left after the decodes ends. Batch-invariant (the default): each step
takes every decode too, then whole pieces of prompts, oldest prompt first, up to
`max_batched_tokens` prompt tokens (decodes do not count against it, so a decode never waits for
a prompt and a prompt never shrinks because decodes run). A prompt's pieces are cut at multiples of
`max_batched_tokens` from its start, and a piece that does not fit in what is left of a step waits
for the next one whole: the cuts depend on the prompt alone, never on the load. Several short
prompts share a step; a long one fills steps of its own beside the decodes.

That is half of the invariance; the other half is that a row's arithmetic does not depend on the
step's rows (rank.py, cuda_graphs.py): on CUDA a decode-only step is the graph of max_seqs rows,
and a step with prompt tokens the mixed graph, decodes in its first max_seqs rows and the prompt
tokens one a row behind them, every dense projection split at that boundary so that both parts
run at row counts the load does not choose."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from components.engine.models.layers import StepRows
from components.engine.request import GenerateRequest, TokenOutput

log = logging.getLogger(__name__)


@dataclass
class Sequence:
    req: GenerateRequest
    emit: Callable[[TokenOutput], None]
    tokens: list[int]
    slot: int = -1
    num_computed: int = 0  # tokens whose K/V are in the cache, or written by a step queued
    seed: int = 0  # keys the sampling noise with the position (sampler.gumbel_noise); < 2**63
    generated: list[int] = field(default_factory=list)
    replay_diverged: bool = False
    # Tokens drawn for it by steps still on the device (Scheduler.advance), not yet read back
    # (Scheduler.update), and the row of the latest such step that drew the last of them: a step
    # queued meanwhile reads that token on the device (StepRows.src).
    pending: int = 0
    pending_row: int = -1

    def read_pending(self) -> None:
        """One pending token read back, or retracted with its step."""
        self.pending -= 1
        if not self.pending:
            self.pending_row = -1

    @property
    def sample_from(self) -> int:
        """Context length from which each step samples: the end of the original prompt."""
        return len(self.req.prompt) - self.req.replay


class Scheduler:
    def __init__(self, max_seqs: int, max_len: int, max_batched_tokens: int, eos_token_ids, invariant: bool):
        self.max_len, self.budget = max_len, max_batched_tokens
        self.invariant = invariant
        # Steps that carried prompt tokens beside other rows (decodes or another prompt's piece).
        self.mixed_steps = 0
        self.eos = set(eos_token_ids)
        self.max_seqs = max_seqs
        self.free_slots = list(range(max_seqs))[::-1]
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.replays_diverged = 0  # handed-over requests whose replay did not reproduce their tokens

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def slots_used(self) -> int:
        """KV cache slots held by sequences."""
        return self.max_seqs - len(self.free_slots)

    def has_work(self) -> bool:
        """Whether a step has anything to compute: not when every running sequence's last
        token is being drawn by the step in flight."""
        return bool(self.waiting) or any(self.step_tokens(s) for s in self.running)

    def cancel(self, request_id: str) -> None:
        for seq in [*self.waiting, *self.running]:
            if seq.req.request_id == request_id:
                self._finish(seq, "cancelled")

    def step_tokens(self, seq: Sequence) -> int:
        """Most tokens the next step may compute for `seq`: the rest of the original prompt
        (prefill), then one (decode, replayed tokens included); none once the token a step in
        flight draws for it is its last."""
        if seq.num_computed < seq.sample_from:
            return seq.sample_from - seq.num_computed
        known = len(seq.tokens) + seq.pending
        if len(seq.generated) + seq.pending >= seq.req.max_tokens or known >= self.max_len:
            return 0
        return min(1, known - seq.num_computed)

    def schedule(self) -> list[tuple[Sequence, int]]:
        while self.waiting and self.free_slots:
            seq = self.waiting.popleft()
            seq.slot = self.free_slots.pop()
            self.running.append(seq)
        if self.invariant:
            return self._schedule_invariant()
        work, budget = [], self.budget
        for seq in sorted(self.running, key=lambda s: self.step_tokens(s) > 1):  # decodes first
            n = min(self.step_tokens(seq), budget)
            if n > 0:
                work.append((seq, n))
                budget -= n
        return work

    def _schedule_invariant(self) -> list[tuple[Sequence, int]]:
        work = [(s, 1) for s in self.running if s.num_computed >= s.sample_from and self.step_tokens(s)]
        room = self.budget
        for seq in self.running:  # admission order: the oldest prompt first
            if seq.num_computed < seq.sample_from:
                n = min(seq.sample_from - seq.num_computed, self.budget)  # to the next multiple of it
                if n > room:  # whole pieces only, and none overtakes an older prompt's
                    break
                work.append((seq, n))
                room -= n
        if room < self.budget and len(work) > 1:
            self.mixed_steps += 1
        return work

    @staticmethod
    def decode_rows(work: list[tuple[Sequence, int]]) -> int:
        """How many of `work`'s leading entries are decodes (the rest: prompt pieces); a prompt
        piece of one token counts as a prompt's, whatever its length."""
        return sum(1 for seq, _ in work if seq.num_computed >= seq.sample_from)

    def rows(self, work: list[tuple[Sequence, int]], per_token: bool = False) -> StepRows:
        """`per_token`: each token a row of its own, its context ending at itself, so prompt pieces
        run through the graphs with causal attention by row length beside the decodes.
        A decode whose token the step in flight is still drawing reads it there (`src`)."""
        ids, src, pos, tslots, last, ctx = [], [], [], [], [], []
        for seq, n in work:
            start = seq.num_computed
            known = seq.tokens[start : start + n]
            ids += known
            src += [-1] * len(known)
            if len(known) < n:
                assert n - len(known) == 1 == seq.pending, (seq.req.request_id, n, len(known), seq.pending)
                ids.append(0)
                src.append(seq.pending_row)
            pos += range(start, start + n)
            tslots += [seq.slot] * n
            last.append(len(ids) - 1)
            ctx.append(start + n)
        if per_token:
            return StepRows(ids, pos, tslots, tslots, [p + 1 for p in pos], list(range(len(ids))), [1] * len(ids), src)
        return StepRows(ids, pos, tslots, [s.slot for s, _ in work], ctx, last, [n for _, n in work], src)

    def advance(self, work: list[tuple[Sequence, int]]) -> list[int]:
        """Once the step of `work` is queued: its tokens count as computed, and where it draws a
        sequence's next token, that token is pending until `update`. Returns, for each row, the
        index in its sequence of the token it draws (-1: a prompt chunk that is not the last)."""
        positions = []
        for i, (seq, n) in enumerate(work):
            seq.num_computed += n
            pos = seq.num_computed if seq.num_computed >= seq.sample_from else -1
            if pos >= len(seq.tokens):
                seq.pending, seq.pending_row = seq.pending + 1, i
            positions.append(pos)
        return positions

    def retract(self, work: list[tuple[Sequence, int]], positions: list[int]) -> None:
        """Undo `advance` for a step whose results are discarded (its exchange gave up)."""
        for (seq, n), pos in zip(work, positions):
            seq.num_computed -= n
            if pos >= len(seq.tokens):
                seq.read_pending()

    def update(self, work: list[tuple[Sequence, int]], positions: list[int], next_tokens: list[int]) -> None:
        """After the step of `work` is done: the token each row drew, at the position `advance`
        gave it (-1: none). A sequence finished or cancelled meanwhile takes nothing."""
        for (seq, _), pos, tok in zip(work, positions, next_tokens):
            if pos < 0 or seq.slot < 0:
                continue
            if pos < len(seq.tokens):  # a replayed token: already streamed
                want = seq.tokens[pos]
                if tok != want and not seq.replay_diverged:
                    seq.replay_diverged = True
                    self.replays_diverged += 1
                    log.warning(
                        "request %s: replay after a handover sampled %d where the first rank had %d "
                        "(position %d); the stream keeps the first rank's tokens",
                        seq.req.request_id,
                        tok,
                        want,
                        pos,
                    )
                continue
            seq.read_pending()
            seq.tokens.append(tok)
            seq.generated.append(tok)
            reason = self._stop_reason(seq, tok)
            if reason:
                self._finish(seq, reason, [tok])
            else:
                seq.emit(TokenOutput(seq.req.request_id, [tok]))

    def _stop_reason(self, seq: Sequence, tok: int) -> str | None:
        if not seq.req.ignore_eos and tok in self.eos:
            return "eos"
        if tok in seq.req.stop_token_ids:
            return "stop"
        if len(seq.generated) >= seq.req.max_tokens or len(seq.tokens) >= self.max_len:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str, tokens: list[int] | None = None) -> None:
        if seq in self.running:
            self.running.remove(seq)
            self.free_slots.append(seq.slot)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.slot = -1
        seq.emit(TokenOutput(seq.req.request_id, tokens or [], reason))
