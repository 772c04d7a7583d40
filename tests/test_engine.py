"""The DP/EP engine against transformers: token-for-token greedy equality, logits within 1e-4."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest
import torch

from components.engine.models.checkpoint import Checkpoint
from components.engine.request import GenerateRequest, RequestError
from harness.reference import PROMPTS, generate, make_checkpoint, reference, single_rank

MAX_NEW = 10
ARCHS = [
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "olmoe",
    "deepseek_v3",
    "deepseek_v3_q_proj",
    "glm4_moe",
    "glm4_moe_no_qk_norm",
]


@pytest.fixture(scope="module", params=ARCHS)
def model(request, tmp_path_factory):
    path = make_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    tokens, logits = reference(path, PROMPTS, MAX_NEW)
    return path, tokens, logits


def assert_logits_close(got, want):
    got = torch.tensor(got) if not isinstance(got, torch.Tensor) else got
    rel = (got - want).abs().max() / want.abs().max()
    assert rel < 1e-4, f"logits differ: max relative error {rel:.2e}"


@pytest.mark.parametrize("invariant", [True, False], ids=["invariant", "mixed"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_single_rank_matches_transformers(model, device, invariant):
    path, ref_tokens, ref_logits = model
    eng = single_rank(path, device, batch_invariant=invariant)
    eng.start()
    try:
        # All prompts at once: mixed steps hold prefills and decodes together, invariant steps
        # one prompt chunk or every decode (through the one graph of max_seqs rows on CUDA).
        tokens, ends = generate(eng, PROMPTS, MAX_NEW, ignore_eos=True)
        captures = eng.graphs.captures if eng.graphs else 0
        if device == "cuda":  # what modes A and B do in their pause: capture every size again
            eng.call(eng.graphs.recapture).result(120)
            again, _ = generate(eng, PROMPTS, MAX_NEW, ignore_eos=True)
    finally:
        eng.stop()
    assert tokens == ref_tokens
    assert ends == ["length"] * len(PROMPTS)
    if device == "cuda":  # decode ran through the captured graphs, captured once, then again
        assert eng.graphs.replays > 0 and captures == len(eng.graphs.sizes)
        assert again == ref_tokens and eng.graphs.captures == 2 * captures
    # Teacher-forced logits through prefill + decode steps over the KV cache.
    eng = single_rank(path, device)
    for p, ref, want in zip(PROMPTS, ref_tokens, ref_logits):
        from components.engine.scheduler import Sequence

        seq = Sequence(req=GenerateRequest("x", p, MAX_NEW), emit=lambda o: None, tokens=list(p))
        eng.sched.add(seq)
        got = []
        for tok in ref:
            work = eng.sched.schedule()
            with torch.no_grad():
                got.append(eng.model(eng.sched.rows(work).on(eng.device), eng.kv)[0].cpu())
            eng.sched.update(work, eng.sched.advance(work), [tok])
        eng.sched.cancel("x")
        assert_logits_close(torch.stack(got), want)
    eng.comm.close()


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v3"])
def test_bf16_greedy_does_not_change_with_the_load(tmp_path, arch):
    """Each of 32 prompts alone, then all at once through 16 sequence slots (so they start and
    end at different steps beside different neighbours): the same tokens, bit for bit in bf16.
    A model wide enough for bf16 rounding to flip greedy choices: Mixtral-shaped (under mixed
    steps 1 of these 32 completions changed with the load on an H200, and 23 of 32 for the
    5.4 GiB model of bench.mixtral_like), or DeepSeek-shaped (MLA, grouped biased routing, a
    dense first layer) at hidden 1024."""
    from bench import deepseek_like, mixtral_like

    if arch == "mixtral":
        path = mixtral_like.write(tmp_path / "m", 2, 1024, 3584, 8, 8, 2)
    else:
        dims = dict(hidden=1024, heads=16, q_lora=384, kv_lora=256, nope=64, rope=32, v=64, moe=512, dense=2048)
        path = deepseek_like.write(tmp_path / "m", 3, 1, 16, {**dims, "groups": 4})
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(4, 500, (int(n),), generator=g).tolist() for n in torch.randint(1, 60, (32,), generator=g)]
    eng = single_rank(path, "cuda", dtype="bfloat16", max_seqs=16, max_len=512)
    eng.start()
    try:
        alone = [generate(eng, [p], 48, ignore_eos=True)[0][0] for p in prompts]
        loaded, _ = generate(eng, prompts, 48, ignore_eos=True)
    finally:
        eng.stop()
    assert eng.graphs.sizes == [16, 16 + 256]  # decode-only steps, steps with prompt tokens (mixed)
    assert [i for i, (a, b) in enumerate(zip(alone, loaded)) if a != b] == []


class Computed:
    """A step's CUDA event once the device has run it: on the CPU a step is computed as it is
    queued, and with this in its place the step loop reads it back as it does a CUDA step's."""

    def synchronize(self) -> None:
        pass


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_steps_tokens_go_out_once_the_next_step_is_queued(tmp_path, device):
    """Emitting wakes the serving loop, whose streaming of the tokens competes for the GIL with
    the step thread: a step's tokens are held until the next step is queued, or until the thread
    waits for the device with none queued (the last ones), and none is lost or reordered."""
    eng = single_rank(make_checkpoint("mixtral", tmp_path / "ckpt"), device)
    launches = 0
    launch = eng._launch

    def counted(work):
        nonlocal launches
        step = launch(work)
        launches += 1
        return step if device == "cuda" else step._replace(done=Computed())

    eng._launch = counted
    eng.start()
    try:
        (want,), _ = generate(eng, [PROMPTS[2]], MAX_NEW, ignore_eos=True)
        seen, done = [], threading.Event()

        def emit(o):
            seen.append((launches, list(o.token_ids), o.finish_reason))
            if o.finish_reason:
                done.set()

        launches = 0
        eng.submit(GenerateRequest("r", PROMPTS[2], MAX_NEW, ignore_eos=True), emit)
        assert done.wait(60)
    finally:
        eng.stop()
    assert [t for _, ts, _ in seen for t in ts] == want
    assert [r for _, _, r in seen] == [None] * (MAX_NEW - 1) + ["length"]
    # Token j is drawn by the step queued (j + 1)th (the prompt's, then a decode step a token) and
    # read back once the (j + 2)th is queued behind it; it goes out once the (j + 3)th is. The
    # last two go out as the thread waits for the last step, and once it is read back.
    assert [queued for queued, _, _ in seen] == [j + 3 for j in range(MAX_NEW - 2)] + [MAX_NEW, MAX_NEW]


