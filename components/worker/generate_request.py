"""The generate endpoint's request: Dynamo's preprocessed request as the engine's, refused where
it asks for what the engine does not implement, and the usage a stream's last chunk reports."""

from __future__ import annotations

import uuid
from typing import Any


def to_request(raw: dict[str, Any], max_len: int):
    """Dynamo's preprocessed request -> the engine's GenerateRequest; InvalidArgument (the
    frontend answers 400 with its message) for a parameter the engine does not implement."""
    from dynamo.llm.exceptions import InvalidArgument

    from components.engine.request import GenerateRequest

    # What the frontend passes on but leaves to the engine, which does not implement it: answering
    # as if it were honoured would be silently wrong. (section, field, the values that mean "off",
    # the name(s) a client sets it by, why). Not here: what the frontend implements itself (`stop`
    # strings, `stop_token_ids`, `include_stop_str_in_output`, `skip_special_tokens`) or refuses
    # itself (`use_beam_search`, `length_penalty`).
    unsupported = (
        ("sampling_options", "n", (1,), "n", "it returns one completion per request"),
        ("sampling_options", "best_of", (1,), "best_of", "it returns one completion per request"),
        ("sampling_options", "presence_penalty", (0,), "presence_penalty", "it applies no sampling penalties"),
        ("sampling_options", "frequency_penalty", (0,), "frequency_penalty", "it applies no sampling penalties"),
        ("sampling_options", "repetition_penalty", (1,), "repetition_penalty", "it applies no sampling penalties"),
        ("sampling_options", "min_p", (0,), "min_p", "it samples by temperature, top_k, top_p and seed only"),
        ("sampling_options", "guided_decoding", (), "response_format / guided decoding", "it has no guided decoding"),
        ("output_options", "logprobs", (), "logprobs / top_logprobs", "it returns no log probabilities"),
        # Completions' `echo` arrives as prompt_logprobs.
        ("output_options", "prompt_logprobs", (), "echo / prompt_logprobs", "it returns no prompt or prompt logprobs"),
        ("stop_conditions", "min_tokens", (0,), "min_tokens", "it stops at the first eos sampled"),
        ("stop_conditions", "max_thinking_tokens", (), "max_thinking_tokens", "it has no thinking budget"),
    )
    for section, field, off, name, why in unsupported:
        value = (raw.get(section) or {}).get(field)
        if value is None or value in off:
            continue
        shown = f"{value:.6g}" if isinstance(value, float) else value
        given = f"{name}={shown}" if name == field and not isinstance(value, dict) else name
        raise InvalidArgument(f"{given} is not supported by this engine: {why}")

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
        top_k=max(0, samp.get("top_k") or 0),  # -1 and 0 both mean no cut, as in vLLM
        seed=samp.get("seed"),
        stop_token_ids=list(stop.get("stop_token_ids_hidden") or []),
        ignore_eos=bool(stop.get("ignore_eos")),
        replay=int(raw.get("replay") or 0),  # set by a rank handing the request over (hand_over)
    )


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
