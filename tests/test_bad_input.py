"""OpenAI parameters the engine does not implement are refused with a 400 that names them, never
answered as if they had been honoured.

Dynamo's frontend preprocesses a request into a dict before a worker sees it; `to_request` turns
that into the engine's GenerateRequest. The dicts here are shaped like the real ones, recorded
from the frontend (Dynamo 1.6.1) for the client parameters named beside each case. Parameters the
preprocessing drops (`tools`, `logit_bias`, `suffix`, ...) never reach a worker: the frontend's
guard refuses them from the request body (`dropped_parameter`).
"""

from __future__ import annotations

import copy
import re

import msgspec
import openai
import pytest
from dynamo.llm.exceptions import InvalidArgument

from components.frontend import dropped_parameter
from components.worker.generate_request import to_request
from harness.server import Server

MAX_LEN = 1024

# POST /v1/completions {"prompt": "hello", "max_tokens": 3}, as the worker receives it
PLAIN = {
    "token_ids": [487, 112, 115],
    "annotations": [],
    "eos_token_ids": [1, 3],
    "mdc_sum": "863f12e1cb89cbe647f27710aed578e620631602465be82890cba2e472e956c0",
    "model": "elastic-ep/tiny-moe",
    "output_options": {
        "formatted_prompt": None,
        "logprobs": None,
        "prompt_logprobs": None,
        "return_tokens_as_token_ids": None,
        "skip_special_tokens": None,
    },
    "router_config_override": None,
    "routing": {},
    "sampling_options": {
        "best_of": None,
        "frequency_penalty": None,
        "guided_decoding": None,
        "include_stop_str_in_output": None,
        "length_penalty": None,
        "min_p": None,
        "n": None,
        "presence_penalty": None,
        "repetition_penalty": None,
        "seed": None,
        "temperature": None,
        "top_k": None,
        "top_p": None,
        "use_beam_search": None,
    },
    "stop_conditions": {
        "ignore_eos": None,
        "max_thinking_tokens": None,
        "max_tokens": 3,
        "min_tokens": None,
        "stop": None,
        "stop_token_ids": None,
        "stop_token_ids_hidden": [1, 3],
        "stop_token_ids_visible": None,
    },
}


def shaped(section: str, **fields) -> dict:
    raw = copy.deepcopy(PLAIN)
    raw[section].update(fields)
    return raw


