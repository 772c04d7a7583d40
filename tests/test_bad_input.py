"""OpenAI parameters the engine does not implement are refused with a 400 that names them, never
answered as if they had been honoured.

Dynamo's frontend preprocesses a request into a dict before a worker sees it; `to_request` turns
that into the engine's GenerateRequest. The dicts here are shaped like the real ones, recorded
from the frontend (Dynamo 1.6.1) for the client parameters named beside each case. Parameters the
preprocessing drops (`tools`, `logit_bias`, `suffix`, ...) never reach a worker: the frontend's
guard refuses them from the request body (`body_refusal`), on every endpoint that generates text,
as it refuses bodies Dynamo would repair or could not parse.

The served graph (one module-scoped fixture) answers every bad input with its 4xx before any
stream, and serves the same greedy completion after each as before the first.
"""

from __future__ import annotations

import copy
import json
import re
import socket

import msgspec
import openai
import pytest
from dynamo.llm.exceptions import InvalidArgument

from components.frontend import body_refusal
from components.worker.generate_request import to_request
from harness.server import Server, tokenizer

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


RESPONSES_DROPPED = {
    # Responses API request body fields (Dynamo 1.6.1 answered each 200, as if honoured): the message
    '"tools": [{"type": "function", "name": "f", "parameters": {}}]': "tools is not supported by this engine: "
    "it has no tool calling",
    '"tool_choice": "auto"': 'tool_choice="auto" is not supported by this engine: it has no tool calling',
    '"reasoning": {"effort": "high"}': "reasoning is not supported by this engine: it has no reasoning budget",
    '"include": ["message.output_text.logprobs"]': "include is not supported by this engine: it adds nothing",
    '"top_logprobs": 3': "top_logprobs=3 is not supported by this engine: it returns no log probabilities",
    '"truncation": "auto"': 'truncation="auto" is not supported by this engine: it does not truncate the input',
    '"conversation": "conv_1"': 'conversation="conv_1" is not supported by this engine: it keeps no conversations',
    '"store": true': "store=true is not supported by this engine: it stores no responses",
    '"presence_penalty": 1.5': "presence_penalty=1.5 is not supported by this engine: it applies no sampling penalties",
    '"frequency_penalty": 0.5': "frequency_penalty=0.5 is not supported by this engine",
}


# (the endpoints, the field its text goes in, the fields dropped, the message)
DROPPED_CASES = [
    *((("/v1/completions", "/v1/chat/completions"), "prompt", f, says) for f, says in DROPPED.items()),
    *((("/v1/responses", "/v1/responses/input_tokens"), "input", f, says) for f, says in RESPONSES_DROPPED.items()),
]


@pytest.mark.parametrize("paths, text, fields, says", DROPPED_CASES, ids=[c[0][0] + " " + c[2] for c in DROPPED_CASES])
def test_a_parameter_dynamo_drops_is_refused_by_name(paths, text: str, fields: str, says: str) -> None:
    body = f'{{"model": "m", "{text}": "hi", {fields}}}'.encode()
    for path in paths:
        assert body_refusal(path, body).startswith(says), path


