"""Chaos soak: `dynamo serve graphs/elastic:Frontend` on one graph for `--duration` seconds under
streaming clients (greedy and seeded), one fault drawn at random (`--seed`) every `--interval`
seconds at the earliest, each taken once the one before has been recovered from and followed by a
scale request to a size drawn from `--min-size`..`--max-size`.

The matrix (bench.faults measures each alone, on a fresh graph; here they follow each other):
  serving rank killed           SIGKILL of a random serving rank
  serving rank stalled          SIGSTOP of a random serving rank: half the time SIGCONT after
                                0.5-1.5 s (under Router.rank_timeout_s: no failover expected),
                                else left to the router's timeout (it fences the rank: SIGKILL)
  two ranks killed              SIGKILL of two random serving ranks, 0-1 s apart (>= 3 ranks)
  joiner killed in <phase>      a scale-up by one whose joiner holds back the command of that
                                phase (injected: stall_on, 3 s) and is SIGKILLed while it does
                                (starting / loading / connecting / warming: a new joiner, the
                                scale-up ends done; committing: the commit rolls back)
  joiner stalled in pull        the same, SIGSTOP instead while it holds back its pull: silent for
                                Router.joiner_timeout_s, it is fenced (SIGKILL) and replaced
  leaving rank killed           SIGKILL of the leaving rank of a scale-down by one while it drains
  pull source killed            SIGKILL of a random serving rank while a scale-up's joiner holds
                                back its pull from it (injected: 1 s): masked out, its reads pulled
                                from the survivors, the scale-up ends done
  router killed / stalled       SIGKILL / SIGSTOP of the router (`dynamo serve` restarts it, the
                                new one adopts); 35 s after its start at the earliest (one that
                                keeps dying sooner stops the graph, by design)
  planner killed                SIGKILL of the planner (non-critical, not restarted: once)
  corrupt snapshot              one byte flipped of a random file the snapshot's manifest
                                checksums, then a scale-up by one whose joiner is a new process
                                (its fault field injects nothing, stall_s=0: with one the router
                                starts a process rather than restore a parked rank): the joiner
                                refuses the snapshot (the reason in the row), cold-starts, the
                                scale-up ends done; the byte flipped back (checksums verified)
                                for the faults after it

The graph runs with the defaults a user gets but for --Worker.dp_size (the start size),
--Router.allow_fault_injection=true (the stalls above), a planner that runs but never acts
(--Planner.up_intervals and down_intervals out of reach: the soak chooses the sizes) on a free
port, and with --snapshots (the default) --Worker.snapshot_root: a store holding one criu-tier
snapshot baked before the soak for this deployment (7-11 s on a 2-core CPU, 160 MiB), which new
joiners are restored from. Where CRIU cannot run (not root, or no `criu check`) the soak runs
without it and without the corrupt snapshot, and says why. The router must choose the baked
snapshot as it starts, or the soak stops with the router's reason (a Worker option after `--`
that the bake does not record, such as --Worker.max_len or --Worker.model: pass --no-snapshots).

Per fault: when (s into the soak), detected (the router's verdict or the supervisor's, s after
the fault), serving again (the end of the longest pause of every stream's tokens together after the
fault, and that pause; 0 when it is under --pause-s, 0.5 s: serving never stopped), recovered
(every new operation ended and the deployment whole at the size it should be at: every active rank
ACTIVE and routable, the dead gone), requests sent / lost and completions whose tokens differ from
the same request run alone on the single-rank reference engine (from the fault to the next one),
and the phase the next /scale ended in; at the end, how every joiner of the soak joined (restored
from the snapshot, parked, cold). Prints a table,
writes JSON (`--out`) after every fault, exits 1 if a request was lost, a token wrong, a fault not
recovered from, a scale not done, or the deployment not at its target at the end.

    python -m bench.chaos                          # 600 s, CPU, bench/results/chaos_cpu.json
    python -m bench.chaos --duration 120 --seed 3  # a short one
    python -m bench.chaos --duration 300 --out bench/results/chaos_h200.json -- --Worker.device=cuda
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from bench.faults import (
    JOINER_PHASES,
    PROMPTS,
    kill_leaving_rank,
    kill_rank_mid_scale_up,
    log_time,
    new_ops,
    op_ids,
    rank_pid,
    router_pids,
)
from bench.measure import machine, write_results
from harness.server import Server, Traffic, engine_reference, failure_reasons, free_ports, freeze, scale
from harness.tamper import flip_byte

# Each prompt twice: greedy, and sampled with its own seed (values exact in float32, as the
# frontend passes them on, so the reference samples with the same ones).
SAMPLING = [{}] * len(PROMPTS) + [{"temperature": 0.75, "top_p": 0.875, "seed": 1000 + i} for i in range(len(PROMPTS))]
REQUESTS = PROMPTS + PROMPTS
MAX_TOKENS = 24
JOINER_STALL_S = 3.0
ROUTER_QUIET_S = 35.0  # a router fault waits this long after the router's start (QUICK_DEATH_S 30)
# A fault field that injects nothing (no stall_on to stall): given one, the router starts a new
# process for the joiner instead of restoring a parked rank, which would not look at the snapshot.
NEW_JOINER = "stall_s=0"


@dataclasses.dataclass
class Injected:
    """What a fault did, and what recovering from it means."""

    t: float  # when (unix)
    target: int  # the size the deployment is to be back at
    params: dict
    detect: str | None = None  # the log line (regex) of its detection, timed from the fault
    detected_s: float | None = None  # or measured by the injection itself
    gone: list[int] = dataclasses.field(default_factory=list)  # pids that must leave the topology
    not_before: float = 0.0  # recovered no earlier (unix): a fault that must not be acted on
    new_router: int | None = None  # the router pid that must have been replaced


class Soak:
    """One graph's soak: the size it should be at, its faults, and how each is measured."""

    def __init__(self, srv: Server, args, rng: random.Random, snapshot: Path | None = None):
        self.srv, self.args, self.rng = srv, args, rng
        self.snapshot = snapshot  # the snapshot new joiners are restored from, if any
        self.target = args.start_size
        self.planner = int(re.findall(r"started Planner \(pid (\d+)", srv.output)[-1])
        self.planner_alive = True
        self.router_started = self.t0 = time.time()
        self.stamps: list[float] = []  # every streamed chunk's arrival, all streams together
        # Operation id -> how its joiners joined, gathered as the soak goes (/operations keeps
        # the last 20 only).
        self.joined: dict[str, dict[str, str]] = {}

    def active(self) -> list[int]:
        return sorted(self.srv.topology()["active"])

    def wait_output(self, pattern: str, since: int) -> re.Match:
        """The first match of `pattern` in the graph's output from character `since` on."""
        deadline = time.monotonic() + self.args.timeout_s
        while time.monotonic() < deadline:
            m = re.search(pattern, self.srv.output[since:], re.M)
            if m:
                return m
            time.sleep(0.05)
        raise TimeoutError(f"no output line matches {pattern!r}")

    # The faults: each injects and says what recovering means (feasible sizes in MATRIX).

    def serving_rank_killed(self) -> Injected:
        return self._kill_serving(1)

    def two_ranks_killed(self) -> Injected:
        return self._kill_serving(2)

    def _kill_serving(self, n: int) -> Injected:
        victims = self.rng.sample(self.active(), n)
        pids = [rank_pid(self.srv, r) for r in victims]
        delay = round(self.rng.uniform(0.0, 1.0), 3)
        t = time.time()
        os.kill(pids[0], signal.SIGKILL)
        if n > 1:
            time.sleep(delay)
            os.kill(pids[1], signal.SIGKILL)
        params = {"ranks": victims} | ({"second_after_s": delay} if n > 1 else {})
        return Injected(t, self.target, params, detect=failed(victims[0]), gone=pids)

    def serving_rank_stalled(self) -> Injected:
        rank = self.rng.choice(self.active())
        pid, brief = rank_pid(self.srv, rank), self.rng.random() < 0.5
        stop_s = round(self.rng.uniform(0.5, 1.5), 3)
        t = time.time()
        freeze(pid)
        if brief:
            time.sleep(stop_s)
            os.kill(pid, signal.SIGCONT)
            # Recovered once the router has had its rank timeout and a status round to act on it.
            return Injected(t, self.target, {"rank": rank, "stopped_s": stop_s}, not_before=time.time() + 5.0)
        return Injected(t, self.target, {"rank": rank, "stopped": "until fenced"}, detect=failed(rank), gone=[pid])

    def joiner_fault(self, phase: str, stop: bool = False) -> Injected:
        """SIGKILL (or with `stop` SIGSTOP) of a scale-up's joiner while it holds back the command
        of `phase`."""
        command, since, size = JOINER_PHASES[phase], len(self.srv.output), self.target
        fault = f"stall_on={command},stall_s={JOINER_STALL_S}"
        r = self.srv.control("POST", "/scale", json={"dp_size": size + 1, "fault": fault})
        assert r.status_code == 202, r.text
        m = self.wait_output(
            rf"\[op (\S+)\] started Worker\.(\d+) \(pid (\d+), \w+\) with fault {re.escape(fault)}$", since
        )
        op, rank, pid = m.group(1), int(m.group(2)), int(m.group(3))
        # Describe carries no operation's id: the rank says which joiner holds the command back.
        self.wait_output(rf"rank {rank}: injected fault: stalling {command} ", since)
        seen = (self.srv.topology()["operation"] or {}).get("phase")
        t = time.time()
        if stop:  # silent past Router.joiner_timeout_s: fenced and replaced
            freeze(pid)
        else:
            os.kill(pid, signal.SIGKILL)
        # Before the commit a new joiner is started; in the commit it rolls back (README, Failures).
        target = size if phase == "committing" else size + 1
        caught = rf"\[op {re.escape(op)}\] (aborting in|rolling back|joiner \d+ (died|stalled) during)"
        return Injected(t, target, {"op": op, "joiner": rank, "phase_seen": seen}, detect=caught, gone=[pid])

    def leaving_rank_killed(self) -> Injected:
        pid = rank_pid(self.srv, max(self.active()))
        _, t, rank = kill_leaving_rank(self.srv, self.args, self.target)
        return Injected(t, self.target - 1, {"rank": rank}, detect=failed(rank), gone=[pid])

    def pull_source_killed(self) -> Injected:
        rank = self.rng.choice(self.active())
        pid = rank_pid(self.srv, rank)
        _, t = kill_rank_mid_scale_up(self.srv, self.args, "pull_weights", 1.0, rank=rank, size=self.target + 1)
        detect = rf"{failed(rank)}|-> masking \(.*\): ranks \[{rank}\] failed"
        return Injected(t, self.target + 1, {"rank": rank}, detect=detect, gone=[pid])

    def router_killed(self) -> Injected:
        return self._router(signal.SIGKILL)

    def router_stalled(self) -> Injected:
        return self._router(signal.SIGSTOP)

    def _router(self, sig: int) -> Injected:
        # Waited for rather than drawn around, so that a seed draws the same faults at any speed.
        time.sleep(max(0.0, self.router_started + ROUTER_QUIET_S - time.time()))
        old = router_pids(self.srv)[-1]
        hung, since = f"Router (pid {old}) did not answer", len(self.srv.output)
        t = time.time()
        os.kill(old, sig)
        deadline = time.monotonic() + self.args.timeout_s
        while time.monotonic() < deadline:  # the supervisor's lines carry no time: watched here
            out = self.srv.output[since:]
            if (hung in out) if sig == signal.SIGSTOP else "started Router (pid" in out:
                break
            time.sleep(0.05)
        detected = time.time() - t
        if sig == signal.SIGSTOP:
            try:
                os.kill(old, signal.SIGCONT)  # too late: it was killed as hung
            except ProcessLookupError:
                pass
        self.router_started = time.time()
        return Injected(t, self.target, {"pid": old}, detected_s=detected, new_router=old)

    def planner_killed(self) -> Injected:
        since = len(self.srv.output)
        t = time.time()
        os.kill(self.planner, signal.SIGKILL)
        self.wait_output(rf"component Planner \(pid {self.planner}\)", since)
        self.planner_alive = False
        return Injected(
            t, self.target, {"pid": self.planner, "note": "non-critical, not restarted"}, detected_s=time.time() - t
        )

    def corrupt_snapshot(self) -> Injected:
        from snapshot.manifest import load_manifest, verify

        snap, size = self.snapshot, self.target
        member = self.rng.choice(sorted(n for n in load_manifest(snap).files if (snap / n).stat().st_size))
        offset = self.rng.randrange((snap / member).stat().st_size)
        flip_byte(snap / member, offset)
        t = time.time()
        try:
            rec = scale(self.srv, size + 1, fault=NEW_JOINER)
        finally:
            flip_byte(snap / member, offset)  # the same bit inverted again: the pristine file
        verify(snap)  # SnapshotCorrupt (the row's error) if it is not
        joiner = str(rec["joiners"][0])
        how, why = rec["joined_from"].get(joiner), rec["snapshot_refused"].get(joiner, "")
        params = {"member": member, "offset": offset, "joiner": int(joiner), "joined_from": how, "refused": why}
        if how != "cold" or f"{member}: checksum mismatch" not in why:
            raise AssertionError(f"the joiner did not refuse the damaged snapshot: {params}")
        # Detected: the router's refusal, logged before the joiner's process starts.
        detect = rf"\[op {re.escape(rec['id'])}\] snapshot .*: {re.escape(member)}: checksum mismatch"
        return Injected(t, size + 1, params, detect=detect)

    # Measuring.

    def whole(self, inj: Injected, before: set[str]) -> bool:
        """The deployment is back: the router answers (a new one, if it was the fault), every
        operation since the fault ended, the dead are gone and every active rank of the target size
        is ACTIVE and routable."""
        try:
            if self.srv.control("GET", "/health", timeout=5).status_code != 200:
                return False
            topo, ops = self.srv.topology(), new_ops(self.srv, before)
        except (httpx.HTTPError, ValueError):
            return False
        if inj.new_router is not None and router_pids(self.srv)[-1] == inj.new_router:
            return False
        ranks = {r["rank"]: r for r in topo["ranks"]}
        return (
            not topo["scaling"]
            and topo["target"] is None
            and topo["dp_size"] == inj.target == len(topo["active"])
            and all(r in ranks and ranks[r]["state"] == "ACTIVE" and ranks[r]["routable"] for r in topo["active"])
            and not any(r["pid"] in inj.gone for r in topo["ranks"])
            and all(op["total_s"] is not None for op in ops)
        )

    def recover(self, inj: Injected, before: set[str]) -> float | None:
        deadline = time.monotonic() + self.args.timeout_s
        while time.monotonic() < deadline:
            if time.time() >= inj.not_before and self.whole(inj, before):
                return time.time() - inj.t
            time.sleep(0.25)
        return None

    def pause(self, t0: float, t1: float) -> tuple[float, float]:
        """The longest gap between two tokens of any stream (all streams together) that ends in
        [t0, t1]: (its end after t0, 0 if it is under --pause-s: serving never stopped; its length)."""
        stamps = sorted(self.stamps)
        end, gap = 0.0, 0.0
        for a, b in zip(stamps, stamps[1:]):
            if t0 <= b <= t1 and b - a > gap:
                end, gap = b - t0, b - a
        return (end if gap >= self.args.pause_s else 0.0), gap

    def run_fault(self, row: dict) -> None:
        """Inject `row`'s fault, wait for the deployment to be whole and fill the row in."""
        before = op_ids(self.srv)
        row["size_before"] = self.target
        inj = MATRIX[row["kind"]][0](self)
        self.target = inj.target
        recovered = self.recover(inj, before)
        detected = inj.detected_s
        if detected is None and inj.detect:
            try:
                detected = log_time(self.srv, inj.detect, after=inj.t) - inj.t
            except AssertionError:
                pass
        end = inj.t + (recovered if recovered is not None else self.args.timeout_s)
        again, gap = self.pause(inj.t, end)
        ops = new_ops(self.srv, before)
        self.joined |= {op["id"]: op["joined_from"] for op in ops}
        row |= {
            "t_s": round(inj.t - self.t0, 2),  # the fault itself (a router fault may wait for its turn)
            "params": inj.params,
            "target": inj.target,
            "detected_s": detected,
            "serving_again_s": again,
            "longest_pause_s": gap,
            "recovered_s": recovered,
            # A failover's own pause, or that of one a scale-up ran for a pull source it lost.
            "failover_downtime_ms": sum(
                ((op["downtime_s"] if op["kind"] == "failover" else op["failover_downtime_s"]) or 0) * 1e3 for op in ops
            ),
            "operations": [
                {k: op[k] for k in ("id", "kind", "from_size", "to_size", "phase", "error", "masked", "joined_from")}
                for op in ops
            ],
        }
        if recovered is None:
            row["topology"] = self.srv.topology()

    def next_scale(self, row: dict) -> None:
        """The scale after each fault, to a size drawn among the others; it must end done."""
        to = self.rng.choice([n for n in range(self.args.min_size, self.args.max_size + 1) if n != self.target])
        before = op_ids(self.srv)
        rec = scale(self.srv, to)
        row["next_scale"] = f"{self.target} -> {to}: {rec['phase']}"
        if rec["phase"] == "done":
            self.target = to
        inj = Injected(time.time(), self.target, {})
        row["next_scale_whole"] = self.recover(inj, before) is not None
        self.joined |= {op["id"]: op["joined_from"] for op in new_ops(self.srv, before)}


