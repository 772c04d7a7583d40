"""snapshot-bake: bake, list, inspect, verify and remove worker snapshots; show the tiers possible here.

Exit codes: 0 success; 1 `verify` found a damaged snapshot (its directory exists but it is no
valid snapshot, or a file does not match); 2 bad input (a one-line message, no traceback): a bad
option, an empty path, a snapshot directory that is missing or not a directory.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

from components.protocol.config import DEVICES

PROG = "snapshot-bake"
# Bounds far above any real deployment, low enough that a slip (a few zeros too many) is refused at
# once instead of running into an allocation that fails, or exhausts the machine.
MAX_RANKS, MAX_SEQS, MAX_BATCHED_TOKENS = 1024, 4096, 1 << 17


class UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    """Bad arguments in the same one line as every other bad input (argparse prints its usage
    block first)."""

    def error(self, message: str):
        self.exit(2, f"{PROG}: error: {message} (see {self.prog} --help)\n")


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _int_in(lo: int, hi: int | None = None):
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be at least {lo}, got {v}")
        if hi is not None and v > hi:
            raise argparse.ArgumentTypeError(f"must be at most {hi}, got {v}")
        return v

    return parse


_ranks, _count = _int_in(1, MAX_RANKS), _int_in(0)


def _path(s: str) -> str:
    # Path("") is ".", so an empty argument (an unset shell variable) would quietly mean the
    # current directory.
    if not s.strip():
        raise argparse.ArgumentTypeError("an empty path")
    return s


def _sizes(s: str) -> tuple[int, ...]:
    if s.strip() in ("", "none"):
        return ()
    try:
        return tuple(sorted({_int_in(1, MAX_SEQS)(x) for x in s.split(",")}))
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"batch sizes as a comma-separated list: {e}") from None


# ---- commands -----------------------------------------------------------------------------------


def cmd_bake(a) -> int:
    from snapshot.bake import default_root
    from snapshot.manifest import SnapshotError, check_creatable, check_destination

    # Cheap checks first: no torch import for a mistyped path.
    if a.model and not Path(a.model).exists():
        raise UsageError(f"{Path(a.model).absolute()}: no such directory")
    try:
        if a.out:
            check_destination(a.out, a.force)
        else:
            check_creatable(a.root or default_root())
    except SnapshotError as e:
        raise UsageError(str(e)) from None
    if not re.fullmatch(DEVICES, a.device):
        raise UsageError(f"--device must be cpu, cuda or cuda:N, not {a.device!r}")
    if a.device.startswith("cuda"):
        from components.engine.rank import cuda_unusable

        if why := cuda_unusable(a.device):
            raise UsageError(f"--device {a.device}: {why}")
    if not 1 <= a.min_ranks <= a.max_ranks:
        raise UsageError(f"--min-ranks ({a.min_ranks}) must be in 1..--max-ranks ({a.max_ranks})")
    from components.engine.models.checkpoint import CheckpointError
    from snapshot.bake import WARMUP_FILE, bake

    try:
        path, m = bake(
            a.out,
            a.model or None,
            device=a.device,
            dtype=a.dtype,
            max_ranks=a.max_ranks,
            min_ranks=a.min_ranks,
            max_seqs=a.max_seqs,
            max_len=a.max_len,
            max_batched_tokens=a.max_batched_tokens,
            redundant_experts=a.redundant_experts,
            batch_invariant=a.batch_invariant,
            cuda_graph_sizes=a.cuda_graph_sizes,
            model_name=a.name,
            force=a.force,
            progress=not a.quiet,
            root=a.root,
            tier=a.tier,
        )
    except (CheckpointError, SnapshotError, ValueError) as e:
        raise UsageError(str(e)) from None
    except OSError as e:
        raise UsageError(f"{e.filename}: {e.strerror}" if e.filename else str(e)) from None
    except RuntimeError as e:  # torch's allocators, for a configuration too large for this machine
        if "allocate" not in str(e):
            raise
        raise UsageError(f"not enough memory for this configuration: {str(e).splitlines()[0]}") from None
    from snapshot.manifest import snapshot_size

    print(f"baked {path}")
    print(
        f"  id {m.snapshot_id}, tier {m.tier}, model {m.model_name} ({m.model_identity[:12]}), "
        f"device {m.device_type}, warmup {m.warmup_seconds:.3f} s, {len(m.files) + 1} files, "
        f"{_human(snapshot_size(path))}"
    )
    if m.tier == "criu":
        print(f"  CRIU {m.criu_version} image {_human(m.image_bytes)}, baked in {m.bake_seconds:.1f} s")
        memory = json.loads((path / WARMUP_FILE).read_text()).get("image_memory", {})
        for when, mem in memory.items():  # what fills the image: a restore costs about its size
            largest = ", ".join(f"{name} {_human(n)}" for name, n in mem["largest"][:3])
            print(f"  anonymous memory {when}: {_human(mem['total_bytes'])} (largest mappings: {largest})")
    return 0


def cmd_list(a) -> int:
    from snapshot.bake import default_root
    from snapshot.manifest import SnapshotError
    from snapshot.store import list_snapshots

    root = Path(a.root) if a.root else default_root()
    try:
        infos = list_snapshots(root)
    except SnapshotError as e:
        raise UsageError(str(e)) from None
    if not infos:
        print(f"no snapshots under {root}")
        return 0
    rows = [("ID", "TIER", "MODEL", "DEVICE", "CREATED", "SIZE", "PATH")]
    for i in infos:
        m = i.manifest
        if m is None:
            rows.append(("?", "?", "(invalid)", "?", "?", _human(i.size_bytes), i.path))
        else:
            rows.append((m.snapshot_id, m.tier, m.model_name, m.device_type, m.created, _human(i.size_bytes), i.path))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]) - 1)]
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)) + "  " + r[-1])
    return 0


def _dir(a):
    """The snapshot directory DIR names; a missing one (or not a directory) is a bad argument for
    every command, `verify` included: there is nothing to check."""
    from snapshot.manifest import SnapshotError, open_dir
    from snapshot.store import resolve

    try:
        d = resolve(a.dir, a.root)
        os.close(open_dir(d))
    except SnapshotError as e:
        raise UsageError(str(e)) from None
    return d


def cmd_inspect(a) -> int:
    import msgspec

    from snapshot.manifest import SnapshotCorrupt, encode_manifest, load_manifest

    d = _dir(a)
    try:
        m = load_manifest(d)
    except SnapshotCorrupt as e:
        raise UsageError(str(e)) from None
    if a.json:
        sys.stdout.write(encode_manifest(m).decode())
        return 0
    print(f"snapshot {d.absolute()}")
    fields = msgspec.structs.asdict(m)
    files = fields.pop("files")
    w = max(map(len, fields))
    for k, v in fields.items():
        if isinstance(v, list):
            v = ", ".join(map(str, v)) or "(none)"
        elif v == "":
            v = "(none)"
        print(f"  {k.ljust(w)}  {v}")
    print(f"  {'files'.ljust(w)}  {len(files)} (+ manifest.json)")
    for name, digest in files.items():
        print(f"    {digest[:16]}  {name}")
    return 0


def cmd_verify(a) -> int:
    from snapshot.manifest import SnapshotCorrupt, verify

    d = _dir(a)
    try:
        m = verify(d)
    except SnapshotCorrupt as e:
        print(str(e), file=sys.stderr)
        return 1
    print(f"ok: {d} ({m.snapshot_id}, {len(m.files)} files checked)")
    return 0


def cmd_rm(a) -> int:
    from snapshot.manifest import SnapshotError
    from snapshot.store import remove_snapshot

    d = _dir(a)
    try:
        m = remove_snapshot(d)
    except SnapshotError as e:
        raise UsageError(str(e)) from None
    print(f"removed {d} ({m.snapshot_id})")
    return 0


def tier_lines() -> list[tuple[str, bool, str]]:
    from snapshot import cuda_checkpoint
    from snapshot.criu import criu_status

    out = [("artifacts", True, "always: manifest, engine config, warmup record and model config on disk")]
    cuda_ok, cuda_why = ok, why = cuda_checkpoint.available()
    if ok:
        out.append(("parked", True, f"GPU: a parked process, its CUDA state checkpointed: {why}"))
    else:
        out.append(
            (
                "parked",
                True,
                "CPU only: a warm parked process (no GPU state to checkpoint); "
                f"the GPU parked tier is unavailable: {why}",
            )
        )
    ok, why = criu_status()
    if ok:
        why += "; CPU and CUDA images" if cuda_ok else f"; CPU images (CUDA images need: {cuda_why})"
    out.append(("criu", ok, why if ok else f"unavailable: {why}"))
    return out


def cmd_tiers(a) -> int:
    for name, ok, why in tier_lines():
        print(f"{name:<10} {'yes' if ok else 'no':<4} {why}")
    return 0


# ---- parser -------------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    from snapshot.bake import DEFAULTS

    p = _Parser(
        prog=PROG,
        description="Bake and manage worker snapshots (initialised engine state without "
        "weights) that joining ranks restore from instead of cold-starting.",
        epilog="Snapshots live under $ELASTIC_EP_SNAPSHOTS (default ~/.cache/elastic-ep/snapshots). "
        "Exit codes: 0 ok, 1 verify failed, 2 bad input (a missing or empty path included).",
    )
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND", required=True)
    root_help = "the snapshot store (default $ELASTIC_EP_SNAPSHOTS or ~/.cache/elastic-ep/snapshots)"

    b = sub.add_parser(
        "bake",
        help="bake a snapshot of a worker rank (a CRIU image of it, warm)",
        description="Build one worker rank without its weights and run its masked warmup (on CUDA: "
        "capture and replay the decode graphs). The criu tier (default; CPU or CUDA, as root, CRIU from "
        "`make install`) does it in a worker process that belongs to no deployment and dumps that "
        "process with CRIU into DIR/criu: joiners of a deployment whose Worker.snapshot_root holds it "
        "are restored from it instead of starting cold. Both tiers write manifest.json (identity, "
        "parallel config, device, checksums), engine.json (the RankConfig), warmup.json (timings, "
        "graph sizes) and the model's config.json. Weights are never stored; a joiner pulls them "
        "from its peers. The options must match the deployment (Worker config) that will restore "
        "it; defaults are the Worker's.",
    )
    b.add_argument(
        "--out", metavar="DIR", type=_path, help="snapshot directory to create (default: <root>/<snapshot id>)"
    )
    b.add_argument("--root", metavar="DIR", type=_path, help=root_help + "; used when --out is not given")
    b.add_argument(
        "--model", metavar="DIR", default="", help="Hugging Face checkpoint directory (default: the built-in model)"
    )
    b.add_argument("--name", default="", help="model name recorded (default: the directory's name)")
    b.add_argument("--device", default=DEFAULTS["device"], help="cpu or cuda (default: %(default)s)")
    b.add_argument(
        "--dtype",
        default=DEFAULTS["dtype"],
        choices=["", "float32", "bfloat16", "float16"],
        help="compute dtype (default: the checkpoint's)",
    )
    b.add_argument(
        "--max-ranks",
        type=_ranks,
        default=DEFAULTS["max_ranks"],
        help="most ranks the deployment can grow to (default: %(default)s)",
    )
    b.add_argument(
        "--min-ranks",
        type=_ranks,
        default=DEFAULTS["min_ranks"],
        help="fewest ranks it can shrink to; sizes the expert slots (default: %(default)s)",
    )
    b.add_argument("--max-seqs", type=_int_in(1, MAX_SEQS), default=DEFAULTS["max_seqs"], help="default: %(default)s")
    b.add_argument(
        "--max-len",
        type=_count,
        default=DEFAULTS["max_len"],
        help="longest sequence; 0 = the model's context length, capped by memory (default: %(default)s)",
    )
    b.add_argument(
        "--max-batched-tokens",
        type=_int_in(0, MAX_BATCHED_TOKENS),
        default=DEFAULTS["max_batched_tokens"],
        help="prompt tokens a step computes; 0 = the device's default, 8192 on CUDA, 256 on the CPU (default: 0)",
    )
    b.add_argument(
        "--redundant-experts",
        type=_count,
        default=0,
        help="extra expert copies spread over --min-ranks ranks (default: %(default)s)",
    )
    b.add_argument(
        "--batch-invariant",
        action=argparse.BooleanOptionalAction,
        default=DEFAULTS["batch_invariant"],
        help="the deployment's Worker.batch_invariant (default: %(default)s)",
    )
    b.add_argument(
        "--cuda-graph-sizes",
        type=_sizes,
        default=None,
        metavar="B,B,...",
        help="row counts of the CUDA graphs captured: decode batches up to --max-seqs, prompt chunks a token a "
        "row up to --max-batched-tokens (default: the engine's)",
    )
    b.add_argument(
        "--tier",
        choices=["criu", "artifacts"],
        default="criu",
        help="criu: a CRIU image of the warm worker process, which joiners are restored from; "
        "artifacts: its configuration and warmup record only (default: %(default)s)",
    )
    b.add_argument("--force", action="store_true", help="replace an existing snapshot at --out")
    b.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    b.set_defaults(fn=cmd_bake)

    s = sub.add_parser(
        "list",
        help="list the snapshots in the store",
        description="List the snapshots under the store root: id, tier, model, device, "
        "created, size and path, newest first.",
    )
    s.add_argument("--root", metavar="DIR", type=_path, help=root_help)
    s.set_defaults(fn=cmd_list)

    for name, fn, hlp, desc in [
        (
            "inspect",
            cmd_inspect,
            "show a snapshot's manifest",
            "Print a snapshot's manifest: model identity, parallel config, device, driver, graph "
            "shapes, warmup time and file checksums.",
        ),
        (
            "verify",
            cmd_verify,
            "check a snapshot's file checksums",
            "Recompute every file's sha256 against the manifest. Prints 'ok' and exits 0, or names "
            "the damaged, missing or unexpected file and exits 1 (2 when DIR is missing or no directory).",
        ),
        (
            "rm",
            cmd_rm,
            "remove a snapshot",
            "Remove a snapshot directory. Only directories holding a valid snapshot manifest are "
            "removed; anything else is refused (exit 2).",
        ),
    ]:
        s = sub.add_parser(name, help=hlp, description=desc)
        s.add_argument(
            "dir", metavar="DIR", type=_path, help="snapshot directory (or a snapshot id / name under the root)"
        )
        s.add_argument("--root", metavar="DIR", type=_path, help=root_help)
        if name == "inspect":
            s.add_argument("--json", action="store_true", help="print the manifest as JSON")
        s.set_defaults(fn=fn)

    s = sub.add_parser(
        "tiers",
        help="which snapshot tiers this machine supports, and why not",
        description="Print each snapshot tier and whether it is available here: "
        "artifacts always; parked needs the CUDA driver checkpoint API on a GPU (on "
        "CPU a warm parked process); criu needs CRIU >= 4.0 (the venv's, from make install, "
        "or one on PATH) whose `criu check` passes, as root.",
    )
    s.set_defaults(fn=cmd_tiers)
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    a = p.parse_args(argv)
    try:
        return a.fn(a)
    except UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return 0


if __name__ == "__main__":
    sys.exit(main())
