"""Continuous batching, in one of two policies.

Mixed (vLLM's default shape): each step takes every decode, then prefill chunks up to a token
budget. Batch-invariant: a step is either every decode or one chunk of one prompt, the two taking
turns while both wait. A token's arithmetic then never depends on what else is running: decodes
run as one fixed-size CUDA graph whatever their number (see rank.decode_graph_sizes), and a
prompt is cut into the same chunks, computed alone, under any load; in a mixed step the kernels
that cuBLAS picks, the attention's key length and the chunking all follow the other requests, and
bf16 greedy completions change with the load."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from components.engine.layers import StepRows
from components.engine.request import GenerateRequest, TokenOutput

log = logging.getLogger(__name__)


@dataclass
class Sequence:
    req: GenerateRequest
    emit: Callable[[TokenOutput], None]
    tokens: list[int]
    slot: int = -1
    num_computed: int = 0  # tokens whose K/V are in the cache
    seed: int = 0  # keys the sampling noise with the position (sampler.gumbel_noise); < 2**63
    generated: list[int] = field(default_factory=list)
    replay_diverged: bool = False

    @property
    def sample_from(self) -> int:
        """Context length from which each step samples: the end of the original prompt."""
        return len(self.req.prompt) - self.req.replay

    @property
    def step_tokens(self) -> int:
        """Most tokens the next step may compute: the rest of the original prompt (prefill),
        then one (decode, replayed tokens included)."""
        if self.num_computed < self.sample_from:
            return self.sample_from - self.num_computed
        return min(1, len(self.tokens) - self.num_computed)


class Scheduler:
    def __init__(self, max_seqs: int, max_len: int, max_batched_tokens: int, eos_token_ids, invariant: bool):
        self.max_len, self.budget = max_len, max_batched_tokens
        self.invariant = invariant
        self._prefill_turn = False
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
        return bool(self.waiting or self.running)

    def cancel(self, request_id: str) -> None:
        for seq in [*self.waiting, *self.running]:
            if seq.req.request_id == request_id:
                self._finish(seq, "cancelled")

    def schedule(self) -> list[tuple[Sequence, int]]:
        while self.waiting and self.free_slots:
            seq = self.waiting.popleft()
            seq.slot = self.free_slots.pop()
            self.running.append(seq)
        if self.invariant:
            return self._schedule_invariant()
        work, budget = [], self.budget
        for seq in sorted(self.running, key=lambda s: s.step_tokens > 1):  # decodes first
            n = min(seq.step_tokens, budget)
            if n > 0:
                work.append((seq, n))
                budget -= n
        return work

    def _schedule_invariant(self) -> list[tuple[Sequence, int]]:
        prefills = [s for s in self.running if s.num_computed < s.sample_from]
        decodes = [(s, 1) for s in self.running if s.num_computed >= s.sample_from and s.step_tokens]
        self._prefill_turn = bool(prefills) and (not decodes or not self._prefill_turn)
        if self._prefill_turn:
            seq = prefills[0]  # admission order: the oldest prompt first
            # Chunks of the whole budget from the prompt's start: the same cuts under any load.
            return [(seq, min(seq.sample_from - seq.num_computed, self.budget))]
        return decodes

    def rows(self, work: list[tuple[Sequence, int]], per_token: bool = False) -> StepRows:
        """`per_token` (one prompt's chunk): each token a row of its own, its context ending at
        itself, so the chunk runs through the decode graphs with causal attention by row length."""
        ids, pos, tslots, last, ctx = [], [], [], [], []
        for seq, n in work:
            start = seq.num_computed
            ids += seq.tokens[start : start + n]
            pos += range(start, start + n)
            tslots += [seq.slot] * n
            last.append(len(ids) - 1)
            ctx.append(start + n)
        if per_token:
            return StepRows(ids, pos, tslots, tslots, [p + 1 for p in pos], list(range(len(ids))), [1] * len(ids))
        return StepRows(ids, pos, tslots, [s.slot for s, _ in work], ctx, last, [n for _, n in work])

    def update(self, work: list[tuple[Sequence, int]], next_tokens: list[int | None]) -> None:
        """Advance sequences after a step; `next_tokens[i]` is the token sampled after the
        sequence's cached context, None for a prefill chunk that is not the last."""
        for (seq, n), tok in zip(work, next_tokens):
            seq.num_computed += n
            if tok is None or seq.slot < 0:
                continue
            if seq.num_computed < len(seq.tokens):  # a replayed token: already streamed
                want = seq.tokens[seq.num_computed]
                if tok != want and not seq.replay_diverged:
                    seq.replay_diverged = True
                    self.replays_diverged += 1
                    log.warning(
                        "request %s: replay after a handover sampled %d where the first rank had %d "
                        "(position %d); the stream keeps the first rank's tokens",
                        seq.req.request_id,
                        tok,
                        want,
                        seq.num_computed,
                    )
                continue
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