def failed(rank: int) -> str:
    """The router's verdict on a serving rank, alone or among others."""
    return rf"rank {rank} failed: |ranks \[[\d, ]*\b{rank}\b[\d, ]*\] failed"


# kind -> (injection, whether it can be drawn now). Sizes stay within min..max; two ranks killed
# leaves one rank at least (every rank lost is bench.faults' row: its streams fail by design).
MATRIX: dict[str, tuple[Callable[[Soak], Injected], Callable[[Soak], bool]]] = {
    "serving rank killed": (Soak.serving_rank_killed, lambda s: s.target >= 2),
    "serving rank stalled": (Soak.serving_rank_stalled, lambda s: s.target >= 2),
    "two ranks killed": (Soak.two_ranks_killed, lambda s: s.target >= 3),
    **{
        f"joiner killed in {phase}": (
            lambda s, phase=phase: s.joiner_fault(phase),
            lambda s: s.target < s.args.max_size,
        )
        for phase in JOINER_PHASES
    },
    "joiner stalled in pull": (lambda s: s.joiner_fault("pull", stop=True), lambda s: s.target < s.args.max_size),
    "leaving rank killed": (Soak.leaving_rank_killed, lambda s: s.target > s.args.min_size),
    "pull source killed": (Soak.pull_source_killed, lambda s: s.target < s.args.max_size),
    "router killed": (Soak.router_killed, lambda s: True),
    "router stalled": (Soak.router_stalled, lambda s: True),
    "planner killed": (Soak.planner_killed, lambda s: s.planner_alive),
    "corrupt snapshot": (Soak.corrupt_snapshot, lambda s: s.target < s.args.max_size),
}
# Those that need a snapshot store (--snapshots, CRIU).
NEEDS_SNAPSHOT = {"corrupt snapshot"}


