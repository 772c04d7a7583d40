"""bench.consistency: its reference runs with the graph's Worker options as `dynamo serve` resolves
them, each phase is charged its requests (one that overlaps a scale is that scale's), and on CPU
a short 1 -> 2 -> 1 run under traffic changes no completion and fails no request."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench import consistency
from components.graph.serve import UsageError
from harness.server import ROOT


def test_the_worker_options_are_those_dynamo_serve_resolves():
    w = consistency.worker_config(["--Worker.dtype=bfloat16", "--Worker.max_ranks", "2", "--Planner.enabled=false"])
    assert (w.dtype, w.max_ranks, w.device, w.max_seqs) == ("bfloat16", 2, "cpu", 16)
    with pytest.raises(UsageError, match=r"^--Worker\.dtyp: Worker has no field 'dtyp' \(fields: model, "):
        consistency.worker_config(["--Worker.dtyp=bfloat16"])


def test_the_requests_are_their_seed_half_greedy_half_seeded():
    prompts, sampling = consistency.requests(3, 64, 1024, 512)
    assert (prompts, sampling) == consistency.requests(3, 64, 1024, 512)
    assert prompts != consistency.requests(4, 64, 1024, 512)[0]
    lengths = [len(p) for p in prompts]
    assert min(lengths) >= 1 and max(lengths) <= 1024 and min(lengths) < 16 and max(lengths) > 256
    assert all(3 <= t < 512 for p in prompts for t in p)
    assert sampling[:32] == [{}] * 32
    assert sampling[32:] == [{"temperature": 0.8, "top_p": 0.9, "seed": 3032 + i} for i in range(32)]


def test_each_phase_is_charged_its_requests():
    phases = [
        {"phase": "size 1", "t_start": 0.0, "t_end": 10.0, "errors_at": 0},
        {"phase": "scaling 1 -> 2", "t_start": 10.0, "t_end": 12.0, "errors_at": 1, "operation": {"phase": "done"}},
        {"phase": "size 2", "t_start": 12.0, "t_end": 20.0, "errors_at": 1},
    ]
    reference = ["a", "b"]
    sampling = [{}, {"temperature": 0.8, "top_p": 0.9, "seed": 1}]
    results = [
        (0, "a", 1.0, 2.0),  # size 1
        (1, "x", 8.0, 10.5),  # overlaps the scale: its, and changed
        (0, "a", 11.9, 13.0),  # overlaps it too
        (1, "b", 12.5, 14.0),  # size 2
        (0, "y", 19.0, 21.0),  # ended after the last window: the last phase's
    ]
    errors = [(0, "RuntimeError('HTTP 503: no serving rank (operation op-1)')"), (1, "RuntimeError('boom')")]
    consistency.settle(phases, results, errors, reference, sampling)
    counts = [
        tuple(ph[k] for k in ("completed", "failed", "greedy", "greedy_changed", "seeded", "seeded_changed"))
        for ph in phases
    ]
    assert counts == [(1, 1, 1, 0, 0, 0), (2, 0, 1, 0, 1, 1), (2, 1, 1, 1, 1, 0)]
    assert phases[1]["changed"] == [{"prompt": 1, "got": "x", "alone": "b"}]
    assert phases[0]["failure_reasons"] == {"RuntimeError('HTTP 503: no serving rank')": 1}
    assert all("errors_at" not in ph for ph in phases)
    assert consistency.bad(phases)
    for ph in phases:
        ph |= {"failed": 0, "greedy_changed": 0, "seeded_changed": 0}
    assert not consistency.bad(phases)
    assert consistency.bad(phases[:1] + [phases[1] | {"operation": {"phase": "aborted"}}])
    assert consistency.bad(phases[:1] + [phases[2] | {"completed": 0}])


def test_a_short_run_across_1_2_1_changes_nothing(tmp_path):
    out = tmp_path / "consistency.json"
    cmd = [sys.executable, "-m", "bench.consistency", "--clients", "4", "--prompts", "8", "--max-prompt", "64"]
    cmd += ["--max-tokens", "8", "--phase-s", "2", "--out", str(out)]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    r = json.loads(out.read_text())
    assert [ph["phase"] for ph in r["phases"]] == ["size 1", "scaling 1 -> 2", "size 2", "scaling 2 -> 1", "size 1"]
    assert all(ph["completed"] > 0 and ph["failed"] == 0 for ph in r["phases"])
    assert r["totals"]["greedy_changed"] == r["totals"]["seeded_changed"] == r["totals"]["failed"] == 0
    assert r["totals"]["greedy"] > 0 and r["totals"]["seeded"] > 0
    assert r["totals"]["completed"] == sum(ph["completed"] for ph in r["phases"])
    ops = [ph["operation"] for ph in r["phases"] if "operation" in ph]
    assert [(op["kind"], op["from_size"], op["to_size"], op["phase"]) for op in ops] == [
        ("up", 1, 2, "done"),
        ("down", 2, 1, "done"),
    ]
    assert all(op["downtime_s"] > 0 for op in ops)
    assert [ph["active_after"] for ph in r["phases"] if "operation" in ph] == [[0, 1], [0]]
    assert r["non_default_options"] == ["--Worker.dp_size=1", "--Planner.enabled=false"]
    assert (
        r["rank0"]["device"] == "cpu"
        and r["rank0"]["max_batched_tokens"] == 256
        and r["requests"]["prompts"] == 8
        and r["requests"]["greedy"] == 4
    )
    assert "| total |" in run.stdout
