"""Lone-request time to first token: `dynamo serve graphs/elastic:Frontend` (options after `--`)
answers one streaming completion at a time, back to back on one keep-alive connection as a
client sending request after request would, through the frontend's port (the guard in front of
Dynamo's OpenAI service) and straight to Dynamo's own port, for a few prompt lengths.

TTFT is from sending the request to the first streamed chunk with a choice in it; "total" until
the stream ends. Each length's prompt is one whose generated tokens each stream as they come
(`streamed_prompt`). A request that waits on the idle engine, the request plane or a socket shows
here as a floor under every prompt length; the prompt's own prefill grows with its length.
`--gap-s` idles between requests (a delayed ACK that Nagle's algorithm waits for shows only
while requests follow each other within about 100 ms). `--burst N` then sends N prompts of
`--burst-len` tokens at once through the frontend, one token out each, from one asyncio client
whose connections are open before the clock starts, and reports the wall time from the first
send to the last answer, prompt tokens per second over it, and TTFT p50 and max: prompts
prefilled side by side. Prints a table and writes JSON (`--out`).

    python -m bench.ttft                                   # CPU, built-in model, 2 ranks
    python -m bench.ttft --lengths 4,64 -- --Worker.dp_size=1
    python -m bench.ttft --lengths 128 --burst 32 --burst-len 1024 -- --Worker.max_seqs=32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import time
from pathlib import Path

import aiohttp
import httpx
import uvloop

from bench.measure import write_results
from harness.server import Server, sse_data


def prompt(n: int, shift: int = 0) -> list[int]:
    return [(7 * i + 3 + shift) % 500 + 5 for i in range(n)]  # ids of the built-in model's 512


def one(client: httpx.Client, model: str, tokens: list[int], max_tokens: int) -> tuple[float, float, int]:
    """(TTFT, total) in ms of one greedy streaming completion, and its chunks with a choice."""
    body = {"model": model, "prompt": tokens, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    body["ignore_eos"] = True
    t0 = time.perf_counter()
    first, chunks = None, 0
    with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read().decode()}")
        for data in sse_data(r):
            if json.loads(data).get("choices"):
                chunks += 1
                first = first or time.perf_counter()
    end = time.perf_counter()
    if first is None:
        raise RuntimeError("the stream carried no tokens")
    return (first - t0) * 1e3, (end - t0) * 1e3, chunks


def streamed_prompt(client: httpx.Client, model: str, n: int, max_tokens: int) -> list[int]:
    """A prompt of `n` tokens whose every generated token streams as a chunk of its own: Dynamo
    holds back a token that ends inside a UTF-8 character (byte tokens, which the tiny model
    draws often), and a first chunk held to the stream's end would time the whole stream."""
    for shift in range(50):
        tokens = prompt(n, shift)
        if one(client, model, tokens, max_tokens)[2] == max_tokens:
            return tokens
    raise RuntimeError(f"no prompt of {n} tokens whose {max_tokens} tokens each stream as they come")