def pick(soak: Soak) -> str:
    """A fault drawn uniformly among those of --faults the deployment can take now."""
    return soak.rng.choice([k for k in soak.args.faults if MATRIX[k][1](soak)])


def max_ranks(args) -> int:
    return max(4, args.max_size)


def fault_kinds(named: list[str], snapshots: bool) -> list[str]:
    """The kinds to draw from: those named, or all; without a snapshot none that needs one
    (ValueError if named)."""
    if not snapshots and (wanted := NEEDS_SNAPSHOT & set(named)):
        raise ValueError(f"{', '.join(sorted(wanted))} needs a snapshot")
    return named or [k for k in MATRIX if snapshots or k not in NEEDS_SNAPSHOT]


def graph_options(args, snapshot_root: Path | None) -> list[str]:
    """What differs from `dynamo serve graphs/elastic:Frontend`'s defaults (and the free port)."""
    (planner_port,) = free_ports(1)
    return [
        f"--Worker.dp_size={args.start_size}",
        f"--Worker.max_ranks={max_ranks(args)}",
        "--Router.allow_fault_injection=true",
        "--Planner.up_intervals=1000000000",
        "--Planner.down_intervals=1000000000",
        f"--Planner.min_dp={args.min_size}",  # else it holds Worker.dp_size and undoes a shrink below it
        f"--Planner.port={planner_port}",
        *([f"--Worker.snapshot_root={snapshot_root}"] if snapshot_root else []),
        *args.graph_args,
    ]


