"""What a rank is asked to generate and what it streams back (msgspec: these cross processes)."""

from __future__ import annotations

import msgspec


class GenerateRequest(msgspec.Struct, frozen=True):
    request_id: str
    prompt: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False


class TokenOutput(msgspec.Struct):
    request_id: str
    token_ids: list[int]
    finish_reason: str | None = None  # "length" | "stop" | "eos" | "cancelled" | "error: ..."


class RequestError(ValueError):
    """The request cannot be served as given (too long, empty prompt, bad sampling values)."""