def run_peers(tmp_path, plan) -> list[list[dict]]:
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    procs = [
        subprocess.Popen([sys.executable, "-m", "harness.engine_peer", "--rank", str(r), "--dir", str(tmp_path)])
        for r in range(plan["world"])
    ]
    try:
        for p in procs:
            assert p.wait(timeout=240) == 0, "a peer failed"
    finally:
        for p in procs:
            p.kill()
    return [json.loads((tmp_path / f"report{r}.json").read_text()) for r in range(plan["world"])]


def merged(reports, phase):
    tokens, logits = {}, {}
    for rep in reports:
        tokens.update(rep[phase]["tokens"])
        logits.update(rep[phase]["logits"])
    return tokens, logits


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("world", [2, 4])
def test_ranks_in_processes_match_transformers(model, world, device, tmp_path):
    path, ref_tokens, ref_logits = model
    plan = {
        "world": world,
        "model": str(path),
        "prompts": PROMPTS,
        "max_tokens": MAX_NEW,
        "device": device,
        "phases": [{"active": list(range(world))}],
    }
    reports = run_peers(tmp_path, plan)
    tokens, logits = merged(reports, 0)
    for i, ref in enumerate(ref_tokens):
        assert tokens[str(i)] == ref, f"prompt {i}"
        assert_logits_close(logits[str(i)], ref_logits[i])
    # Every rank computed experts for others: the experts really are spread.
    assert all(rep[0]["rows"] > 0 for rep in reports)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_active_set_changes_in_place(tmp_path, device):
    """4 connected ranks, 2 active, then all 4: experts move, output tokens do not, and on CUDA
    the retained ranks keep their captured decode graphs (no recapture)."""
    path = make_checkpoint("mixtral", tmp_path / "ckpt", seed=1)
    ref_tokens, _ = reference(path, PROMPTS, MAX_NEW)
    plan = {
        "world": 4,
        "model": str(path),
        "prompts": PROMPTS,
        "max_tokens": MAX_NEW,
        "min_ranks": 2,
        "device": device,
        "phases": [{"active": [0, 1]}, {"active": [0, 1, 2, 3]}],
    }
    reports = run_peers(tmp_path, plan)
    for phase in (0, 1):
        tokens, _ = merged(reports, phase)
        assert [tokens[str(i)] for i in range(len(PROMPTS))] == ref_tokens, f"phase {phase}"
    # Phase 0: ranks 2 and 3 hold no experts and compute nothing; phase 1: everyone computes.
    assert [reports[r][0]["rows"] > 0 for r in range(4)] == [True, True, False, False]
    assert all(reports[r][1]["rows"] > 0 for r in range(4))
    assert all(e == -1 for r in (2, 3) for layer in reports[r][0]["experts"] for e in layer)
    if device == "cuda":
        for r in (0, 1):  # graphs replayed in both phases, captured once at start
            assert reports[r][0]["captures"] == reports[r][1]["captures"] == len(reports[r][1]["captures_sizes"])
            assert reports[r][1]["replays"] > reports[r][0]["replays"] > 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_dispatch_follows_the_device_ep_mask(tmp_path, device):
    """Rank 0 of 2, experts placed on both, rank 1 not active: routing reads the device mask, so
    pairs for rank 1 are held back (an error outside warmup, dropped in masked warmup), padding
    rows are neither sent nor counted as load, and the mask keeps its address when the set changes."""
    from components.protocol.placement import balanced_placement

    eng = single_rank(make_checkpoint("mixtral", tmp_path / "ckpt"), device, max_ranks=2)
    mc, R = eng.model_config, 2
    eng.expert_map.install(balanced_placement(mc.num_layers, mc.num_experts, R, eng.slots_per_rank, [0, 1]))
    ep, (layer, moe) = eng.model.ep, eng.model.moe_layers[0]
    ep.sync_mask()
    mask_at = ep.mask.data_ptr()
    assert ep.mask.tolist() == [True, False]

    torch.manual_seed(0)
    x = torch.randn(6, mc.hidden_size, device=eng.device)
    valid = torch.tensor([True] * 4 + [False] * 2, device=eng.device)
    moe.load.zero_()
    d = moe.dispatch(x, valid)
    _, experts = moe.route(x)
    dest = eng.expert_map.route(layer, experts) // eng.slots_per_rank
    to_1 = int((dest[:4] == 1).sum())
    assert 0 < to_1 < 8
    assert d.counts.tolist() == [8 - to_1, 0, to_1, 4]  # rank 0, rank 1, masked, padding
    assert moe.load.sum().item() == 8  # the 4 real rows' pairs, not the padding's
    out = torch.full((12, mc.hidden_size), 7.0, device=eng.device)
    # Host-driven, the exchange raises at once; as device work, the step's check after its sync.
    with pytest.raises(
        RuntimeError,
        match=rf"expert map routes {to_1} \(token, expert\) pairs to ranks outside the active set \[0\]",
    ):
        moe.exchange(d, out)
        ep.check_routes()

    ep.set_masked_warmup(True)
    moe.exchange(d, out)
    n0 = 8 - to_1
    assert (out[n0:] == 0).all()  # masked and padding pairs: nothing came back
    for i in range(n0):  # rank 0's pairs: its own experts' output, row by row
        s = int(d.local[i])
        h = d.rows[i : i + 1]
        want = (torch.nn.functional.silu(h @ moe.w_gate[s].T) * (h @ moe.w_up[s].T)) @ moe.w_down[s].T
        torch.testing.assert_close(out[i : i + 1], want)

    eng.comm.set_active([], 1)
    ep.sync_mask()
    assert ep.mask.tolist() == [False, False] and ep.mask.data_ptr() == mask_at
    eng.comm.close()


