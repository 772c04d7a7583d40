"""Checksum throughput on a GPU: checksums() (the Triton kernel, kernels/checksum.py) over --gb GiB in
each word type, beside the torch form it replaced and a device copy of the same bytes (which reads
them once and writes them once). A pull that copies and then verifies is bounded by
1 / (1 / copy + 1 / checksum); the "copy and checksum in one pass" row (copy_checksums_later, what a
same-GPU weight pull runs) is measured end to end itself.

`--tiles` times other kernel shapes, ROWSxWARPS/BLOCK_ROWS each (e.g. 8x4/512,16x4/512,8x4/1024);
the first is what kernels/checksum.py uses. JSON: bench/results/checksum.json.

`--host` (no GPU needed) times only the host's share of a copy-and-checksum pull of --gb GiB in
--tensors tensors: building the copying kernel's block table (kernels.checksum.copy_table) and
combining its per-block sums into checksums (checksum._combine), each the median of --repeat calls.
Only the tensors' addresses are read, so their memory is never touched. JSON:
bench/results/checksum_host.json."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from bench.measure import median_ms, write_results
from components.engine.kernels import checksum as ck
from components.engine.weights.checksum import (
    _COLS,
    _ROW_MOD,
    _checksum_torch,
    _combine,
    checksums,
    copy_checksums_later,
)


def host_share(gb: float, tensors: int, repeat: int, out: Path) -> None:
    words = int(gb * 2**30) // 4 // tensors * tensors
    src, dst = (torch.empty(words, dtype=torch.int32) for _ in range(2))  # untouched: addresses only
    pairs = list(zip(dst.view(tensors, -1), src.view(tensors, -1)))
    table_ms = median_ms(lambda: ck.copy_table(pairs, _COLS, _ROW_MOD), repeat)
    _, table = ck.copy_table(pairs, _COLS, _ROW_MOD)
    sums = torch.zeros(table.shape[0], 3, dtype=torch.int64)
    combine_ms = median_ms(lambda: _combine(sums, table[:, 4], tensors), repeat)
    print(f"{words * 4 / 1e9:.2f} GB in {tensors} tensors: {table.shape[0]} blocks ({repeat} calls each, median)")
    print("| host work | ms |\n|---|---|")
    print(f"| block table (copy_table) | {table_ms:.3f} |\n| combine (checksum._combine) | {combine_ms:.3f} |")
    rows = [{"step": "copy_table", "ms": table_ms}, {"step": "combine", "ms": combine_ms}]
    write_results(out, {"bytes": words * 4, "tensors": tensors, "blocks": int(table.shape[0]), "rows": rows})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", type=float, default=8.0, help="GiB checksummed per measurement")
    p.add_argument("--tiles", default=f"{ck._ROWS}x{ck._WARPS}/{ck.BLOCK_ROWS}")
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--host", action="store_true", help="only the host's share of a pull (no GPU needed)")
    p.add_argument("--tensors", type=int, default=300, help="--host: tensors the --gb GiB are split into")
    p.add_argument("--out", type=Path, default=None, help="default bench/results/checksum.json (checksum_host.json)")
    args = p.parse_args()
    if args.host:
        return host_share(args.gb, args.tensors, args.repeat, args.out or Path("bench/results/checksum_host.json"))
    args.out = args.out or Path("bench/results/checksum.json")

    n = int(args.gb * 2**30) // 4 * 4
    data = torch.randint(-(2**31), 2**31 - 1, (n // 4,), dtype=torch.int32, device="cuda")
    raw = data.view(torch.uint8)
    forms = {"int32 words": [raw], "int16 words": [raw[: n - 2]], "bytes": [raw[: n - 1]]}
    forms["int32 words, 1000 tensors"] = list(raw[: n - n % 4000].view(1000, -1))
    copy = torch.empty_like(raw)
    copy_ms = median_ms(lambda: copy.copy_(raw), args.repeat)
    rows = [{"form": "device copy", "ms": copy_ms, "gbps": n / copy_ms / 1e6}]
    want = {k: checksums(v) for k, v in forms.items()}
    for tile in args.tiles.split(","):
        shape, block_rows = tile.split("/")
        ck._ROWS, ck._WARPS = (int(x) for x in shape.split("x"))
        ck.BLOCK_ROWS = int(block_rows)
        for k, ts in forms.items():
            assert checksums(ts) == want[k], (tile, k)
            ms = median_ms(lambda ts=ts: checksums(ts), args.repeat)
            nbytes = sum(t.numel() for t in ts)
            rows.append({"form": k, "tile": tile, "ms": ms, "gbps": nbytes / ms / 1e6})
    assert copy_checksums_later([(copy, raw)])() == want["int32 words"]
    ms = median_ms(lambda: copy_checksums_later([(copy, raw)])(), args.repeat)
    rows.append({"form": "copy and checksum in one pass", "ms": ms, "gbps": n / ms / 1e6, "one_pass": True})
    ms = median_ms(lambda: _checksum_torch(raw).item(), 3, warmup=1)
    rows.append({"form": "int32 words, torch form", "ms": ms, "gbps": n / ms / 1e6})

    print(f"{n / 1e9:.2f} GB on {torch.cuda.get_device_name()}")
    print("| form | tile | ms | GB/s | end to end with a copy, GB/s |")
    print("|---|---|---|---|---|")
    for r in rows:
        both = r["gbps"] if r is rows[0] or r.get("one_pass") else 1 / (1 / r["gbps"] + 1 / rows[0]["gbps"])
        print(f"| {r['form']} | {r.get('tile', '')} | {r['ms']:.2f} | {r['gbps']:.0f} | {both:.0f} |")
    write_results(args.out, {"device": torch.cuda.get_device_name(), "bytes": n, "rows": rows})


if __name__ == "__main__":
    main()