def bake_snapshot(args, device: str, root: Path) -> tuple[Path, dict]:
    """One criu-tier snapshot of this deployment's worker in the store `root` (as `snapshot-bake
    bake --tier criu --max-ranks N` bakes it); returns it and what the bake took."""
    from snapshot.bake import bake

    t0 = time.perf_counter()
    snap, m = bake(root / "snap", tier="criu", device=device, max_ranks=max_ranks(args), progress=False)
    return snap, {"snapshot_id": m.snapshot_id, "bake_s": round(time.perf_counter() - t0, 1), "files": len(m.files)}


def wait_chosen(srv: Server, timeout_s: float) -> None:
    """Until the router has chosen the baked snapshot to restore joiners from, as it starts;
    SystemExit with its reason if it will not."""
    deadline = time.monotonic() + timeout_s
    while (snap := srv.topology()["snapshot"])["state"] == "choosing":
        if time.monotonic() > deadline:
            raise SystemExit(f"chaos: the router did not choose a snapshot within {timeout_s:.0f} s")
        time.sleep(0.2)
    if snap["state"] != "chosen":
        raise SystemExit(f"chaos: the router will not restore joiners from the baked snapshot: {snap['why']}")


def joined_from(joined: dict[str, dict[str, str]]) -> dict[str, int]:
    """How the joiners of these operations joined: snapshot / parked / cold, counted."""
    counts: dict[str, int] = {}
    for op in joined.values():
        for how in op.values():
            counts[how] = counts.get(how, 0) + 1
    return dict(sorted(counts.items()))


