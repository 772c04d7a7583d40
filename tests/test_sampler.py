"""The batched device sampler: greedy rows are argmax, a row's draw depends on its own request
and position only, and the draws follow the temperature/top-k/top-p distribution."""

from __future__ import annotations

import math

import pytest
import torch

from components.engine.sampler import sample

PROBS = [0.5, 0.3, 0.15, 0.05]
N = 4000  # draws per case: a frequency's standard error is at most 0.008


def draw(n, temperature=1.0, top_p=1.0, top_k=0, seed=None, position=None, logits=None):
    logits = torch.tensor([math.log(p) for p in PROBS]).repeat(n, 1) if logits is None else logits
    full = lambda v, dt: torch.full((n,), v, dtype=dt)  # noqa: E731
    return sample(
        logits,
        full(temperature, torch.float32),
        full(top_p, torch.float32),
        full(top_k, torch.int64),
        torch.arange(n, dtype=torch.int64) * 7919 + 1 if seed is None else seed,
        full(5, torch.int64) if position is None else position,
    )


def freqs(ids: torch.Tensor) -> list[float]:
    return (torch.bincount(ids, minlength=len(PROBS)).double() / ids.numel()).tolist()


@pytest.mark.parametrize(
    "kw, want",
    [
        ({}, PROBS),
        # T = 0.5 squares the probabilities, renormalised
        ({"temperature": 0.5}, [p * p / sum(q * q for q in PROBS) for p in PROBS]),
        # the smallest prefix reaching 0.75 is {0, 1}
        ({"top_p": 0.75}, [0.5 / 0.8, 0.3 / 0.8, 0, 0]),
        ({"top_k": 3}, [p / 0.95 for p in PROBS[:3]] + [0]),
        # top-k first, then top-p over the renormalised top 3: 0.526 + 0.316 reaches 0.75
        ({"top_k": 3, "top_p": 0.75}, [0.5 / 0.8, 0.3 / 0.8, 0, 0]),
    ],
)
def test_draws_follow_the_distribution_over_seeds(kw, want):
    got = freqs(draw(N, **kw))
    for g, w in zip(got, want):
        if w == 0:
            assert g == 0, f"{kw}: a cut token was drawn ({got})"
        else:
            assert abs(g - w) < 0.035, f"{kw}: frequencies {got}, expected about {want}"


def test_draws_follow_the_distribution_over_positions_of_one_seed():
    got = freqs(draw(N, seed=torch.full((N,), 12345), position=torch.arange(N)))
    assert all(abs(g - w) < 0.035 for g, w in zip(got, PROBS)), got


def test_greedy_rows_are_argmax_and_top_k_1_is_greedy():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    temp = torch.tensor([0.0, 1.0, 0.0, 0.7, 2.0, 0.0])
    top_k = torch.tensor([0, 1, 0, 1, 1, 5])
    ids = sample(logits, temp, torch.ones(6), top_k, torch.arange(6), torch.arange(6))
    assert ids.tolist() == logits.argmax(-1).tolist()


def test_a_rows_draw_depends_on_its_own_seed_and_position_only():
    torch.manual_seed(1)
    logits = torch.randn(8, 300)
    temp, top_p, top_k = torch.rand(8) + 0.5, torch.rand(8) * 0.5 + 0.5, torch.tensor([0, 0, 20, 0, 5, 0, 0, 50])
    seed = torch.randint(0, 2**63 - 1, (8,))
    pos = torch.randint(0, 4096, (8,))
    batched = sample(logits, temp, top_p, top_k, seed, pos)
    alone = [int(sample(*(t[i : i + 1] for t in (logits, temp, top_p, top_k, seed, pos)))) for i in range(8)]
    assert batched.tolist() == alone
    again = sample(logits.flip(0), *(t.flip(0) for t in (temp, top_p, top_k, seed, pos)))
    assert again.flip(0).tolist() == alone
    # Another seed or another position draws anew: spread over 300 tokens, some row changes.
    assert sample(logits, temp, top_p, top_k, seed + 1, pos).tolist() != alone
    assert sample(logits, temp, top_p, top_k, seed, pos + 1).tolist() != alone


@pytest.mark.parametrize("temperature", [1e-45, 1e-38, 1e-8, 1e-3])
def test_a_temperature_too_small_to_divide_by_samples_at_the_floor(temperature):
    """logits / 1e-45 overflows float32 to +-inf (softmax NaN), and the draw took the first token
    it kept; a temperature below MIN_TEMPERATURE is raised to it, as vLLM does, so the draw is
    the one at 1e-2: here the top token, whatever the seed, in the same batch as any other row."""
    from components.engine.sampler import MIN_TEMPERATURE

    torch.manual_seed(2)
    logits = torch.randn(64, 300) * 5
    logits[:, 0] = logits.min() - 1  # the first token the least likely
    n = logits.shape[0]
    args = (torch.ones(n), torch.zeros(n, dtype=torch.int64), torch.arange(n), torch.full((n,), 9))
    got = sample(logits, torch.full((n,), temperature), *args)
    assert got.tolist() == sample(logits, torch.full((n,), MIN_TEMPERATURE), *args).tolist()
    # at 1e-2 the top two of these logits are far enough apart that every draw is the top token
    assert got.tolist() == logits.argmax(-1).tolist()
    mixed = torch.tensor([temperature, 1.0] * (n // 2))  # a row's draw does not depend on its neighbours
    assert sample(logits, mixed, *args)[::2].tolist() == got[::2].tolist()