def dynamo_port(srv: Server, timeout_s: float = 30) -> int:
    """Dynamo's own OpenAI port, which the frontend logs once its guard listens."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        m = re.search(r"Dynamo's own on 127\.0\.0\.1:(\d+)", srv.output)
        if m:
            return int(m.group(1))
        time.sleep(0.2)
    raise RuntimeError("the frontend logged no port of Dynamo's own service")


def summary(ms: list[float]) -> dict:
    q = statistics.quantiles(ms, n=10)
    return {"p50": statistics.median(ms), "p90": q[-1], "min": min(ms), "max": max(ms)}


async def _first_token(session: aiohttp.ClientSession, model: str, tokens: list[int]) -> float:
    """TTFT in ms of one greedy streaming completion of one token, its stream read to the end."""
    body = {"model": model, "prompt": tokens, "max_tokens": 1, "temperature": 0, "stream": True, "ignore_eos": True}
    t0, first = time.perf_counter(), None
    async with session.post("/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {await r.text()}")
        async for line in r.content:  # an event's JSON holds no raw newline
            if first is None and line.startswith(b"data: {") and json.loads(line[6:]).get("choices"):
                first = time.perf_counter()
    if first is None:
        raise RuntimeError("the stream carried no tokens")
    return (first - t0) * 1e3


async def _burst(base: str, model: str, prompts: list[list[int]]) -> tuple[float, list[float]]:
    async with aiohttp.ClientSession(base, connector=aiohttp.TCPConnector(limit=0)) as session:
        # A connection per prompt, open before the clock starts, as a pooled client holds them:
        # a connect is the client's cost, not the server's prefill.
        await asyncio.gather(*(_first_token(session, model, p[:1]) for p in prompts))
        t0 = time.perf_counter()
        ttft = await asyncio.gather(*(_first_token(session, model, p) for p in prompts))
        return time.perf_counter() - t0, ttft


def burst(base: str, model: str, n: int, length: int) -> dict:
    """`n` prompts of `length` tokens sent at once (a connection each, already open), one token
    out each, from one asyncio client on uvloop: a thread a request (httpx) took 45 ms for the
    burst on this repo's 2-core CI machine against a server that answers at once."""
    wall, ttft = uvloop.run(_burst(base, model, [prompt(length, shift) for shift in range(n)]))
    return {
        "prompts": n,
        "prompt_tokens": length,
        "wall_s": wall,
        "prompt_tok_per_s": n * length / wall,
        "ttft_ms": {"p50": statistics.median(ttft), "max": max(ttft)},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="4,64,256", help="prompt lengths in tokens (default %(default)s)")
    p.add_argument("--requests", type=int, default=20, help="timed requests per row (default %(default)s)")
    p.add_argument("--warmup", type=int, default=3, help="untimed requests per row (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=4, help="tokens each request generates (default %(default)s)")
    p.add_argument("--gap-s", type=float, default=0.0, help="idle between requests (default %(default)s)")
    p.add_argument("--burst", type=int, default=0, help="prompts sent at once after the lone rows (default: none)")
    p.add_argument("--burst-len", type=int, default=1024, help="tokens of each burst prompt (default %(default)s)")
    p.add_argument("--out", type=Path, default=Path("bench/results/ttft.json"), help="JSON output path")
    p.add_argument("graph_args", nargs="*", help="extra `dynamo serve` options after --")
    args = p.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    srv = Server(args.graph_args, model=None)
    rows, bursts = [], []
    prompts: dict[int, list[int]] = {}  # the same prompts on both targets
    try:
        targets = {"frontend": srv.url.rsplit("/v1", 1)[0], "dynamo": f"http://127.0.0.1:{dynamo_port(srv)}"}
        for name, base in targets.items():
            with httpx.Client(base_url=base, timeout=120) as client:
                for n in lengths:
                    if n not in prompts:
                        prompts[n] = streamed_prompt(client, srv.model, n, args.max_tokens)
                    tokens = prompts[n]
                    runs = []
                    for i in range(args.warmup + args.requests):
                        r = one(client, srv.model, tokens, args.max_tokens)
                        if i >= args.warmup:
                            runs.append(r)
                        time.sleep(args.gap_s)
                    rows.append(
                        {
                            "target": name,
                            "prompt_tokens": n,
                            "prompt": tokens,
                            "ttft_ms": summary([r[0] for r in runs]),
                            "total_ms": summary([r[1] for r in runs]),
                            "ttft_each_ms": [round(r[0], 2) for r in runs],
                        }
                    )
        if args.burst:
            one_at_once = burst(targets["frontend"], srv.model, 1, args.burst_len)  # warms the length's path
            bursts = [one_at_once, burst(targets["frontend"], srv.model, args.burst, args.burst_len)]
    finally:
        srv.stop()
    result = {
        "command": " ".join(["python -m bench.ttft", *sys.argv[1:]]),
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "gap_s": args.gap_s,
        "rows": rows,
        "bursts": bursts,
    }
    write_results(args.out, result)
    print(f"lone requests back to back, {args.requests} a row, {args.max_tokens} tokens each; ms")
    print(f"{'target':10} {'prompt':>6} {'TTFT p50':>9} {'p90':>7} {'min':>7} {'max':>7} {'total p50':>10}")
    for r in rows:
        t = r["ttft_ms"]
        print(
            f"{r['target']:10} {r['prompt_tokens']:>6} {t['p50']:>9.1f} {t['p90']:>7.1f} {t['min']:>7.1f} "
            f"{t['max']:>7.1f} {r['total_ms']['p50']:>10.1f}"
        )
    for b in bursts:
        print(
            f"{b['prompts']} prompts of {b['prompt_tokens']} at once, 1 token out: {b['wall_s']:.3f} s, "
            f"{b['prompt_tok_per_s']:,.0f} prompt tok/s, "
            f"TTFT p50 {b['ttft_ms']['p50']:.1f} max {b['ttft_ms']['max']:.1f} ms"
        )


if __name__ == "__main__":
    main()
