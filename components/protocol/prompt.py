"""What a prompt of token ids must hold, said the same way by the frontend's guard and a rank."""

from __future__ import annotations

from collections.abc import Sequence


def out_of_vocabulary(prompt: Sequence[int], vocab: int) -> str | None:
    """The first token id of `prompt` outside a vocabulary of `vocab` ids, with its index and the
    valid range, or None."""
    for i, t in enumerate(prompt):
        if not 0 <= t < vocab:
            return f"token id {t} at index {i} is outside the vocabulary: valid ids are 0 to {vocab - 1}"
    return None
