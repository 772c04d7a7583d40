"""bench.serve's arithmetic: the prefill floor's FLOPs per token count what a token meets (its
top-k experts, not all of them; no embedding lookup), and a point reads aiperf's export."""

from __future__ import annotations

from bench import aiperf, serve
from components.engine.models.builtin import builtin_model_dir
from components.engine.models.registry import read_config


def test_flops_per_token_counts_the_top_k_experts_and_no_embedding():
    c = read_config(builtin_model_dir() / "config.json")
    h, d = c.hidden_size, c.head_dim
    attention = h * c.num_heads * d * 2 + h * c.num_kv_heads * d * 2  # q, o; k, v
    experts = c.top_k * 3 * h * c.moe_intermediate_size
    router = c.num_experts * h
    active = c.num_layers * (attention + experts + router) + c.vocab_size * h  # lm_head
    got = serve.flops_per_token(builtin_model_dir())
    assert got["active_matmul_weights"] == active and got["flops_per_token"] == 2 * active


def test_a_point_is_what_aiperf_exported():
    agg = {
        "time_to_first_token": {"unit": "ms", "p50": 10.0, "p95": 20.0, "p99": 30.0},
        "inter_token_latency": {"unit": "ms", "p50": 1.5, "p95": 2.5},
        "output_token_throughput": {"unit": "tokens/sec", "avg": 900.0},
        "input_token_throughput": {"unit": "tokens/sec", "avg": 1800.0},
        "request_throughput": {"unit": "requests/sec", "avg": 3.0},
        "goodput": {"unit": "requests/sec", "avg": 2.0},
    }
    reqs = [{"error": ""}, {"error": "TimeoutError()"}]
    p = serve.point(agg, reqs)
    assert (p["requests"], p["failed"], p["errors"]) == (2, 1, ["TimeoutError()"])
    assert (p["ttft_p50_ms"], p["ttft_p95_ms"], p["ttft_p99_ms"], p["itl_p50_ms"], p["itl_p95_ms"]) == (
        10,
        20,
        30,
        1.5,
        2.5,
    )
    assert (p["output_tok_s"], p["prompt_tok_s"], p["request_s"], p["goodput_request_s"]) == (900, 1800, 3, 2)


def test_the_rows_are_their_seed():
    a = aiperf.rows(3, 20, 64, 32, 500)
    assert a == aiperf.rows(3, 20, 64, 32, 500) and a != aiperf.rows(4, 20, 64, 32, 500)
    assert all(16 <= len(r["payload"]["prompt"]) <= 256 and 8 <= r["payload"]["max_tokens"] <= 128 for r in a)