REFUSED = {
    # client parameter(s): (section, fields as they arrive, the message names)
    "n=2": ("sampling_options", {"n": 2}, "n=2 is not supported by this engine"),
    "best_of=2": ("sampling_options", {"best_of": 2}, "best_of=2 is not supported"),
    "presence_penalty=0.5": ("sampling_options", {"presence_penalty": 0.5}, "presence_penalty=0.5 is not supported"),
    "frequency_penalty=0.5": ("sampling_options", {"frequency_penalty": 0.5}, "frequency_penalty=0.5"),
    # an f32 on the way: shown as the client wrote it
    "repetition_penalty=1.3": (
        "sampling_options",
        {"repetition_penalty": 1.2999999523162842},
        "repetition_penalty=1.3",
    ),
    "min_p=0.1": ("sampling_options", {"min_p": 0.10000000149011612}, "min_p=0.1"),
    "response_format json_object": (
        "sampling_options",
        {"guided_decoding": {"json": {"type": "object"}}},
        "response_format / guided decoding is not supported",
    ),
    "completions logprobs=2": ("output_options", {"logprobs": 2}, "logprobs / top_logprobs is not supported"),
    "completions logprobs=0": ("output_options", {"logprobs": 0}, "logprobs / top_logprobs"),
    "chat logprobs=true top_logprobs=3": ("output_options", {"logprobs": 3}, "logprobs / top_logprobs"),
    "echo=true": ("output_options", {"prompt_logprobs": 1}, "echo / prompt_logprobs is not supported"),
    "min_tokens=2": ("stop_conditions", {"min_tokens": 2}, "min_tokens=2"),
    "nvext max_thinking_tokens=5": ("stop_conditions", {"max_thinking_tokens": 5}, "max_thinking_tokens=5"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_unsupported_parameter_is_refused_by_name(case: str) -> None:
    section, fields, says = REFUSED[case]
    with pytest.raises(InvalidArgument, match="^" + re.escape(says)):
        to_request(shaped(section, **fields), MAX_LEN)


ACCEPTED = {
    # their neutral values, which clients send explicitly (the frontend passes them on)
    "n=1 best_of=1": ("sampling_options", {"n": 1, "best_of": 1}),
    "penalties off": (
        "sampling_options",
        {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0},
    ),
    "top_k=-1": ("sampling_options", {"top_k": -1}),
    "top_k=0 min_p=0": ("sampling_options", {"top_k": 0, "min_p": 0.0}),
    "min_tokens=0": ("stop_conditions", {"min_tokens": 0}),
    # implemented by the frontend itself
    "stop, stop_token_ids": ("stop_conditions", {"stop": ["lo"], "stop_token_ids": [7]}),
    "include_stop_str_in_output": ("sampling_options", {"include_stop_str_in_output": True}),
    "skip_special_tokens=false": ("output_options", {"skip_special_tokens": False}),
}


def plain_fields(raw: dict) -> dict:
    """The GenerateRequest of `raw`, but its (random) id."""
    fields = msgspec.structs.asdict(to_request(raw, MAX_LEN))
    fields.pop("request_id")
    return fields


@pytest.mark.parametrize("case", list(ACCEPTED))
def test_neutral_and_frontend_parameters_are_accepted(case: str) -> None:
    section, fields = ACCEPTED[case]
    assert plain_fields(shaped(section, **fields)) == plain_fields(PLAIN)


def test_supported_parameters_reach_the_engine() -> None:
    raw = shaped("sampling_options", temperature=0.5, top_p=0.8999999761581421, top_k=5, seed=3)
    raw["stop_conditions"]["ignore_eos"] = True
    assert plain_fields(raw) == {
        "prompt": [487, 112, 115],
        "max_tokens": 3,
        "temperature": 0.5,
        "top_p": 0.8999999761581421,
        "top_k": 5,
        "seed": 3,
        "stop_token_ids": [1, 3],
        "ignore_eos": True,
        "replay": 0,
    }


DROPPED = {
    # request body fields: the message
    '"tools": [{"type": "function", "function": {"name": "f"}}]': "tools is not supported by this engine: "
    "it has no tool calling",
    '"tool_choice": "auto"': 'tool_choice="auto" is not supported by this engine: it has no tool calling',
    '"tool_choice": {"type": "function", "function": {"name": "f"}}': "tool_choice is not supported by this "
    "engine: it has no tool calling",
    '"logit_bias": {"50256": -100}': "logit_bias is not supported by this engine: it applies no logit bias",
    '"suffix": "end"': 'suffix="end" is not supported by this engine: it has no insertion (suffix) mode',
    '"audio": {"voice": "alloy", "format": "wav"}': "audio is not supported by this engine: it generates text only",
    '"modalities": ["text", "audio"]': "modalities is not supported by this engine: it generates text only",
    '"reasoning_effort": "low"': 'reasoning_effort="low" is not supported by this engine: it has no reasoning budget',
    '"web_search_options": {}': "web_search_options is not supported by this engine: it has no web search",
    '"store": true': "store=true is not supported by this engine: it stores no completions",
}


@pytest.mark.parametrize("fields", list(DROPPED))
def test_a_parameter_the_frontend_drops_is_refused_by_name(fields: str) -> None:
    body = ('{"model": "m", "prompt": "hi", ' + fields + "}").encode()
    assert dropped_parameter(body) == DROPPED[fields]


@pytest.mark.parametrize(
    "fields",
    [
        "",  # nothing of them
        ', "tools": null, "tool_choice": "none", "logit_bias": {}, "suffix": "", "modalities": ["text"]',
        ', "store": false, "user": "alice", "metadata": {"k": "v"}, "service_tier": "auto"',
        ', "parallel_tool_calls": true, "prediction": {"type": "content", "content": "x"}',
    ],
)
def test_neutral_values_and_identifiers_pass_the_frontend(fields: str) -> None:
    assert dropped_parameter(('{"model": "m", "prompt": "hi"' + fields + "}").encode()) is None


def test_bodies_dynamo_refuses_itself_pass_the_guard_unread() -> None:
    for body in (b"{not json", b"[1, 2]", b'"tools"'):
        assert dropped_parameter(body) is None


# ---------------------------------------------------------------------------------------------
# end to end: Dynamo's frontend turns the refusal into a 400 the OpenAI client raises


@pytest.fixture(scope="module")
def server():
    srv = Server(["--Planner.enabled=false"])
    try:
        yield srv
    finally:
        srv.stop()


def test_served_graph_answers_400_naming_the_parameter(server) -> None:
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
    model, prompt = server.model, "The quick brown fox"
    with pytest.raises(openai.BadRequestError, match="n=2 is not supported") as e:
        client.completions.create(model=model, prompt=prompt, max_tokens=4, n=2)
    assert e.value.status_code == 400
    with pytest.raises(openai.BadRequestError, match="logprobs / top_logprobs is not supported"):
        client.completions.create(model=model, prompt=prompt, max_tokens=4, logprobs=2)
    with pytest.raises(openai.BadRequestError, match="echo / prompt_logprobs is not supported"):
        client.completions.create(model=model, prompt=prompt, max_tokens=4, echo=True)
    with pytest.raises(openai.BadRequestError, match="logprobs / top_logprobs is not supported"):
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4, logprobs=True, top_logprobs=2
        )
    # Dropped by Dynamo's preprocessing: refused by the frontend's guard, in Dynamo's error shape.
    with pytest.raises(
        openai.BadRequestError, match='^Error code: 400 - .*suffix="end" is not supported by this engine'
    ):
        client.completions.create(model=model, prompt=prompt, max_tokens=4, suffix="end")
    with pytest.raises(openai.BadRequestError, match="logit_bias is not supported by this engine"):
        client.completions.create(model=model, prompt=prompt, max_tokens=4, logit_bias={"5": 10})
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError, match="tools is not supported by this engine: it has no tool calling"):
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4, tools=[tool]
        )
    r = server.http.post(
        "/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "tool_choice": "auto"},
    )
    assert (r.status_code, r.json()) == (
        400,
        {
            "message": 'tool_choice="auto" is not supported by this engine: it has no tool calling',
            "type": "Bad Request",
            "code": 400,
        },
    )
    ok = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0, n=1, presence_penalty=0)
    assert len(ok.choices) == 1 and ok.choices[0].finish_reason in ("length", "stop") and ok.usage.completion_tokens
    ok = client.completions.create(model=model, prompt=prompt, max_tokens=4, user="alice", suffix="", logit_bias={})
    assert ok.usage.completion_tokens
