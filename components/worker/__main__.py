"""`python -m components.worker`: one rank, or the process a snapshot image is baked from."""

from __future__ import annotations

import argparse
import logging
import sys

import uvloop

from components.graph.component import LOG_FORMAT
from components.worker.process import baked, serve


def main() -> None:
    p = argparse.ArgumentParser(description="One DP/EP worker rank (started by `dynamo serve`).")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--rank", type=int)
    g.add_argument("--bake", metavar="SPEC", help="be the process a criu-tier snapshot is dumped from")
    p.add_argument(
        "--join",
        action="store_true",
        help="join a serving group: pull weights from peers instead of reading the checkpoint",
    )
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    if args.bake:
        baked(args.bake)
    else:
        # The step thread takes the GIL back after every CUDA call that released it; at the
        # default 5 ms switch interval another thread of this process holding it (the control
        # loop, the streams' reader) could make it wait that long, several times a step of under
        # 2 ms. The streams themselves are served by a process of their own (stream_link.py).
        sys.setswitchinterval(2e-4)
        uvloop.run(serve(args.rank, args.join))


if __name__ == "__main__":
    main()
