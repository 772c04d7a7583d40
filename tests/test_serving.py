"""The elastic graph end to end: `dynamo serve graphs/elastic:Frontend` as a user starts it,
OpenAI clients against Dynamo's HTTP frontend, worker ranks running the engine on CPU.

Every answer is judged against the single-rank in-process engine (greedy): same prompt token
ids in, same tokens out (compared as the decoded text, plus the token counts).
One server for the whole module; the last test stops it and checks nothing is left behind.
"""

from __future__ import annotations

import re
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from prometheus_client import CONTENT_TYPE_LATEST

from components.planner.service import parse_prometheus
from harness.server import Server, alive, pids_with_env

MODEL = "elastic-ep/tiny-moe"
MAX_LEN = 4096  # the built-in model's context, which Worker.max_len defaults to; the reference uses the same
MAX_TOKENS = 16
BOOT_TIMEOUT_S = 150  # 2-core CI: four processes import torch and the Dynamo runtime at once


PROMPTS = [
    "Hello! How are you",
    "The quick brown fox",
    "Once upon a time there was",
    "What is the capital of France?",
    "A mixture of experts model routes every token to",
    "one, two, three, four,",
    "The weather is nice in the",
    "Please explain how a language model",
    "How many days are there in a week?",
    "When the cluster grows, new ranks",
    "It liked numbers:",
    "People walk in the park,",
    "Can you help me with my homework?",
    "The router picks the top two experts",
    "Every morning it checked the",
    "Paris is",
]
CHATS = [
    [{"role": "user", "content": "hi"}],
    [
        {"role": "system", "content": "You are a helpful robot."},
        {"role": "user", "content": "What is the capital of France?"},
    ],
]


# ---------------------------------------------------------------------------------------------
# reference: the single-rank engine in this process


class Expected:
    def __init__(self, prompt_ids: list[int], tokens: list[int], finish: str, text: str) -> None:
        self.prompt_ids, self.tokens, self.finish, self.text = prompt_ids, tokens, finish, text

    @property
    def openai_finish(self) -> str:
        return {"length": "length", "eos": "stop", "stop": "stop"}[self.finish]

    def check_usage(self, usage) -> None:
        assert usage is not None
        assert usage.prompt_tokens == len(self.prompt_ids)
        # Whether an eos token is counted is the frontend's business; everything else is exact.
        allowed = {len(self.tokens)} | ({len(self.tokens) - 1} if self.finish == "eos" else set())
        assert usage.completion_tokens in allowed, (usage, self.tokens)


def compute_reference() -> tuple[dict[str, Expected], list[Expected]]:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    from components.engine.models.builtin import builtin_model_dir
    from harness.reference import generate, single_rank

    model_dir = builtin_model_dir()
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    chat_tok = AutoTokenizer.from_pretrained(str(model_dir))
    prompt_ids = [tok.encode(p).ids for p in PROMPTS]
    chat_ids = [
        tok.encode(
            chat_tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False), add_special_tokens=False
        ).ids
        for m in CHATS
    ]
    all_ids = prompt_ids + chat_ids

    eng = single_rank(model_dir, max_len=MAX_LEN)
    eng.start()
    try:
        tokens, ends = generate(eng, all_ids, MAX_TOKENS)
    finally:
        eng.stop()
    exp = [
        Expected(ids, toks, end, tok.decode(toks, skip_special_tokens=True))
        for ids, toks, end in zip(all_ids, tokens, ends)
    ]
    for e in exp:
        assert e.finish in ("length", "eos"), e.finish
    return dict(zip(PROMPTS, exp[: len(PROMPTS)])), exp[len(PROMPTS) :]


# ---------------------------------------------------------------------------------------------
# the served graph


class Stack(Server):
    """The served graph plus the reference answers and the pids `dynamo serve` reported."""

    def __init__(self) -> None:
        super().__init__([], wait=False)
        self.router = str(self.ctl.base_url).rstrip("/")
        self.children: dict[str, int] = {}
        self.expected: dict[str, Expected] = {}
        self.expected_chat: list[Expected] = []
        self.client = openai.OpenAI(base_url=self.url, api_key="unused", max_retries=0, timeout=60)

    def tail(self, n: int = 4000) -> str:
        return self.output[-n:]

    def wait_ready(self, timeout: float) -> None:
        super().wait_ready(timeout)
        self.children = {m[1]: int(m[2]) for m in re.finditer(r"started (\S+) \(pid (\d+)", self.output)}
        assert {"Frontend", "Router", "Worker.0", "Worker.1"} <= set(self.children), self.children


