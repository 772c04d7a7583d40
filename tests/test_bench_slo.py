"""bench.slo's arithmetic: the trace is fixed by its seed and its rate doubles; the rolling p95
counts a failed request as the 30 s penalty; the summary splits tokens/s at the scale marks."""

from __future__ import annotations

import pytest

from bench import slo


def test_the_trace_is_its_seed_and_its_rate_doubles():
    a = slo.trace(7, 200.0, 5.0, 10.0, 32, 16, 1000)
    assert a == slo.trace(7, 200.0, 5.0, 10.0, 32, 16, 1000)
    assert a != slo.trace(8, 200.0, 5.0, 10.0, 32, 16, 1000)
    first = sum(1 for r in a if r["timestamp"] < 50_000)
    last = sum(1 for r in a if r["timestamp"] >= 150_000)
    # Expected 5.625 * 50 = 281 and 9.375 * 50 = 469 arrivals: well apart for any seed.
    assert 200 < first < 360 and 380 < last < 560
    assert all(8 <= len(r["payload"]["prompt"]) <= 128 and 4 <= r["payload"]["max_tokens"] <= 64 for r in a)
    assert all(3 <= t < 1000 for r in a for t in r["payload"]["prompt"])
    assert [r["timestamp"] for r in a] == sorted(r["timestamp"] for r in a)


def req(start: float, ttft: float | None, tokens: int = 10, error: str = "") -> dict:
    return {"start": start, "end": start + 1.0, "ttft_s": ttft, "itl_s": 0.01, "tokens": tokens, "error": error}


def test_a_failed_request_counts_the_penalty_in_the_rolling_p95():
    reqs = [req(float(t), 0.1) for t in range(1, 40)] + [req(20.5, None, 0, "connection refused")]
    curve = dict(slo.rolling_p95(reqs, 0.0, window_s=10.0))
    assert curve[10.0] == pytest.approx(0.1)
    assert curve[25.0] == slo.PENALTY_S  # 11 requests in (15, 25]: the p95 is the worst
    assert curve[31.0] == pytest.approx(0.1)  # out of the window again


def test_the_summary_splits_at_the_marks():
    reqs = [req(float(t), 0.2 if t < 50 else 0.05, tokens=10) for t in range(100)]
    s = slo.summary(reqs, 0.0, [{"t": 40.0, "t_end": 50.0}], slo_s=0.1, window_s=10.0)
    assert (s["requests"], s["completed"], s["failed"]) == (100, 100, 0)
    assert s["tok_s_before"] == pytest.approx(10.0) and s["tok_s_after"] == pytest.approx(10.0)
    assert s["ttft_p50_s"] == pytest.approx(0.05) and s["ttft_p99_s"] == pytest.approx(0.2)
    assert s["seconds_over_slo"] > 0
