"""Greedy, temperature, top-k and top-p sampling for a whole batch on the device.

A seeded request must reproduce whichever sequences share its batch and whichever rank continues
it after a handover, so its randomness cannot come from a generator whose state depends on the
draws before. Each draw is a Gumbel-max over the kept tokens with noise from a counter-based hash
of (request seed, position of the token being sampled, vocabulary index): a pure function of the
request and the step, computed with integer ops on the device. No host sync happens here; the
caller reads the sampled ids once per step.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

_MASK32 = 0xFFFFFFFF
# Odd multipliers below 2**31: a 32-bit value times one stays below 2**63, so int64 never wraps
# (wrapping is undefined behaviour in the kernels) and the same bits come out on every device.
_M1, _M2 = 0x7FEB352D, 0x2C1B3C6D
_GOLDEN = 0x9E3779B9
# The lowest temperature a row is sampled at, as in vLLM (SamplingParams: 0 < T < 1e-2 is raised to
# 1e-2). Below it logits / T overflows float32 (T = 1e-45 is a denormal: every logit becomes
# +-inf, softmax NaN) and the draw returns whichever token comes first.
MIN_TEMPERATURE = 1e-2


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xorshift-multiply rounds) of values in [0, 2**32), in int64."""
    x = x ^ _GOLDEN
    x = x ^ (x >> 16)
    x = (x * _M1) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _M2) & _MASK32
    return x ^ (x >> 16)


def gumbel_noise(seed: torch.Tensor, position: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, vocab] float32 standard Gumbel noise, a function of (seed[b], position[b], index) only."""
    idx = torch.arange(vocab, dtype=torch.int64, device=seed.device).unsqueeze(0)
    h = _mix(idx)
    h = _mix(h ^ (position.unsqueeze(1) & _MASK32))
    h = _mix(h ^ ((seed.unsqueeze(1) >> 32) & _MASK32))
    h = _mix(h ^ (seed.unsqueeze(1) & _MASK32))
    u = (h.to(torch.float64) + 0.5) * 2.0**-32  # in (0, 1), never 0 or 1
    return (-torch.log(-torch.log(u))).to(torch.float32)


class SampleParams(NamedTuple):
    """A batch's sampling parameters on the host, one entry per row."""

    temperature: list[float]
    top_p: list[float]
    top_k: list[int]
    seed: list[int]  # in [0, 2**63)
    position: list[int]  # index in its sequence of the token each row samples

    def on(self, device) -> tuple[torch.Tensor, ...]:
        """The tensors `sample` takes after the logits, on `device` (two copies)."""
        floats = torch.tensor([self.temperature, self.top_p], dtype=torch.float32).to(device)
        ints = torch.tensor([self.top_k, self.seed, self.position], dtype=torch.int64).to(device)
        return floats[0], floats[1], ints[0], ints[1], ints[2]


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    seed: torch.Tensor,
    position: torch.Tensor,
) -> torch.Tensor:
    """The next token of each row of `logits` ([B, V] float32), as a [B] int64 device tensor.

    Per row: temperature 0 is greedy; otherwise the token is drawn from softmax(logits / T), T
    raised to MIN_TEMPERATURE, restricted to the `top_k` most likely tokens (0: all), then to the
    smallest prefix of those whose mass reaches `top_p` (the top token always stays). `seed` is an int64 in [0, 2**63);
    `position` is the index in the sequence of the token being sampled."""
    B, V = logits.shape
    greedy = torch.argmax(logits, dim=-1)
    sampled = temperature > 0
    scaled = logits / torch.where(sampled, temperature.clamp(min=MIN_TEMPERATURE), 1.0).unsqueeze(1)
    sorted_logits, idx = torch.sort(scaled, dim=-1, descending=True, stable=True)
    rank = torch.arange(V, device=logits.device).unsqueeze(0)
    keep = (top_k.unsqueeze(1) <= 0) | (rank < top_k.unsqueeze(1))
    # top_p over the top-k distribution, renormalised (as vLLM applies them).
    p = torch.softmax(sorted_logits.masked_fill(~keep, float("-inf")), dim=-1)
    keep &= torch.cumsum(p, dim=-1) - p < top_p.unsqueeze(1)
    keep[:, 0] = True
    kept = torch.zeros_like(keep).scatter_(1, idx, keep)
    score = torch.where(kept, scaled + gumbel_noise(seed, position, V), float("-inf"))
    return torch.where(sampled, torch.argmax(score, dim=-1), greedy)