@pytest.fixture(scope="module")
def stack() -> Stack:
    s = Stack()
    try:
        # Computed while the graph boots.
        s.expected, s.expected_chat = compute_reference()
        s.wait_ready(BOOT_TIMEOUT_S)
        yield s
    finally:
        s.stop()


def assert_good_completion(stack: Stack, prompt: str = PROMPTS[0]) -> None:
    exp = stack.expected[prompt]
    c = stack.client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    assert c.choices[0].text == exp.text
    assert c.choices[0].finish_reason == exp.openai_finish


# ---------------------------------------------------------------------------------------------
# 1. OpenAI API, greedy, against the reference


def test_completion_matches_reference(stack: Stack) -> None:
    for prompt in PROMPTS[:2]:
        exp = stack.expected[prompt]
        assert exp.tokens, "reference produced nothing"
        c = stack.client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert c.model == MODEL
        assert c.choices[0].text == exp.text, (prompt, exp.tokens)
        assert c.choices[0].finish_reason == exp.openai_finish
        exp.check_usage(c.usage)


def collect(stream, piece) -> tuple[str, str | None, object, int]:
    """(text, finish reason, usage, choice chunks) of an OpenAI stream; `piece(choice)` is a
    chunk's text (completions and chat deltas keep it in different places)."""
    text, finish, usage, chunks = "", None, None, 0
    for ch in stream:
        if ch.usage is not None:
            usage = ch.usage
        for choice in ch.choices:
            chunks += 1
            text += piece(choice) or ""
            finish = choice.finish_reason or finish
    return text, finish, usage, chunks


def test_completion_stream_matches_reference(stack: Stack) -> None:
    prompt = PROMPTS[2]
    exp = stack.expected[prompt]
    stream = stack.client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, finish, usage, chunks = collect(stream, lambda choice: choice.text)
    assert chunks > 1, "not streamed"
    assert text == exp.text, (prompt, exp.tokens)
    assert finish == exp.openai_finish
    exp.check_usage(usage)


def test_chat_matches_reference(stack: Stack) -> None:
    for messages, exp in zip(CHATS, stack.expected_chat):
        c = stack.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
        msg = c.choices[0].message
        assert msg.role == "assistant"
        assert (msg.content or "") == exp.text, (messages, exp.tokens)
        assert c.choices[0].finish_reason == exp.openai_finish
        exp.check_usage(c.usage)  # prompt_tokens: the frontend applied the same chat template


def test_chat_stream_matches_reference(stack: Stack) -> None:
    messages, exp = CHATS[1], stack.expected_chat[1]
    stream = stack.client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, finish, usage, chunks = collect(stream, lambda choice: choice.delta.content)
    assert chunks > 1, "not streamed"
    assert text == exp.text, (messages, exp.tokens)
    assert finish == exp.openai_finish
    exp.check_usage(usage)


# ---------------------------------------------------------------------------------------------
# 2. concurrency over both ranks


def test_concurrent_requests_spread_over_ranks(stack: Stack) -> None:
    def totals() -> dict[int, int]:
        return {r["rank"]: r["requests_total"] for r in stack.topology()["ranks"]}

    topo = stack.topology()
    assert topo["epoch"] == 1 and topo["active"] == [0, 1], topo
    assert all(r["routable"] for r in topo["ranks"]), topo
    before = totals()

    def one(prompt: str) -> tuple[str, str, str | None]:
        c = stack.client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        return prompt, c.choices[0].text, c.choices[0].finish_reason

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(one, PROMPTS))
    wrong = [(p, t, stack.expected[p].text) for p, t, _ in results if t != stack.expected[p].text]
    assert not wrong, f"{len(wrong)} of {len(results)} differ from the reference: {wrong[:3]}"
    assert [f for _, _, f in results] == [stack.expected[p].openai_finish for p in PROMPTS]

    # The router refreshes rank status every status_interval_s (1 s).
    deadline = time.monotonic() + 15
    while True:
        after = totals()
        delta = {r: after[r] - before.get(r, 0) for r in after}
        if sum(delta.values()) >= len(PROMPTS) and all(delta.get(r, 0) > 0 for r in (0, 1)):
            break
        assert time.monotonic() < deadline, f"requests not spread over both ranks: {delta}"
        time.sleep(0.5)


# ---------------------------------------------------------------------------------------------
# 3. bad requests: OpenAI-style 4xx, and the server keeps serving


def error_of(r: httpx.Response) -> dict:
    body = r.json()
    # Dynamo's frontend answers {"message", "type", "code"}; OpenAI nests it under "error".
    err = body.get("error", body)
    assert isinstance(err, dict) and isinstance(err.get("message"), str) and err["message"], body
    return err


