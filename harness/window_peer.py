"""One rank of a peer-window exchange check (tests/test_gpu_ep_window.py, bench): a process with a
PeerWindows mailbox that exchanges seeded rows with its peers, eagerly and from a CUDA graph,
checks every returned row against what the experts stand-in must give, and times the exchange.

Protocol on stdio: the process prints its metadata (base64 msgpack) on one line, reads every
rank's on one line of stdin (JSON list), then prints one JSON result line."""

from __future__ import annotations

import argparse
import base64
import json
import sys
import time

import msgspec
import torch


def experts(x: torch.Tensor, slots: torch.Tensor, zero_unrouted: bool = True) -> torch.Tensor:
    """A stand-in for the experts with an exact expectation: row * (slot + 1); for slot -1 zeros,
    or NaN where the exchange says it reads no such row (a row it read would show)."""
    rest = 0.0 if zero_unrouted else float("nan")
    return torch.where((slots >= 0).unsqueeze(1), x * (slots + 1).to(x.dtype).unsqueeze(1), rest)


def make_step(rank: int, ranks: list[int], step: int, rows: int, hidden: int, slots: int, max_ranks: int, dtype, dev):
    """Seeded rows for `ranks`, sorted by destination, with a count for each of the `max_ranks`
    (the exchange reads that many: fewer would be read past their end)."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(rows, hidden, generator=g).to(dtype)
    dest = torch.tensor(ranks)[torch.randint(len(ranks), (rows,), generator=g)]
    local = torch.randint(slots, (rows,), generator=g, dtype=torch.int32)
    order = torch.argsort(dest, stable=True)
    counts = torch.bincount(dest, minlength=max_ranks)
    return x[order].to(dev), local[order].to(dev), counts.to(dev)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--max-ranks", type=int, default=4)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--silent-peer", type=int, default=-1, help="this peer never sends (timeout check)")
    args = ap.parse_args()
    from components.engine.exchange.windows import PeerWindows, WindowMetadata
    from components.engine.weights.same_node import node_id

    dev = torch.device(args.device)
    torch.cuda.set_device(dev)
    R, dtype, S = args.max_ranks, torch.bfloat16, 4
    win = PeerWindows(args.rank, R, args.rows, args.hidden, dtype, dev, node_id(), timeout_s=2.0)
    mask = win.mask
    print(base64.b64encode(msgspec.msgpack.encode(win.metadata())).decode(), flush=True)
    metas = [msgspec.msgpack.decode(base64.b64decode(m), type=WindowMetadata) for m in json.loads(sys.stdin.readline())]
    ranks = list(range(len(metas)))
    for r, m in enumerate(metas):
        win.connect(r, m)
    live = [r for r in ranks if r != args.silent_peer]
    mask[ranks] = True
    win.reset()
    out = torch.zeros(args.rows, args.hidden, dtype=dtype, device=dev)
    result: dict = {"rank": args.rank}
    if args.rank == args.silent_peer:
        time.sleep(4)
        print(json.dumps(result), flush=True)
        return

    def check(x, local, counts):
        want = experts(x, local.long())
        sent = torch.arange(args.rows, device=dev) < counts[live].sum()
        return bool(torch.equal(out[sent], want[sent]))

    if args.silent_peer >= 0:
        x, local, counts = make_step(args.rank, live, 0, args.rows, args.hidden, S, R, dtype, dev)
        t0 = time.perf_counter()
        win.exchange(x, local, counts, out, experts)
        torch.cuda.synchronize(dev)
        result["waited_s"] = time.perf_counter() - t0
        try:
            win.check()
            result["error"] = None
        except Exception as e:
            result["error"] = str(e)
        print(json.dumps(result), flush=True)
        return

    eager_ok = True
    for step in range(5):
        x, local, counts = make_step(args.rank, ranks, step, args.rows, args.hidden, S, R, dtype, dev)
        win.exchange(x, local, counts, out, experts)
        win.check()
        eager_ok &= check(x, local, counts)
    result["eager_ok"] = eager_ok
    # One graph for several layers' worth of exchanges, replayed with new data each step.
    sx = torch.zeros(args.rows, args.hidden, dtype=dtype, device=dev)
    sl = torch.zeros(args.rows, dtype=torch.int32, device=dev)
    sc = torch.zeros(R, dtype=torch.int64, device=dev)
    layers = 4
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        win.exchange(sx, sl, sc, out, experts)  # warm up: all ranks do this one too
        torch.cuda.synchronize(dev)
        with torch.cuda.graph(g, stream=stream):
            for _ in range(layers):
                win.exchange(sx, sl, sc, out, experts)
    torch.cuda.current_stream().wait_stream(stream)
    graph_ok, times = True, []
    for step in range(args.iters):
        x, local, counts = make_step(args.rank, ranks, 100 + step, args.rows, args.hidden, S, R, dtype, dev)
        sx.copy_(x)
        sl.copy_(local)
        sc.zero_()
        sc[: counts.numel()].copy_(counts)
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        g.replay()
        torch.cuda.synchronize(dev)
        times.append((time.perf_counter() - t0) / layers)
        win.check()
        graph_ok &= check(x, local, counts)
    times.sort()
    result.update(graph_ok=graph_ok, exchange_us_p50=times[len(times) // 2] * 1e6, exchange_us_p99=times[-2] * 1e6)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