def decode_rows():
    from components.engine.models.layers import StepRows

    ids, pos = [5, 9, 2, 7], [3, 0, 10, 1]
    return StepRows(ids, pos, [0, 1, 2, 3], [0, 1, 2, 3], [p + 1 for p in pos], [0, 1, 2, 3], [1] * 4)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_blocks_fed_their_input_normed_with_the_residual_add_compute_the_forward(tmp_path, device):
    """The decode graphs' chaining of blocks: each residual sum made in the norm that reads it
    next (RMSNorm.add_and_norm: one kernel on CUDA), the block taking that normed input (attend's
    `normed`), the last sum normed by the final norm, is bit for bit the eager forward's add, then
    norm, through a MoE block with a shared expert and a dense one."""
    eng = single_rank(
        make_checkpoint("qwen2_moe", tmp_path / "ckpt"), device, dtype="bfloat16" if device == "cuda" else ""
    )
    m, batch = eng.model, decode_rows().on(eng.device)
    want = m(batch, eng.kv)  # writes the rows' keys and values, which the chain below writes again
    blocks = list(m.model.layers)
    x, x_normed = m.model.embed_tokens(batch.input_ids), None
    for i, block in enumerate(blocks):
        h, n = block.attend(x, batch, eng.kv, normed=x_normed)
        norm = blocks[i + 1].input_layernorm if i + 1 < len(blocks) else m.model.norm
        x, x_normed = norm.add_and_norm(block.ffn(n), h)
    assert torch.equal(m.lm_head(x_normed).float(), want)
    eng.comm.close()


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ARCHS)
def test_decode_graphs_compute_the_eager_forwards_logits_bitwise(tmp_path, arch):
    """A decode step replayed from the graphs (residual adds fused into the next norm) against
    the eager forward of the same rows (same shapes, so the same kernels): equal logits."""
    eng = single_rank(make_checkpoint(arch, tmp_path / "ckpt"), "cuda", dtype="bfloat16", cuda_graph_sizes=(4,))
    rows = decode_rows()
    got = eng.graphs.run(rows).clone()
    assert torch.equal(got, eng.model(rows.on(eng.device), eng.kv))
    eng.comm.close()


