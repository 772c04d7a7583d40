"""bench.decode: the weight floor it reports beside the measurements, and CI-size runs of it and
bench.step on CPU."""

from __future__ import annotations

import json

import pytest

from bench import decode

E, K, DENSE, EXPERT = 8, 2, 1000.0, 100.0


def report(rank: int, device: str, experts: list[int]) -> dict:
    return {"device": device, "dense_bytes": DENSE, "expert_bytes": EXPERT, "top_k": K, "local_experts": [experts]}


def run(load: list[int]) -> dict:
    return {"load": [load]}


def test_floor_reads_the_touched_experts_and_adds_up_ranks_per_device():
    uniform = [10] * E  # 40 tokens, each to K of E experts: a share of 1/4 each
    one = [report(0, "cuda:0", list(range(E)))]
    # One token touches exactly K experts.
    f = decode.weight_floor(one, [run(uniform)], batch=1, hbm_gbps=1.0)
    assert f["experts_touched_per_rank"] == [pytest.approx(K)]
    assert f["floor_step_ms"] == pytest.approx((DENSE + K * EXPERT) / 1e9 * 1e3)
    # At a large batch every expert is touched.
    f = decode.weight_floor(one, [run(uniform)], batch=256, hbm_gbps=1.0)
    assert f["experts_touched_per_rank"] == [pytest.approx(E)]
    # An expert no token chooses is never read.
    f = decode.weight_floor(one, [run([20, 20] + [0] * (E - 2))], batch=256, hbm_gbps=1.0)
    assert f["experts_touched_per_rank"] == [pytest.approx(2)]
    # Two ranks, experts split: on two devices the busiest sets the step; on one they add up.
    halves = [list(range(4)), list(range(4, 8))]
    apart = [report(r, f"cuda:{r}", halves[r]) for r in range(2)]
    shared = [report(r, "cuda:0", halves[r]) for r in range(2)]
    runs = [run([5] * E), run([5] * E)]
    a = decode.weight_floor(apart, runs, batch=128, hbm_gbps=1.0)
    s = decode.weight_floor(shared, runs, batch=128, hbm_gbps=1.0)
    assert a["floor_step_ms"] == pytest.approx((DENSE + 4 * EXPERT) / 1e6)
    assert s["floor_step_ms"] == pytest.approx(2 * a["floor_step_ms"])
    assert a["floor_tok_s"] == pytest.approx(2 * 128 / (a["floor_step_ms"] / 1e3))


def test_a_ci_size_run_on_cpu(tmp_path):
    out = tmp_path / "decode.json"
    decode.main(["--ranks", "1,2", "--batch", "1,2", "--prompt-len", "4", "--gen-len", "3", "--out", str(out)])
    result = json.loads(out.read_text())
    rows = result["results"]
    assert [(r["ranks"], r["seqs_per_rank"]) for r in rows] == [(1, 1), (1, 2), (2, 1), (2, 2)]
    for r in rows:
        # gen 3: one prefill token, then 2. The decode phase starts once every sequence has its
        # first token; a sequence whose prompt arrived a step earlier than another's made its
        # second token in that mixed step, which is counted in neither phase.
        seqs = r["ranks"] * r["seqs_per_rank"]
        assert seqs <= r["decode_tokens"] <= 2 * seqs
        assert r["decode_tok_s_total"] > 0 and r["floor_step_ms"] > 0 and r["devices"] == ["cpu"]


def test_step_bench_times_each_phase_of_the_real_step_loop(tmp_path):
    """bench.step at CI size on the CPU: every decode step is timed phase by phase, the phases fit
    in the step, and the JSON holds one row per batch size."""
    from bench import step

    out = tmp_path / "step.json"
    assert (
        step.main(["--device", "cpu", "--batch", "1,3", "--prompt-len", "4", "--gen-len", "5", "--out", str(out)]) == 0
    )
    rows = json.loads(out.read_text())["rows"]
    assert [r["batch"] for r in rows] == [1, 3]
    for r in rows:
        assert r["decode_steps"] >= 3  # 5 tokens: the first comes from the prefill step
        assert sum(r["phase_ms_p50"].values()) <= r["step_ms_p50"] * 1.5
        assert r["graph_ms"] is None  # no graphs on the CPU


def test_step_bench_times_steps_with_a_prompt_beside_the_decodes(tmp_path):
    """bench.step --beside on the CPU: a second pass per batch size in which one prompt at a time
    joins the decodes; its steps and the decode steps between them are counted and timed apart."""
    from bench import step

    out = tmp_path / "step.json"
    args = ["--device", "cpu", "--batch", "2", "--prompt-len", "4", "--gen-len", "24", "--beside", "20"]
    assert step.main([*args, "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    side = row["beside"]
    assert side["prompt_tokens"] == 20 and side["mixed_steps"] >= 3 and side["decode_steps"] >= 3
    assert side["mixed_ms_p50"] > 0 and side["decode_ms_p50"] > 0
    assert side["us_per_prompt_token"] == pytest.approx((side["mixed_ms_p50"] - side["decode_ms_p50"]) * 1e3 / 20)
    with pytest.raises(SystemExit):
        step.main([*args[:-1], "-1"])


def test_burst_bench_cuts_prompts_by_budget_without_changing_what_they_draw(tmp_path):
    """bench.burst at CI size on the CPU: a row per budget and piece, every prompt's first token
    the same under each, and a bad --configs refused with what is wrong."""
    from bench import burst

    out = tmp_path / "burst.json"
    args = ["--device", "cpu", "--prompts", "3", "--prompt-len", "40", "--repeats", "1", "--out", str(out)]
    assert burst.main([*args, "--configs", "256:64,32:16"]) == 0
    res = json.loads(out.read_text())
    assert [(r["budget"], r["piece"]) for r in res["rows"]] == [(256, 64), (32, 16)]
    assert res["first_tokens_same"] and all(len(r["first_tokens"]) == 3 for r in res["rows"])
    assert all(r["prompt_tok_s"] > 0 for r in res["rows"])
    with pytest.raises(SystemExit):
        burst.main([*args, "--configs", "256"])
