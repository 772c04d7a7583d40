"""Weight-pull bandwidth: a joiner pulling from two serving ranks by NIXL READ and, for same-node
GPU peers, by CUDA IPC (torch allocations) and by mapping the sources' VMM arenas, against a plain
device copy of the same bytes along the same path (on this GPU, or from the sources' GPU to this
one with --src-device).

Sources are real processes (`harness.weight_peer`); every pull is checksum-verified, so the
end-to-end column includes verification and the transfer column does not."""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.measure import write_results
from components.engine.weights.store import WeightStore
from components.protocol.transfer import PullItem, spread
from harness.weight_peer import NON_EXPERT, Sources, make_weights


def device_copy_gbps(nbytes: int, device: str, src_device: str) -> float:
    a = torch.empty(nbytes, dtype=torch.uint8, device=src_device)
    b = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b.copy_(a)
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
    t = time.perf_counter()
    for _ in range(5):
        b.copy_(a)
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
    return 5 * nbytes / (time.perf_counter() - t) / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda")
    p.add_argument(
        "--src-device", default=None, help="where the sources hold their weights, e.g. cuda:1 (default: --device)"
    )
    p.add_argument("--mb", type=int, default=2048, help="MB of weights each source holds (default %(default)s)")
    p.add_argument(
        "--paths",
        default="nixl,cuda-ipc,vmm-map",
        help="comma-separated paths to measure (default %(default)s; the last two need CUDA)",
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=10,
        help="pulls per path; the best and the median are reported (default %(default)s)",
    )
    p.add_argument("--out", type=Path, default=Path("bench/results/weight_pull.json"))
    args = p.parse_args()
    src_device = args.src_device or args.device

    rows = []
    dst = {k: v.to(args.device) for k, v in make_weights(0, big_mb=args.mb).items() if k in NON_EXPERT}
    # (sources' memory, path name, use the direct path)
    runs = [("torch", "nixl", False)]
    if args.device.startswith("cuda"):
        runs += [("torch", "cuda-ipc", True), ("vmm", "vmm-map", True)]
    wanted = args.paths.split(",")
    unknown = set(wanted) - {name for _, name, _ in runs}
    if unknown:
        p.error(
            f"--paths: {', '.join(sorted(unknown))} not available on {args.device} "
            f"(choose from {', '.join(name for _, name, _ in runs)})"
        )
    runs = [r for r in runs if r[1] in wanted]
    for memory in dict.fromkeys(m for m, _, _ in runs):
        with tempfile.TemporaryDirectory() as d:
            src = Sources(Path(d))
            for r in (0, 1):
                src.spawn(r, "--big-mb", str(args.mb), "--device", src_device, *(["--vmm"] if memory == "vmm" else []))
            try:
                m = {r: src.manifest(r, timeout=300) for r in (0, 1)}
                sizes = {t.name: t.nbytes for t in m[0].tensors}
                items: list[PullItem] = spread(NON_EXPERT, [0, 1], sizes)
                with WeightStore(9, dst, device=args.device) as local:
                    for _, name, direct in (r for r in runs if r[0] == memory):
                        pulls = [local.pull(items, m, timeout_s=600, use_ipc=direct) for _ in range(args.repeat)]
                        best = min(pulls, key=lambda st: st.transfer_seconds)
                        rows.append(
                            {
                                "path": name,
                                "bytes": best.bytes,
                                "ipc_bytes": best.ipc_bytes,
                                "transfer_gbps": best.bytes / best.transfer_seconds / 1e9,
                                "map_s": best.map_seconds,
                                "end_to_end_gbps": best.gbps,
                                "end_to_end_gbps_median": statistics.median(st.gbps for st in pulls),
                                "verify_s": best.verify_seconds,
                            }
                        )
            finally:
                src.stop()
    copy = device_copy_gbps(rows[0]["bytes"], args.device, src_device)
    print(f"sources on {src_device}, joiner on {args.device}")
    print(
        "| path | MB | of which direct | opening + closing peers' memory, ms (overlaps copies) | "
        f"transfer GB/s, opening included (% of device copy, {copy:.0f} GB/s) | "
        "end-to-end GB/s, with checksums (%) | median of the pulls, end to end (%) |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['path']} | {r['bytes'] / 1e6:.0f} | {r['ipc_bytes'] / 1e6:.0f} | {r['map_s'] * 1e3:.1f} | "
            f"{r['transfer_gbps']:.1f} ({100 * r['transfer_gbps'] / copy:.0f}%) | "
            f"{r['end_to_end_gbps']:.1f} ({100 * r['end_to_end_gbps'] / copy:.0f}%) | "
            f"{r['end_to_end_gbps_median']:.1f} ({100 * r['end_to_end_gbps_median'] / copy:.0f}%) |"
        )
    write_results(
        args.out,
        {
            "command": " ".join(["python -m bench.weight_pull", *sys.argv[1:]]),
            "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
            "src_device": src_device,
            "dst_device": args.device,
            "device_copy_gbps": copy,
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