@pytest.mark.parametrize(
    "device,form",
    [
        ("cpu", "grouped"),
        ("cpu", "per-slot"),
        pytest.param("cuda", "bfloat16", marks=pytest.mark.gpu),
        pytest.param("cuda", "float32", marks=pytest.mark.gpu),
    ],
)
def test_experts_apply_each_rows_slot_and_zero_padding_rows(tmp_path, device, form, monkeypatch):
    """Each row through its own slot's expert, rows marked -1 or past the slots zero: on the CPU
    as grouped GEMMs, or every slot over every row where those do not run; on CUDA through the
    Triton kernels (expert_gemm) in bf16 and in fp32 (no TF32), rows of one slot split over
    several row blocks."""
    from components.engine.models import moe as moe_mod

    if form == "per-slot":
        monkeypatch.setattr(moe_mod, "_grouped_mm_runs", lambda w, x: False)
    dtype = form if device == "cuda" else ""
    eng = single_rank(make_checkpoint("mixtral", tmp_path / "ckpt"), device, dtype=dtype)
    _, moe = eng.model.moe_layers[0]
    S = eng.slots_per_rank
    torch.manual_seed(0)
    local = [3, 0, -1, 3, S - 1, S, 1, 1, -1, 0, 2, 5, 3] + [3] * 20  # slot 3: more rows than a block
    x = torch.randn(len(local), eng.model_config.hidden_size, device=eng.device).to(moe.w_gate.dtype)
    tol = {"rtol": 2e-2, "atol": 1e-3} if dtype == "bfloat16" else {"rtol": 1e-5, "atol": 1e-5}
    got = moe.experts(x, torch.tensor(local, dtype=torch.int32, device=eng.device))
    for i, s in enumerate(local):
        if not 0 <= s < S:
            assert (got[i] == 0).all()
            continue
        h = x[i : i + 1].float()
        w = [t[s].float() for t in (moe.w_gate, moe.w_up, moe.w_down)]
        want = (torch.nn.functional.silu(h @ w[0].T) * (h @ w[1].T)) @ w[2].T
        torch.testing.assert_close(got[i : i + 1].float(), want, **tol)
    assert moe.experts(x[:0], torch.zeros(0, dtype=torch.int32, device=eng.device)).shape == (0, x.shape[1])
    eng.comm.close()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_handed_over_request_replays_to_the_same_tokens(tmp_path, device):
    """A request continued elsewhere after k tokens (prompt + those k, replay=k) takes the steps
    the uninterrupted one took and continues with its tokens, greedy and seeded; in bf16 on a GPU
    too, where a prefill over the k tokens would differ in the last bits and flip near-ties."""
    dtype = "bfloat16" if device == "cuda" else ""
    eng = single_rank(make_checkpoint("mixtral", tmp_path / "ckpt", seed=3), device, dtype=dtype)
    eng.start()
    try:
        for sampling in ({}, {"temperature": 0.8, "top_p": 0.9, "seed": 7}):
            for p in PROMPTS:
                steps = eng.steps
                (whole,), _ = generate(eng, [p], MAX_NEW, ignore_eos=True, **sampling)
                assert eng.steps - steps == MAX_NEW  # one prefill, then a decode per token
                for k in (1, MAX_NEW // 2, MAX_NEW - 1):
                    steps = eng.steps
                    (rest,), _ = generate(eng, [p + whole[:k]], MAX_NEW - k, ignore_eos=True, replay=k, **sampling)
                    assert rest == whole[k:], f"prompt {p}, handed over after {k} tokens, {sampling or 'greedy'}"
                    assert eng.steps - steps == MAX_NEW
        assert eng.sched.replays_diverged == 0
        # Replaying tokens the model would not have produced is noticed, and the stream goes on.
        (whole,), _ = generate(eng, [PROMPTS[0]], 4, ignore_eos=True)
        wrong = [(t + 1) % eng.model_config.vocab_size for t in whole]
        (rest,), ends = generate(eng, [PROMPTS[0] + wrong], 3, ignore_eos=True, replay=4)
        assert len(rest) == 3 and ends == ["length"] and eng.sched.replays_diverged == 1
    finally:
        eng.stop()


def test_bad_requests_are_refused_with_the_reason(tmp_path):
    eng = single_rank(make_checkpoint("mixtral", tmp_path / "ckpt"))
    cases = [
        (GenerateRequest("a", [], 4), "the prompt is empty"),
        (GenerateRequest("b", [1, 2], 300), "context is 256 tokens; the prompt has 2 and max_tokens is 300"),
        (
            GenerateRequest("c", [1, 999], 4),
            "prompt token id 999 at index 1 is outside the vocabulary: valid ids are 0 to 127",
        ),
        (GenerateRequest("d", [1], 0), "max_tokens must be at least 1"),
        (GenerateRequest("e", [1], 4, temperature=1.0, top_p=0.0), "top_p in (0, 1]"),
        (GenerateRequest("g", [1], 4, temperature=1.0, top_k=-1), "top_k must be >= 0 (0: no top-k cut); got -1"),
        (
            GenerateRequest("f", [1, 2], 4, replay=2),
            "replay must leave at least one prompt token: 0 <= replay < 2, got 2",
        ),
    ]
    for req, msg in cases:
        with pytest.raises(RequestError) as e:
            eng.submit(req, lambda o: None)
        assert msg in str(e.value)
    eng.comm.close()


def test_sampling_is_reproducible_with_a_seed_and_stops_on_stop_tokens(tmp_path):
    path = make_checkpoint("mixtral", tmp_path / "ckpt")
    eng = single_rank(path)
    eng.start()
    try:
        a, _ = generate(eng, PROMPTS[:2], MAX_NEW, temperature=0.8, top_p=0.9, seed=7)
        b, _ = generate(eng, PROMPTS[:2], MAX_NEW, temperature=0.8, top_p=0.9, seed=7)
        assert a == b
        greedy, _ = generate(eng, PROMPTS[:1], MAX_NEW, ignore_eos=True)
        stop = greedy[0][3]
        cut, ends = generate(eng, PROMPTS[:1], MAX_NEW, stop_token_ids=[stop], ignore_eos=True)
        assert cut[0] == greedy[0][: greedy[0].index(stop) + 1] and ends == ["stop"]
    finally:
        eng.stop()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_seeded_completion_does_not_depend_on_its_batch(tmp_path, device):
    """The sampling noise is keyed by (seed, position, token): a seeded request draws the same
    tokens alone and batched with other requests (seeded, unseeded, greedy), and top_k=1 is greedy.
    On CUDA the decode rows draw in the sampling graphs."""
    eng = single_rank(make_checkpoint("mixtral", tmp_path / "ckpt"), device)
    eng.start()
    seeded = {"temperature": 0.8, "top_p": 0.9, "top_k": 40, "seed": 7}
    try:
        (alone,), _ = generate(eng, [PROMPTS[2]], MAX_NEW, ignore_eos=True, **seeded)
        (greedy,), _ = generate(eng, [PROMPTS[2]], MAX_NEW, ignore_eos=True)
        assert alone != greedy  # it really sampled
        (top1,), _ = generate(eng, [PROMPTS[2]], MAX_NEW, ignore_eos=True, temperature=1.5, top_k=1, seed=3)
        assert top1 == greedy

        others = [{}, {"temperature": 1.0}, {"temperature": 0.5, "seed": 99}, seeded]
        outs, done = {}, threading.Event()

        def emit(o):
            outs.setdefault(o.request_id, []).extend(o.token_ids)
            if o.finish_reason and sum(len(v) for v in outs.values()) == MAX_NEW * (len(others) + 1):
                done.set()

        eng.pause().result(30)  # every request enters the same first step
        eng.submit(GenerateRequest("x", PROMPTS[2], MAX_NEW, ignore_eos=True, **seeded), emit)
        for i, kw in enumerate(others):
            eng.submit(GenerateRequest(str(i), PROMPTS[i % len(PROMPTS)], MAX_NEW, ignore_eos=True, **kw), emit)
        eng.resume().result(30)
        assert done.wait(120)
        assert outs["x"] == alone
        assert outs["0"] == generate(eng, [PROMPTS[0]], MAX_NEW, ignore_eos=True)[0][0]
        if device == "cuda":
            assert eng.graphs.samplers  # the decode rows drew in a graph
    finally:
        eng.stop()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_temperature_below_the_floor_samples_at_it(tmp_path, device):
    """temperature 1e-45 (a float32 denormal) overflowed logits / T and drew the same token every
    step (here 1, the eos: a completion of one token, finish_reason stop); below MIN_TEMPERATURE
    a request samples at it, as in vLLM, alone or beside another request.
    On CUDA the decode rows draw in the sampling graphs."""
    from components.engine.sampler import MIN_TEMPERATURE

    eng = single_rank(make_checkpoint("mixtral", tmp_path / "ckpt"), device)
    eng.start()
    try:
        kw = {"ignore_eos": True, "seed": 3}
        (floor,), _ = generate(eng, [PROMPTS[1]], MAX_NEW, temperature=MIN_TEMPERATURE, **kw)
        for t in (1e-45, 1e-38, 1e-6):
            (tiny,), _ = generate(eng, [PROMPTS[1]], MAX_NEW, temperature=t, **kw)
            assert tiny == floor, t
        batched, _ = generate(eng, [PROMPTS[1], PROMPTS[0]], MAX_NEW, temperature=1e-45, **kw)
        assert batched[0] == floor and len(set(floor)) > 1
        if device == "cuda":
            assert eng.graphs.samplers
    finally:
        eng.stop()


@pytest.mark.gpu
def test_the_sampling_graph_draws_what_the_eager_sampler_draws(tmp_path):
    """Over the same logits and parameters, with padding rows behind the real ones: the same ids."""
    from components.engine.sampler import SampleParams, sample

    eng = single_rank(make_checkpoint("mixtral", tmp_path / "ckpt"), "cuda", cuda_graph_sizes=(8,))
    g = eng.graphs
    gen = torch.Generator(device="cuda").manual_seed(0)
    for real in (1, 5, 8):
        g.logits.copy_(torch.randn(g.logits.shape, generator=gen, device="cuda") * 3)
        g._last = 8
        params = SampleParams(
            temperature=[0.0, 0.7, 1.0, 1.3, 0.9, 0.5, 2.0, 1.0][:real],
            top_p=[1.0, 0.9, 1.0, 0.5, 0.95, 1.0, 0.8, 1.0][:real],
            top_k=[0, 0, 40, 5, 0, 1, 0, 3][:real],
            seed=[7, 8, 9, 2**62, 11, 12, 13, 14][:real],
            position=[3, 4, 5, 6, 7, 8, 9, 1000][:real],
        )
        got = g.sample(params).clone()
        assert torch.equal(got, sample(g.logits[:real], *params.on("cuda"))), real
    assert list(g.samplers) == [8]  # captured once, replayed after
    eng.comm.close()


def test_the_context_length_defaults_to_the_models_capped_by_memory(tmp_path, monkeypatch):
    """A model with 512 positions serves with the default max_len (its own, as vLLM defaults it);
    with too little memory for that, the longest multiple of 256 that fits; a length the model
    does not have is refused with the reason the worker prints."""
    from components.engine import rank
    from components.engine.models.checkpoint import Checkpoint

    mc = Checkpoint.open(str(make_checkpoint("mixtral", tmp_path / "m"))).config
    assert mc.max_position_embeddings == 512
    cpu = torch.device("cpu")
    assert rank.context_length(0, mc, 16, torch.float32, cpu) == 512
    assert rank.context_length(300, mc, 16, torch.float32, cpu) == 300
    with pytest.raises(ValueError, match="^max_len 1024 exceeds the model's 512 positions$"):
        rank.context_length(1024, mc, 16, torch.float32, cpu)
    per_token = 2 * mc.num_layers * 17 * mc.num_kv_heads * mc.head_dim * 4
    monkeypatch.setattr(rank, "_free_memory", lambda device: 4 * per_token * 300)
    assert rank.context_length(0, mc, 16, torch.float32, cpu) == 256
    monkeypatch.setattr(rank, "_free_memory", lambda device: 4 * per_token * 200)
    with pytest.raises(ValueError, match="does not fit in cpu memory even at 256 tokens each: lower Worker.max_seqs"):
        rank.context_length(0, mc, 16, torch.float32, cpu)


def test_mps_is_seen_by_its_control_socket(tmp_path, monkeypatch):
    """`ep_transport=auto` takes the peer windows for ranks sharing a GPU only when an MPS daemon
    runs them side by side: its pipe directory ($CUDA_MPS_PIPE_DIRECTORY) holds `control`."""
    from components.engine.rank import mps_running

    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    assert not mps_running()
    (tmp_path / "control").touch()
    assert mps_running()


def test_rows_grouped_by_slot_keep_their_order_within_a_slot():
    """group_by_slot (the experts' counting sort, CPU and CUDA alike) orders rows as a stable
    argsort of their slots, rows of no slot last, and ends each slot's group where its rows end."""
    from components.engine.models.moe import group_by_slot

    g = torch.Generator().manual_seed(0)
    for _ in range(100):
        slots = int(torch.randint(1, 10, (), generator=g))
        key = torch.randint(0, slots + 1, (int(torch.randint(1, 600, (), generator=g)),), generator=g)
        rows, ends = group_by_slot(key, slots)
        real = int((key < slots).sum())
        assert rows[:real].tolist() == torch.argsort(key, stable=True)[:real].tolist()
        assert ends.tolist() == torch.cumsum(torch.bincount(key, minlength=slots + 1)[:slots], 0).tolist()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_an_fp8_deepseek_checkpoint_equals_transformers_on_its_weights_dequantised(tmp_path, device):
    """DeepSeek's published FP8 layout (e4m3 weights, a weight_scale_inv per 16x16 block here, the
    last blocks partial), dequantised at load: the same tokens and logits as transformers run on
    the dequantised weights in fp32."""
    from harness.reference import fp8_checkpoint

    src = make_checkpoint("deepseek_v3", tmp_path / "src", seed=2)
    fp8_checkpoint(src, tmp_path / "fp8", tmp_path / "plain")
    ref_tokens, _ = reference(tmp_path / "plain", PROMPTS, MAX_NEW)
    eng = single_rank(tmp_path / "fp8", device)
    # Served dequantised, in fp32; quantising moved the weights, so this is not the float model.
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    with Checkpoint.open(src) as float_model:
        dequantised = eng.ckpt.get(name, dtype=None)
        assert dequantised.dtype == torch.float32 and not torch.equal(dequantised, float_model.get(name))
    eng.start()
    try:
        tokens, _ = generate(eng, PROMPTS, MAX_NEW, ignore_eos=True)
    finally:
        eng.stop()
    assert tokens == ref_tokens