def settle_windows(rows: list[dict], traffic: Traffic, reference: list[str]) -> None:
    """Each fault's requests: those that ended from its start to the next fault's."""
    marks = [r.pop("window") for r in rows] + [(len(traffic.results), len(traffic.errors))]
    for row, (r0, e0), (r1, e1) in zip(rows, marks, marks[1:]):
        done, errors = traffic.results[r0:r1], traffic.errors[e0:e1]
        wrong = [p for p, text, _, _ in done if text != reference[p]]
        row |= {
            "sent": len(done) + len(errors),
            "lost": len(errors),
            "wrong_tokens": len(wrong),
            "wrong_requests": sorted(set(wrong)),
            "failure_reasons": failure_reasons(errors),
        }


def bad(row: dict) -> bool:
    return bool(
        "error" in row
        or row.get("lost")
        or row.get("wrong_tokens")
        or row.get("recovered_s") is None
        or not str(row.get("next_scale", "")).endswith("done")
        or not row.get("next_scale_whole")
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=600.0, help="seconds of faults (default %(default)s)")
    p.add_argument("--interval", type=float, default=5.0, help="seconds between faults, at least (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="draws faults, victims and sizes (default %(default)s)")
    p.add_argument("--faults", default="", help="comma-separated kinds to draw from (default: all)")
    p.add_argument(
        "--snapshots",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="bake a snapshot to restore joiners from, and draw the corrupt snapshot (default: on where CRIU runs)",
    )
    p.add_argument("--start-size", type=int, default=3, help="Worker.dp_size (default %(default)s)")
    p.add_argument("--min-size", type=int, default=2, help="smallest size a scale asks for (default %(default)s)")
    p.add_argument("--max-size", type=int, default=4, help="largest size a scale asks for (default %(default)s)")
    p.add_argument("--clients", type=int, default=6, help="streaming clients (default %(default)s)")
    p.add_argument(
        "--pause-s", type=float, default=0.5, help="a shorter pause of every stream is no outage (default %(default)s)"
    )
    p.add_argument("--timeout-s", type=float, default=180.0, help="longest wait for a recovery (default %(default)s)")
    p.add_argument("--out", type=Path, default=Path("bench/results/chaos_cpu.json"), help="JSON output path")
    p.add_argument("graph_args", nargs="*", help="extra `dynamo serve` options after --")
    args = p.parse_args()
    named = [f.strip() for f in args.faults.split(",") if f.strip()]
    if unknown := [f for f in named if f not in MATRIX]:
        p.error(f"unknown fault(s) {unknown}; faults: {', '.join(MATRIX)}")
    if not 2 <= args.min_size <= args.start_size <= args.max_size:
        p.error("need 2 <= --min-size <= --start-size <= --max-size (one rank alone has no survivor to fail over to)")
    why_not = "--no-snapshots"
    if args.snapshots:
        from snapshot.criu import criu_status

        usable, status = criu_status()
        args.snapshots, why_not = usable, f"CRIU cannot run here: {status}"
    try:
        args.faults = fault_kinds(named, args.snapshots)
    except ValueError as e:
        p.error(f"{e} ({why_not})")
    if not args.snapshots:
        print(f"chaos: no snapshot, joiners start cold and no corrupt snapshot ({why_not})", file=sys.stderr)
    device = "cuda" if "--Worker.device=cuda" in args.graph_args else "cpu"
    reference = engine_reference(REQUESTS, MAX_TOKENS, device=device, sampling=SAMPLING)
    rng = random.Random(args.seed)
    store = Path(tempfile.mkdtemp(prefix="chaos-snapshots-")) if args.snapshots else None
    snapshot, baked = bake_snapshot(args, device, store) if store else (None, {"none": why_not})
    options = graph_options(args, store)
    try:
        srv = Server(options, boot_timeout_s=600, model=None)
    except BaseException:
        if store:
            shutil.rmtree(store)
        raise
    print(f"chaos: the graph's log is {srv.log_path}", file=sys.stderr, flush=True)
    rows: list[dict] = []
    result: dict = {
        "command": " ".join(["python -m bench.chaos", *sys.argv[1:]]),
        # The snapshot store is a temporary directory: named, not where it was.
        "non_default_options": [
            "--Worker.snapshot_root=<the baked store>" if o.startswith("--Worker.snapshot_root") else o
            for o in options
            if not o.startswith("--Planner.port")
        ],
        "snapshot": baked,
        "machine": machine(),
        "rows": rows,
    }

    def save() -> None:  # after every row, so a soak cut short still leaves its numbers
        write_results(args.out, result, quiet=True)

    try:
        if store:
            wait_chosen(srv, args.timeout_s)
        soak = Soak(srv, args, rng, snapshot)
        traffic = Traffic(
            srv, REQUESTS, MAX_TOKENS, args.clients, lambda now, _: soak.stamps.append(now), 0.25, SAMPLING
        )
        with traffic:
            time.sleep(3.0)
            soak.t0 = time.time()
            while time.time() - soak.t0 < args.duration:
                kind, t = pick(soak), time.time()
                print(f"chaos: {t - soak.t0:.0f} s: {kind} (size {soak.target})", file=sys.stderr, flush=True)
                row = {
                    "kind": kind,
                    "t_s": round(t - soak.t0, 2),
                    "window": (len(traffic.results), len(traffic.errors)),
                }
                rows.append(row)
                try:
                    soak.run_fault(row)
                    soak.next_scale(row)
                except Exception as e:  # recorded; the deployment may not be whole: the soak ends
                    row["error"] = f"{type(e).__name__}: {e}"
                    print(f"chaos: {kind} failed: {row['error']}\n{srv.tail(40)}", file=sys.stderr, flush=True)
                    break
                print(
                    f"chaos: {json.dumps({k: v for k, v in row.items() if k not in ('operations', 'window')})}",
                    file=sys.stderr,
                    flush=True,
                )
                save()
                time.sleep(max(0.0, t + args.interval - time.time()))
            time.sleep(2.0)
        topo = srv.topology()
        result["end"] = {"target": soak.target, "dp_size": topo["dp_size"], "active": topo["active"]}
        result["joined_from"] = joined_from(soak.joined)
    finally:
        srv.stop()
        if store:
            shutil.rmtree(store)
    settle_windows(rows, traffic, reference)
    result["summary"] = {
        "faults": len(rows),
        "sent": sum(r.get("sent", 0) for r in rows),
        "lost": sum(r.get("lost", 0) for r in rows),
        "wrong_tokens": sum(r.get("wrong_tokens", 0) for r in rows),
        "not_recovered": sum(1 for r in rows if r.get("recovered_s") is None),
        "at_target_at_end": result.get("end", {}).get("dp_size") == soak.target,
    }
    write_results(args.out, result)
    report(result)
    sys.exit(1 if any(bad(r) for r in rows) or not result["summary"]["at_target_at_end"] else 0)


def report(result: dict) -> None:
    def f(v, fmt="{:.2f}"):
        return "-" if v is None else fmt.format(v)

    print(
        "options that differ from `dynamo serve graphs/elastic:Frontend`'s defaults: "
        + " ".join(result["non_default_options"])
    )
    print(
        "| # | t s | fault | params | size | detected s | serving again s (pause s) | recovered s | sent | lost | "
        "wrong | next /scale |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for i, r in enumerate(result["rows"]):
        if "error" in r:
            print(f"| {i} | - | {r['kind']} | fault failed: {r['error']} |")
            continue
        params = ", ".join(f"{k} {v}" for k, v in r["params"].items())
        print(
            f"| {i} | {r['t_s']:.0f} | {r['kind']} | {params} | {r['size_before']} -> {r['target']} | "
            f"{f(r['detected_s'])} | {f(r['serving_again_s'])} ({f(r['longest_pause_s'])}) | {f(r['recovered_s'])} | "
            f"{r['sent']} | {r['lost']} | {r['wrong_tokens']} | {r['next_scale']} |"
        )
    s = result["summary"]
    print(
        f"{s['faults']} faults, {s['sent']} requests, {s['lost']} lost, {s['wrong_tokens']} with wrong tokens, "
        f"{s['not_recovered']} not recovered; at the target size at the end: {s['at_target_at_end']}"
    )
    print(
        f"snapshot: {result['snapshot']}; joiners joined from: "
        + (", ".join(f"{k} {n}" for k, n in result.get("joined_from", {}).items()) or "-")
    )


if __name__ == "__main__":
    main()