BAD_REQUESTS = {
    # name: (path, body (str = raw bytes sent as JSON), status, message fragment)
    "malformed-json": ("completions", '{"model": "x", "prompt": ', 400, "JSON"),
    "unknown-model": ("completions", {"model": "no-such-model", "prompt": "hi", "max_tokens": 4}, 404, "not found"),
    "max-tokens-over-context": (
        "completions",
        {"model": MODEL, "prompt": "hi", "max_tokens": 100000},
        400,
        "context is 4096 tokens",
    ),
    "chat-max-tokens-over-context": (
        "chat/completions",
        {"model": MODEL, "max_tokens": 100000, "messages": [{"role": "user", "content": "hi"}]},
        400,
        "context is 4096 tokens",
    ),
    "empty-prompt": ("completions", {"model": MODEL, "prompt": "", "max_tokens": 4}, 400, "empty"),
    "chat-no-messages": ("chat/completions", {"model": MODEL, "messages": [], "max_tokens": 4}, 400, "empty"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_is_4xx_and_server_keeps_serving(stack: Stack, case: str) -> None:
    path, body, status, fragment = BAD_REQUESTS[case]
    url = f"{stack.url}/{path}"
    if isinstance(body, str):
        r = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=30)
    else:
        r = httpx.post(url, json=body, timeout=30)
    print(f"{case}: {r.status_code} {r.text}")
    assert r.status_code == status, r.text
    err = error_of(r)
    assert fragment.lower() in err["message"].lower(), err
    assert_good_completion(stack)


def test_bad_request_through_openai_client(stack: Stack) -> None:
    with pytest.raises(openai.NotFoundError):
        stack.client.completions.create(model="no-such-model", prompt="hi", max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="context is 4096 tokens"):
        stack.client.completions.create(model=MODEL, prompt="hi", max_tokens=100000)
    # Streaming: the HTTP status is already 200 when the worker rejects the request, so the
    # rejection arrives as an error event with code 400; the client raises it.
    with pytest.raises(openai.APIError, match="context is 4096 tokens") as info:
        for _ in stack.client.completions.create(model=MODEL, prompt="hi", max_tokens=100000, stream=True):
            pass
    assert isinstance(info.value.body, dict) and info.value.body.get("code") == 400, info.value.body
    assert_good_completion(stack)


def test_dynamo_service_sends_with_nagle_off(stack: Stack) -> None:
    """The frontend turned Nagle off on Dynamo's own listener (components.graph.runtime.
    nodelay_listener), else a stream's first chunk after the headers waits for the guard's
    delayed ACK (40 ms)."""
    assert re.search(r"Dynamo's own on 127\.0\.0\.1:\d+", stack.output), stack.tail()
    assert "keep Nagle's delay" not in stack.output


def test_router_metrics(stack: Stack) -> None:
    r = httpx.get(f"{stack.router}/metrics", timeout=10)
    assert r.status_code == 200
    assert r.headers["content-type"] == CONTENT_TYPE_LATEST
    metrics = parse_prometheus(r.text)
    assert metrics["elastic_router_epoch"] == [({}, 1.0)], r.text
    assert {"rank": "1"} in [labels for labels, _ in metrics["elastic_rank_requests_total"]], r.text


# ---------------------------------------------------------------------------------------------
# 4. shutdown (last: it stops the module's server)


def test_sigterm_stops_everything(stack: Stack) -> None:
    assert_good_completion(stack)
    procs = set(stack.children.values()) | pids_with_env(stack.env_marker)
    assert set(stack.children.values()) <= procs, "children not found by their environment"
    entries = [p for p in stack.discovery_dir.rglob("*") if p.is_file()]
    assert any("instances" in p.parts for p in entries), entries  # the check below means something

    t0 = time.monotonic()
    stack.proc.send_signal(signal.SIGTERM)
    try:
        rc = stack.proc.wait(20)
    except subprocess.TimeoutExpired:
        pytest.fail(f"dynamo serve still running 20 s after SIGTERM:\n{stack.tail()}")
    took = time.monotonic() - t0
    assert rc == 0, stack.tail()
    assert "stopping (terminated)" in stack.output and "all components stopped" in stack.output
    deadline = time.monotonic() + 5
    while (
        left := [p for p in procs if alive(p)] + sorted(pids_with_env(stack.env_marker))
    ) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"processes left after shutdown: {left}"
    assert "SIGKILL" not in stack.output, "a component needed SIGKILL to stop"
    # --discovery-dir is kept; every instance / model entry must be gone from it.
    leftover = [str(p.relative_to(stack.discovery_dir)) for p in stack.discovery_dir.rglob("*") if p.is_file()]
    assert leftover == [], leftover
    print(f"SIGTERM -> exit 0 in {took:.1f} s")
