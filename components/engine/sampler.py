"""Greedy and temperature/top-p sampling, one generator per request so a seed reproduces."""

from __future__ import annotations

import torch


def sample(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> int:
    if temperature <= 0.0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, idx = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the top token always stays).
        keep = torch.cumsum(sorted_p, dim=-1) - sorted_p < top_p
        sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
        probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))