NESTED = b'{"model": "m", "prompt": "hi", "x": ' + b"[" * 2000 + b"]" * 2000 + b"}"
# (body, the message): what Dynamo repairs (U+FFFD for invalid UTF-8, escapes for raw control
# characters) and answers as if sent so, and what made the guard's own parse raise (a 500).
MALFORMED = {
    "prompt with \\xff\\xfe": (
        b'{"model": "m", "prompt": "a\xff\xfeb"}',
        "the request body is not valid UTF-8: byte 0xff at offset 27",
    ),
    "chat message with \\xc3\\x28": (
        b'{"model": "m", "messages": [{"role": "user", "content": "a\xc3\x28b"}]}',
        "the request body is not valid UTF-8: byte 0xc3 at offset 58",
    ),
    "raw NUL in a string": (
        b'{"model": "m", "prompt": "a\x00b"}',
        "the request body holds a raw control character (0x00) in a JSON string at line 1 column 28: "
        "JSON strings escape it (\\u0000)",
    ),
    "raw newline in a string": (
        b'{"model": "m", "prompt": "a\nb"}',
        "the request body holds a raw control character (0x0a) in a JSON string at line 1 column 28",
    ),
    "2,000 levels of nesting": (NESTED, "the request body's JSON is nested too deeply"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_body_dynamo_would_repair_or_the_guard_could_not_parse_is_refused(case: str) -> None:
    body, says = MALFORMED[case]
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/unknown"):
        assert body_refusal(path, body).startswith(says), path


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
    assert body_refusal("/v1/completions", ('{"model": "m", "prompt": "hi"' + fields + "}").encode()) is None


def test_neutral_values_and_what_it_implements_pass_the_responses_api() -> None:
    body = (
        b'{"model": "m", "input": "hi", "instructions": "be brief", "tools": [], "tool_choice": "none", '
        b'"include": [], "top_logprobs": 0, "truncation": "disabled", "store": false, "presence_penalty": 0, '
        b'"user": "u", "metadata": {"k": "v"}, "safety_identifier": "s", "prompt_cache_key": "k", '
        b'"service_tier": "auto", "parallel_tool_calls": true}'
    )
    assert body_refusal("/v1/responses", body) is None


def test_bodies_dynamo_refuses_itself_pass_the_guard_unread() -> None:
    # escaped control characters and non-ASCII text are valid: passed on
    for body in (
        b"{not json",
        b"[1, 2]",
        b'"tools"',
        b"",
        b'{"prompt": "a\\u0000b \xc3\xa9"}',
        b"[" * 200 + b"]" * 200,
    ):
        assert body_refusal("/v1/completions", body) is None


# ---------------------------------------------------------------------------------------------
# end to end: Dynamo's frontend turns the refusal into a 400 the OpenAI client raises


BODY_TIMEOUT_S = 2


@pytest.fixture(scope="module")
def server():
    srv = Server(["--Planner.enabled=false", f"--Frontend.body_timeout_s={BODY_TIMEOUT_S}"])
    try:
        yield srv
    finally:
        srv.stop()


GREEDY = {"prompt": "The quick brown fox", "max_tokens": 6, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def greedy(server) -> str:
    """The served greedy completion of GREEDY before any bad input."""
    return completion(server, GREEDY)


def completion(server, body: dict) -> str:
    r = server.http.post("/v1/completions", json={"model": server.model, **body})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def still_serving(server, greedy: str) -> None:
    """The service answers as before: the same greedy completion, unary and streamed."""
    assert completion(server, GREEDY) == greedy
    ids = tokenizer().encode(GREEDY["prompt"]).ids
    assert server.stream_text(ids, GREEDY["max_tokens"]) == completion(server, {**GREEDY, "prompt": ids})


def refused(r, status: int, says: str) -> None:
    """`r` is a refusal in Dynamo's error shape, never a stream, whose message starts with `says`."""
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json"), r.headers
    assert r.json()["message"].startswith(says) and r.json()["code"] == status, r.json()


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


def test_deeply_nested_json_is_a_400_on_every_endpoint(server, greedy) -> None:
    """2,000 levels of nesting made the guard's parse raise RecursionError: a 500."""
    for path, field in (
        ("/v1/completions", "prompt"),
        ("/v1/chat/completions", "messages"),
        ("/v1/responses", "input"),
    ):
        body = b'{"model": "%s", "%s": "hi", "x": ' % (server.model.encode(), field.encode())
        r = server.http.post(path, content=body + b"[" * 2000 + b"]" * 2000 + b"}")
        refused(r, 400, "the request body's JSON is nested too deeply")
    still_serving(server, greedy)


def test_the_responses_api_refuses_what_it_would_drop(server, greedy) -> None:
    """`/v1/responses` with `tools` was answered 200 as if the tools were offered to the model."""
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
    tool = {"type": "function", "name": "f", "parameters": {"type": "object"}}
    with pytest.raises(openai.BadRequestError, match="tools is not supported by this engine: it has no tool calling"):
        client.responses.create(model=server.model, input="hi", max_output_tokens=4, tools=[tool])
    with pytest.raises(openai.BadRequestError, match="reasoning is not supported by this engine"):
        client.responses.create(model=server.model, input="hi", max_output_tokens=4, reasoning={"effort": "high"})
    for extra, says in (
        ({"presence_penalty": 1.5}, "presence_penalty=1.5 is not supported"),
        ({"include": ["message.output_text.logprobs"]}, "include is not supported"),
        ({"stream": True, "top_logprobs": 2}, "top_logprobs=2 is not supported"),
    ):
        r = server.http.post("/v1/responses", json={"model": server.model, "input": "hi", **extra})
        refused(r, 400, says)
    r = server.http.post("/v1/responses/input_tokens", json={"model": server.model, "input": "hi", "tools": [tool]})
    refused(r, 400, "tools is not supported")
    ok = client.responses.create(
        model=server.model, input="hi", max_output_tokens=4, instructions="be brief", user="alice", temperature=0
    )
    assert ok.usage.output_tokens == 4 and ok.output_text
    still_serving(server, greedy)


def test_invalid_utf8_and_raw_control_characters_are_refused(server, greedy) -> None:
    """Dynamo replaced them (U+FFFD, escapes) and answered the request it made up."""
    m = server.model.encode()
    for path, body, says in (
        (
            "/v1/completions",
            b'{"model": "%s", "prompt": "a\xff\xfeb", "max_tokens": 2}' % m,
            "the request body is not valid UTF-8: byte 0xff at offset",
        ),
        (
            "/v1/chat/completions",
            b'{"model": "%s", "messages": [{"role": "user", "content": "a\xc3\x28b"}], "max_tokens": 2}' % m,
            "the request body is not valid UTF-8: byte 0xc3 at offset",
        ),
        ("/v1/responses", b'{"model": "%s", "input": "a\xffb"}' % m, "the request body is not valid UTF-8"),
        (
            "/v1/completions",
            b'{"model": "%s", "prompt": "a\x00b", "max_tokens": 2}' % m,
            "the request body holds a raw control character (0x00) in a JSON string at line 1 column",
        ),
    ):
        refused(server.http.post(path, content=body, headers={"content-type": "application/json"}), 400, says)
    # escaped, the same characters are text like any other
    assert completion(server, {**GREEDY, "prompt": "a\u0000b \u00e9"}) is not None
    still_serving(server, greedy)


def test_a_temperature_too_small_to_divide_by_samples_at_the_floor(server, greedy) -> None:
    """temperature 1e-45 overflowed the scaled logits: one token, the eos, finish_reason stop.
    Below 1e-2 a request samples at 1e-2, as vLLM does (components/engine/sampler.py)."""
    body = {"model": server.model, "prompt": "The quick brown fox", "max_tokens": 8, "seed": 3}
    floor = server.http.post("/v1/completions", json={**body, "temperature": 1e-2}).json()
    assert floor["usage"]["completion_tokens"] == 8 and floor["choices"][0]["finish_reason"] == "length"
    for t in (1e-45, 1e-38, 1e-6):
        got = server.http.post("/v1/completions", json={**body, "temperature": t}).json()
        assert (got["choices"], got["usage"]) == (floor["choices"], floor["usage"]), t
    still_serving(server, greedy)


def test_a_refused_stream_gets_its_4xx_before_any_stream(server, greedy) -> None:
    """The worker's refusal came as an error event inside a 200 stream."""
    m = server.model
    chat = {"model": m, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
    plain = {"model": m, "prompt": "hi", "max_tokens": 3, "stream": True}
    for path, body, says in (
        ("/v1/completions", {**plain, "n": 2}, "n=2 is not supported by this engine"),
        ("/v1/completions", {**plain, "echo": True}, "echo / prompt_logprobs is not supported"),
        ("/v1/completions", {**plain, "logprobs": 1}, "logprobs / top_logprobs is not supported"),
        ("/v1/chat/completions", {**chat, "logprobs": True}, "logprobs / top_logprobs is not supported"),
        ("/v1/completions", {**plain, "max_tokens": 100000}, "this model's context is"),
        (
            "/v1/responses",
            {"model": m, "input": "hi", "stream": True, "text": {"format": {"type": "json_object"}}},
            "response_format / guided decoding is not supported",
        ),
    ):
        refused(server.http.post(path, json=body), 400, says)
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError, match="n=2 is not supported"):
        client.completions.create(model=m, prompt="hi", max_tokens=3, n=2, stream=True)
    # a stream the worker serves still starts with its first token: Responses' preamble included
    events = [e.type for e in client.responses.create(model=m, input="hi", max_output_tokens=2, stream=True)]
    assert events[:2] == ["response.created", "response.in_progress"] and "response.output_text.delta" in events
    chunks = list(client.chat.completions.create(**{**chat, "max_tokens": 2}))
    assert chunks[-1].choices[0].finish_reason == "length"
    still_serving(server, greedy)


def test_an_out_of_range_token_id_is_named_with_its_index_and_the_range(server, greedy) -> None:
    """Dynamo refuses them with a bare "Invalid request" (a negative one: "data did not match any
    variant of untagged enum Prompt"); the built-in model has 512 token ids."""
    m, range_ = server.model, "is outside the vocabulary: valid ids are 0 to 511"
    for prompt, stream, says in (
        ([1, 2, 999999], False, f"prompt token id 999999 at index 2 {range_}"),
        ([1, 2, 512], True, f"prompt token id 512 at index 2 {range_}"),
        ([5, -1], False, f"prompt token id -1 at index 1 {range_}"),
        ([[1, 2], [3, 4, 70000]], False, f"prompt 1: token id 70000 at index 2 {range_}"),
    ):
        r = server.http.post("/v1/completions", json={"model": m, "prompt": prompt, "max_tokens": 2, "stream": stream})
        refused(r, 400, says)
    assert completion(server, {"prompt": [1, 2, 511], "max_tokens": 2}) is not None  # the last id is fine
    still_serving(server, greedy)


def test_a_body_shorter_than_its_content_length_gets_a_408(server, greedy) -> None:
    """The connection was held until the client gave up; now the body has Frontend.body_timeout_s
    (BODY_TIMEOUT_S here) to arrive, and the connection is closed after the 408."""
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=60) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"model": '
        )
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 Request Timeout") and b"Connection: close" in head, head
    assert json.loads(body) == {
        "message": f"the request body did not arrive in full of the 100 bytes announced within {BODY_TIMEOUT_S} s "
        "(Frontend.body_timeout_s)",
        "type": "Request Timeout",
        "code": 408,
    }
    still_serving(server, greedy)


def test_dynamos_admin_routes_are_not_served_on_the_openai_port(server, greedy) -> None:
    """POST /busy_threshold (Dynamo's load-shedding thresholds) went through the guard to any
    client; writes outside /v1/ are refused, reads (health, metrics, models) still answer."""
    for path in ("/busy_threshold", "/clear_kv_blocks", "/anything"):
        refused(
            server.http.post(path, json={"model": server.model, "active_decode_blocks_threshold": 0.1}), 404, "POST"
        )
    assert server.http.get("/health").status_code == 200
    assert server.http.get("/v1/models").status_code == 200
    still_serving(server, greedy)
