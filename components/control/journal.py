"""The operation history and counters, and the journal that lets them outlive a router."""

from __future__ import annotations

import logging
from pathlib import Path

import msgspec

from components.control.operation import FINAL
from components.protocol.topology import OpRecord, ScaleRequest

log = logging.getLogger(__name__)

INTERRUPTED = "interrupted"  # an operation's phase once the router that ran it is gone
ENDED = {p.value for p in FINAL} | {INTERRUPTED}
HISTORY = 20  # operations kept in the history (and its journal)
COMPACT_AFTER = 500  # journal lines (some 25 phase changes per operation kept) that trigger a compaction


class Tally(msgspec.Struct, forbid_unknown_fields=True):
    """The router's operation counters: operations by kind and how they ended, those whose
    follow-up failed after their commit, and the failed serving ranks masked out (a failover's,
    but also a rollback's and a scale-up's own, which no failover operation counts)."""

    outcomes: dict[str, dict[str, int]] = {}  # kind -> final phase (or interrupted) -> count
    followup_failures: int = 0
    masked_ranks: int = 0

    def count(self, record: OpRecord) -> None:
        """Count an operation that ended (others are not yet)."""
        if record.phase not in ENDED:
            return
        of_kind = self.outcomes.setdefault(record.kind, {})
        of_kind[record.phase] = of_kind.get(record.phase, 0) + 1
        self.followup_failures += bool(record.followup_error)
        self.masked_ranks += len(record.masked)

    def add(self, other: Tally) -> None:
        for kind, ends in other.outcomes.items():
            of_kind = self.outcomes.setdefault(kind, {})
            for phase, n in ends.items():
                of_kind[phase] = of_kind.get(phase, 0) + n
        self.followup_failures += other.followup_failures
        self.masked_ranks += other.masked_ranks


class Queued(msgspec.Struct, forbid_unknown_fields=True):
    """A scale request taken while another operation ran, so not yet any operation's."""

    queued: ScaleRequest
    at: float  # wall-clock time (unix) it was taken: an operation that started later took it up


class OpJournal:
    """The operation history as JSON lines, one line per record at each phase change (the last
    line of an id wins), so that a router `dynamo serve` restarted shows the history and what its
    predecessor left in flight, and counts on from its counters. Appended without fsync: a killed
    process's writes survive it. A scale request queued behind the operation in flight has a line
    of its own (`Queued`), until an operation takes it up. Compacted to the last `HISTORY` records,
    after a line that tallies the operations dropped, when loaded and whenever it reached
    `compact_after` lines."""

    def __init__(self, path: Path, compact_after: int = COMPACT_AFTER):
        self.path, self.compact_after = path, compact_after
        self.records: dict[str, OpRecord] = {}  # the latest state of each operation in the file
        self.dropped = Tally()  # what the operations compacted away counted
        self.queued: Queued | None = None  # the latest request queued, while no operation took it up
        self.lines = 0  # in the file

    def load(self) -> tuple[list[OpRecord], Tally]:
        """The records, oldest first (the last `HISTORY`), and the tally of every operation the
        journal saw end (`queued`: the request the last router had queued, if none took it up);
        the file is compacted."""
        try:
            lines = self.path.read_bytes().splitlines()
        except FileNotFoundError:
            lines = []
        for line in lines:
            try:
                rec = msgspec.json.decode(line, type=OpRecord)
            except msgspec.DecodeError:
                for kind in (Tally, Queued):
                    try:
                        got = msgspec.json.decode(line, type=kind)
                    except msgspec.DecodeError:  # a line torn by the kill, or not ours: skipped
                        continue
                    if kind is Tally:
                        self.dropped = got
                    else:
                        self.queued = got
                    break
                continue
            self.records[rec.id] = rec
        if self.queued and any(r.started_at >= self.queued.at for r in self.records.values()):
            self.queued = None  # an operation took it up
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.compact()
        total = Tally()
        total.add(self.dropped)
        for rec in self.records.values():
            total.count(rec)
        return list(self.records.values()), total

    def save(self, record: OpRecord) -> None:
        self.records[record.id] = record
        if self.queued and record.started_at >= self.queued.at:
            self.queued = None
        self._append(record, f"[op {record.id}] its record")

    def queue(self, req: ScaleRequest, at: float) -> None:
        """A request queued behind the operation in flight (or about to start one)."""
        self.queued = Queued(req, at)
        self._append(self.queued, f"the request for dp_size {req.dp_size}")

    def drop_queued(self) -> None:
        """The request queued is moot (a new group formed from scratch): rewritten without it."""
        if self.queued:
            self.queued = None
            self.compact()

    def _append(self, line: msgspec.Struct, what: str) -> None:
        try:
            if self.lines >= self.compact_after:
                self.compact()
                return
            with self.path.open("ab") as f:
                f.write(msgspec.json.encode(line) + b"\n")
            self.lines += 1
        except OSError as e:  # the history is for people: losing a line must not fail the operation
            log.warning("%s: not journaled to %s: %s", what, self.path, e)

    def compact(self) -> None:
        """Rewrite the file with the last `HISTORY` records, the older ones only tallied."""
        ordered = sorted(self.records.values(), key=lambda r: r.started_at)
        for rec in ordered[:-HISTORY]:
            self.dropped.count(rec)
        kept = ordered[-HISTORY:]
        self.records = {r.id: r for r in kept}
        lines = [msgspec.json.encode(r) for r in kept]
        if self.dropped != Tally():
            lines.insert(0, msgspec.json.encode(self.dropped))
        if self.queued:
            lines.append(msgspec.json.encode(self.queued))
        tmp = self.path.with_suffix(".tmp")
        tmp.write_bytes(b"".join(line + b"\n" for line in lines))
        tmp.replace(self.path)
        self.lines = len(lines)
