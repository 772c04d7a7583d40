"""Each family's tiny checkpoint served by its own graph (`dynamo serve graphs/elastic:Frontend
--Worker.model=DIR`) through a 2 -> 4 -> 2 scale under streaming clients, judged token for token
against transformers (test_elastic does the same, and more, on the built-in model)."""

from __future__ import annotations

import pytest

from harness.reference import make_checkpoint, reference
from harness.server import Server, Traffic, scale_under_traffic, tokenizer

MAX_TOKENS = 24
PROMPTS = [[5 + i, 17, 42 + i, 99, 7 * i + 3, 250] for i in range(6)]


@pytest.mark.parametrize("arch", ["qwen3_moe", "olmoe", "deepseek_v3", "glm4_moe"])
def test_a_familys_checkpoint_scales_under_traffic_generating_what_transformers_does(arch, tmp_path):
    """A tiny checkpoint of the family served by its own graph, 2 -> 4 -> 2 under streaming
    clients: every completion is transformers' greedy one, the joiners' experts pulled by the
    family's names."""
    path = make_checkpoint(arch, tmp_path / arch, tokenizer=True)
    tokens, _ = reference(path, PROMPTS, MAX_TOKENS)
    want = [tokenizer().decode(t, skip_special_tokens=True) for t in tokens]
    srv = Server(["--Worker.max_ranks=4", f"--Worker.model={path}"], model=None)
    try:
        ops, _ = scale_under_traffic(srv, (4, 2), traffic := Traffic(srv, PROMPTS, MAX_TOKENS, 4), want)
    finally:
        srv.stop()
    assert ops[0]["pull_bytes"] > 0, ops[0]
    assert [op["followup_error"] for op in ops] == ["", ""], srv.story(ops)
    for op in ops:  # streams ran across each commit
        assert any(t0 < op["committed_at"] < t1 for _, _, t0, t1 in traffic.results), op
