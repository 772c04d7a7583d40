"""The engine's Triton kernels against torch: decode attention (decode_attention.py) against
scaled_dot_product_attention and, over MLA's latent cache, against deepseek_v3.latent_decode; the
expert GEMMs (expert_gemm.py) against SwiGLU in fp32 and their grouping of rows by slot against
the torch code it replaces (SparseMoE.experts' CPU form). Compiled on a GPU; on the CPU under
Triton's interpreter (harness.triton_interpreter), in a subprocess: the interpreter must be on
before a kernel is defined (at import), and no other test may get interpreted kernels."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.bfloat16: {"rtol": 2e-2, "atol": 2e-2}}


def attention_reference(q, kc, vc, slots, ctx) -> torch.Tensor:
    """Each row alone through SDPA over its own cache rows below its context length, in fp32."""
    out = []
    for i, (s, n) in enumerate(zip(slots.tolist(), ctx.tolist())):
        keys, vals = (c[s, :n].transpose(0, 1).float() for c in (kc, vc))
        out.append(F.scaled_dot_product_attention(q[i].float().unsqueeze(1), keys, vals, enable_gqa=True))
    return torch.stack(out).squeeze(2)


def check_decode_attention(device: str, dtype: torch.dtype, nh: int, nkv: int, hd: int, max_len: int) -> None:
    """Against SDPA at context lengths 1 to max_len around the block size; every cache position a
    row must not read is NaN, so one that leaked into a result would show; and a row's output is
    bitwise the same alone, in a batch of 16 padded with scratch rows (context 1), and in a batch
    of another size."""
    from components.engine.kernels.decode_attention import BLOCK_N, decode_attention

    torch.manual_seed(0)
    ctx = [1, BLOCK_N - 1, BLOCK_N, BLOCK_N + 1, max_len, max_len // 2 + 3, 2]
    seqs, scratch = len(ctx), len(ctx)  # one slot per sequence and a scratch slot behind them
    shape = (seqs + 1, max_len, nkv, hd)
    kc, vc = (torch.randn(shape, device=device).to(dtype) for _ in range(2))
    slots = torch.tensor(list(range(seqs)) + [scratch] * (16 - seqs), device=device)
    lens = torch.tensor(ctx + [1] * (16 - seqs), device=device)
    q = torch.randn(len(lens), nh, hd, device=device).to(dtype)
    want = attention_reference(q, kc, vc, slots, lens)
    for c in (kc, vc):
        for s, n in zip(slots.tolist(), lens.tolist()):
            c[s, n:] = float("nan")
    got = decode_attention(q, kc, vc, slots, lens)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), want, **TOL[dtype])
    for i in range(seqs):
        alone = decode_attention(q[i : i + 1], kc, vc, slots[i : i + 1], lens[i : i + 1])
        assert torch.equal(alone[0], got[i]), f"row {i} (context {ctx[i]}) differs alone and batched"
    last = decode_attention(q[seqs - 2 :], kc, vc, slots[seqs - 2 :], lens[seqs - 2 :])
    assert torch.equal(last, got[seqs - 2 :])


def check_prompt_rows(device: str, dtype: torch.dtype, nh: int, nkv: int, hd: int) -> None:
    """A mixed step's rows: decodes alone, then prompt pieces a token a row (a row's context ending
    at itself) and padding, several rows to a program. Against SDPA; every row bitwise the same as
    alone, whichever rows share its program (packs from row 3, from row 0, from row 1); every
    cache position past what a piece's rows may read is NaN."""
    from components.engine.kernels.decode_attention import BLOCK_N, decode_attention

    torch.manual_seed(0)
    max_len, scratch = 2 * BLOCK_N + 40, 5
    decodes = [(0, BLOCK_N + 1), (1, 1), (2, 2 * BLOCK_N)]
    pieces = [(3, BLOCK_N - 5, BLOCK_N + 30), (4, 0, 7), (0, BLOCK_N + 1, BLOCK_N + 3)]  # slot, first, end
    rows = decodes + [(s, p + 1) for s, a, b in pieces for p in range(a, b)] + [(scratch, 1)] * 5
    slots = torch.tensor([s for s, _ in rows], device=device)
    lens = torch.tensor([n for _, n in rows], device=device)
    kc, vc = (torch.randn(scratch + 1, max_len, nkv, hd, device=device).to(dtype) for _ in range(2))
    q = torch.randn(len(rows), nh, hd, device=device).to(dtype)
    want = attention_reference(q, kc, vc, slots, lens)
    for c in (kc, vc):
        for s in range(scratch + 1):
            c[s, max(n for t, n in rows if t == s) :] = float("nan")
    got = decode_attention(q, kc, vc, slots, lens, alone=len(decodes))
    torch.testing.assert_close(got.float(), want, **TOL[dtype])
    for i in range(len(rows)):
        alone = decode_attention(q[i : i + 1], kc, vc, slots[i : i + 1], lens[i : i + 1])
        assert torch.equal(alone[0], got[i]), f"row {i} {rows[i]} differs in a program with others"
    for at in (0, 1):
        assert torch.equal(decode_attention(q, kc, vc, slots, lens, alone=at), got), at


def check_latent_decode(device: str, dtype: torch.dtype, nh: int, lora: int, rope: int, max_len: int) -> None:
    """MLA's decode against the torch form it replaces on CUDA (deepseek_v3.latent_decode, in
    fp32), as check_decode_attention: contexts around the block size, NaN past each context,
    a row bitwise the same alone and in batches of other sizes."""
    from components.engine.kernels.decode_attention import LATENT_BLOCK_N, latent_decode_attention
    from components.engine.models.deepseek_v3 import latent_decode

    torch.manual_seed(0)
    ctx = [1, LATENT_BLOCK_N - 1, LATENT_BLOCK_N, LATENT_BLOCK_N + 1, max_len, max_len // 2 + 3, 2]
    seqs, scratch = len(ctx), len(ctx)
    cache = torch.randn(seqs + 1, max_len, 1, lora + rope, device=device).to(dtype)
    slots = torch.tensor(list(range(seqs)) + [scratch] * (16 - seqs), device=device)
    lens = torch.tensor(ctx + [1] * (16 - seqs), device=device)
    q = torch.randn(len(lens), nh, lora + rope, device=device).to(dtype)
    scale = 0.7 / (lora + rope) ** 0.5  # not SDPA's default: the kernel takes the family's
    want = latent_decode(q.float(), cache.float(), lora, slots, lens, max_len, scale)
    for s, n in zip(slots.tolist(), lens.tolist()):
        cache[s, n:] = float("nan")

    def attend(rows):  # the query's two parts as strided views of one tensor
        return latent_decode_attention(q[rows, :, :lora], q[rows, :, lora:], cache, slots[rows], lens[rows], scale)

    got = attend(slice(None))
    assert got.dtype == dtype and got.shape == (len(lens), nh, lora)
    torch.testing.assert_close(got.float(), want, **TOL[dtype])
    for i in range(seqs):
        assert torch.equal(attend(slice(i, i + 1))[0], got[i]), f"row {i} (context {ctx[i]}) differs alone and batched"
    assert torch.equal(attend(slice(seqs - 2, None)), got[seqs - 2 :])


def check_latent_rotary_cache(device: str, dtype: torch.dtype, interleave: bool, table_dtype: torch.dtype) -> None:
    """latent_rotary_cache_write against LatentAttention's torch form (deinterleave, layers.Rotary,
    the cache row [latent, k] stored at (slot, position)) bit for bit, from slices of the
    projections as the layer has them; nothing else in the cache changes; a token alone the same."""
    from components.engine.kernels.latent_cache import latent_rotary_cache_write
    from components.engine.models.deepseek_v3 import _deinterleave
    from components.engine.models.layers import Rotary

    torch.manual_seed(0)
    nh, nope, rope, lora, max_len = 3, 8, 16, 24, 40
    rot = Rotary(rope, 10000.0, max_len).to(table_dtype).to(device)
    pos = torch.tensor([0, 5, max_len - 1, 17, 3], device=device)
    slots = torch.tensor([2, 0, 1, 2, 3], device=device)
    T = len(pos)
    q_nope, q_rope = (torch.randn(T, nh, nope + rope) * 4).to(dtype).to(device).split([nope, rope], dim=-1)
    latent, k_rope = (torch.randn(T, lora + rope) * 4).to(dtype).to(device).split([lora, rope], dim=-1)
    cache0 = torch.randn(5, max_len, 1, lora + rope).to(dtype).to(device)
    order = _deinterleave if interleave else (lambda x: x)
    want_q = rot(order(q_rope), pos)
    want = cache0.clone()
    want[slots, pos] = torch.cat((latent.unsqueeze(1), rot(order(k_rope.unsqueeze(1)), pos)), dim=-1)
    cache = cache0.clone()
    got = latent_rotary_cache_write(q_rope, k_rope, latent, rot.cos, rot.sin, pos, slots, cache, interleave)
    assert got.dtype == dtype and torch.equal(got, want_q)
    assert torch.equal(cache, want)
    for i in (0, T - 1):
        one, alone = slice(i, i + 1), cache0.clone()
        q1 = latent_rotary_cache_write(
            q_rope[one], k_rope[one], latent[one], rot.cos, rot.sin, pos[one], slots[one], alone, interleave
        )
        assert torch.equal(q1[0], got[i]) and torch.equal(alone[slots[i], pos[i]], cache[slots[i], pos[i]])


def check_experts(device: str, dtype: torch.dtype, tiles=None) -> None:
    """Each row through its own slot's expert, rows of no slot (-1, S, beyond) zero; slot 1 has
    more rows than a row block and slots 0 and 2 fourteen blocks each (a prompt chunk's, more
    blocks than the grid has programs, so a program runs several); the count
    gains the rows with a slot; a row's result is bitwise the same alone. (On a GPU, test_engine
    runs these kernels through the MoE layer.) `tiles`: another tiling than the engine's."""
    from components.engine.kernels.expert_gemm import TILES, swiglu_experts

    tiles = tiles or TILES
    torch.manual_seed(0)
    S, H, I = 4, 64, 96
    wg, wu = (torch.randn(S, I, H, device=device).to(dtype) * 0.1 for _ in range(2))
    wd = torch.randn(S, H, I, device=device).to(dtype) * 0.1
    m = tiles.m
    local = [3, 0, -1, 3, 1, 2, 0, S, S + 5] + [1] * (m + 3) + [2, 0] * (14 * m + 1)
    local = torch.tensor(local, dtype=torch.int32, device=device)
    x = torch.randn(len(local), H, device=device).to(dtype)
    count = torch.tensor([2], device=device)
    got = swiglu_experts(x, local, wg, wu, wd, count, tiles)
    assert got.dtype == dtype
    assert count.item() == 2 + len(local) - 3
    for i, s in enumerate(local.tolist()):
        if not 0 <= s < S:
            assert (got[i] == 0).all()
            continue
        h = x[i : i + 1].float()
        want = (F.silu(h @ wg[s].float().T) * (h @ wu[s].float().T)) @ wd[s].float().T
        torch.testing.assert_close(got[i : i + 1].float(), want, **TOL[dtype])
    for i in (0, 4, len(local) - 2, len(local) - 1):
        alone = swiglu_experts(x[i : i + 1], local[i : i + 1], wg, wu, wd, tiles=tiles)
        assert torch.equal(alone[0], got[i]), f"row {i} differs alone and batched"


def check_group_rows(device: str) -> None:
    """group_rows: bitwise the torch form SparseMoE.experts runs on the CPU (slot validity, key,
    moe.group_by_slot) and its count of rows with a slot, for int32 and int64 slots, 1 to 64
    slots, a row or thousands (more than one block of the scan), none with a slot or all."""
    from components.engine.kernels.expert_gemm import TILES, group_rows
    from components.engine.models.moe import group_by_slot

    g = torch.Generator().manual_seed(0)
    cases = [(1, 1), (7, 3), (300, 8), (4096, 8), (4100, 64), (9000, 2), (50, 64)]
    for n, (M, S) in enumerate(cases):
        local = torch.randint(-2, S + 3, (M,), generator=g, dtype=torch.int32 if n % 2 else torch.int64)
        if n == 5:
            local[:] = -1
        if n == 6:
            local = torch.randint(0, S, (M,), generator=g)
        local = local.to(device)
        count = torch.tensor([5], device=device)
        rows, ends, blocks = group_rows(local, S, count)
        real = (local >= 0) & (local < S)
        want_rows, want_ends = group_by_slot(torch.where(real, local.long(), S), S)
        assert torch.equal(rows, want_rows) and torch.equal(ends, want_ends), (M, S)
        sizes = torch.diff(want_ends.long(), prepend=torch.zeros(1, dtype=torch.long, device=device))
        assert torch.equal(blocks.long(), torch.cumsum((sizes + TILES.m - 1) // TILES.m, 0)), (M, S)
        assert count.item() == 5 + int(real.sum()), (M, S)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("nh,nkv,hd,max_len", [(32, 8, 128, 1000), (4, 2, 8, 200)])
def test_decode_attention_matches_sdpa_and_is_batch_invariant(dtype, nh, nkv, hd, max_len):
    """Mixtral's heads, and the tiny test model's (head dim 8, below a dot's 16)."""
    check_decode_attention("cuda", dtype, nh, nkv, hd, max_len)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("nh,nkv,hd", [(32, 8, 128), (16, 16, 64), (64, 4, 128), (4, 2, 8)])
def test_prompt_rows_share_programs_and_keep_their_bits(dtype, nh, nkv, hd):
    """Mixtral's heads (4 rows a program), OLMoE's MHA (16), Qwen3-MoE's 16 q heads a KV head
    (a row a program), the tiny test model's."""
    check_prompt_rows("cuda", dtype, nh, nkv, hd)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("nh,lora,rope,max_len", [(128, 512, 64, 1000), (4, 16, 8, 200)])
def test_latent_decode_matches_the_torch_form_and_is_batch_invariant(dtype, nh, lora, rope, max_len):
    """DeepSeek-V3's MLA (128 heads in blocks, 512 + 64 latent columns), and the tiny test model's."""
    check_latent_decode("cuda", dtype, nh, lora, rope, max_len)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("interleave", [True, False])
def test_latent_rotary_cache_write_matches_torch_bitwise(dtype, interleave):
    for table_dtype in (torch.float32, torch.bfloat16):
        check_latent_rotary_cache("cuda", dtype, interleave, table_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_experts_and_their_grouping_on_cuda(dtype):
    from components.engine.kernels.expert_gemm import PROMPT_TILES, Tiles

    check_experts("cuda", dtype)
    check_experts("cuda", dtype, Tiles(128, 128, 64, warps=8))  # a prompt-sized tiling, as bench.experts tries
    if dtype != torch.float32:  # fp32 serves in TILES: PROMPT_TILES' fp32 stages overflow shared memory
        check_experts("cuda", dtype, PROMPT_TILES)
    check_group_rows("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_expert_tilings_give_a_row_the_same_bits(dtype):
    """Decode steps run TILES and steps with prompt rows PROMPT_TILES, so a decode row's bits
    must not depend on which it ran in: every tiling bench.experts tries gives every row the same
    bits as TILES, at Mixtral's expert shape and thousands of rows. (Not under the interpreter:
    there a dot's rounding follows the K step; on the GPU each element is one sum in K order.)"""
    from components.engine.kernels.expert_gemm import PROMPT_TILES, TILES, Tiles, swiglu_experts

    torch.manual_seed(0)
    S, H, I = 8, 4096, 14336
    wg, wu = (torch.randn(S, I, H, device="cuda").to(dtype) * 0.02 for _ in range(2))
    wd = torch.randn(S, H, I, device="cuda").to(dtype) * 0.02
    local = torch.randint(-1, S, (4160,), dtype=torch.int32, device="cuda")
    x = torch.randn(len(local), H, device="cuda").to(dtype)
    want = swiglu_experts(x, local, wg, wu, wd, tiles=TILES)
    for tiles in (
        PROMPT_TILES,
        Tiles(64, 64, 64),
        Tiles(128, 64, 128, 8),
        Tiles(64, 128, 64, 4, 4),
        Tiles(128, 128, 64, 8, 4, 3),
    ):
        assert torch.equal(swiglu_experts(x, local, wg, wu, wd, tiles=tiles), want), tiles


@pytest.mark.gpu
@pytest.mark.parametrize("latent", [False, True], ids=["gqa", "mla"])
def test_decode_attention_in_a_cuda_graph_follows_the_lengths_it_reads(latent):
    """Captured once, replayed after the rows' slots and context lengths changed in place: the
    loop bound is read on the device, so the replay matches an eager call with the new values."""
    from components.engine.kernels.decode_attention import decode_attention, latent_decode_attention

    torch.manual_seed(0)
    kc, vc = (torch.randn(5, 300, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    q = torch.randn(4, 8, 64, device="cuda", dtype=torch.bfloat16)
    slots = torch.tensor([0, 1, 2, 4], device="cuda")
    lens = torch.tensor([5, 100, 300, 1], device="cuda")
    if latent:  # 32 heads (two blocks) over a 512 + 64 latent
        kc = torch.randn(5, 300, 1, 576, device="cuda", dtype=torch.bfloat16)
        q = torch.randn(4, 32, 576, device="cuda", dtype=torch.bfloat16)

    def attend():
        if latent:
            return latent_decode_attention(q[..., :512], q[..., 512:], kc, slots, lens, 0.05)
        return decode_attention(q, kc, vc, slots, lens)

    out = torch.empty_like(attend())
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        out.copy_(attend())  # compiled outside the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out.copy_(attend())
    for new_slots, new_lens in (([3, 1, 0, 4], [260, 1, 64, 1]), ([2, 2, 2, 2], [300, 299, 65, 7])):
        slots.copy_(torch.tensor(new_slots))
        lens.copy_(torch.tensor(new_lens))
        g.replay()
        assert torch.equal(out, attend())


def _interpreted() -> None:
    """Run in the subprocess: every kernel interpreted on CPU tensors, fp32 and bf16."""
    from harness.triton_interpreter import enable

    enable()
    for dtype in (torch.float32, torch.bfloat16):
        check_decode_attention("cpu", dtype, nh=4, nkv=2, hd=8, max_len=140)
        check_prompt_rows("cpu", dtype, nh=4, nkv=2, hd=8)
        check_latent_decode("cpu", dtype, nh=20, lora=512, rope=64, max_len=100)  # 2 head blocks, 1 partial
        check_latent_decode("cpu", dtype, nh=4, lora=16, rope=8, max_len=70)
        for interleave in (True, False):
            for table_dtype in (torch.float32, torch.bfloat16):
                check_latent_rotary_cache("cpu", dtype, interleave, table_dtype)
        check_experts("cpu", dtype)
    from components.engine.kernels.expert_gemm import Tiles

    check_experts("cpu", torch.float32, Tiles(32, 32, 64))  # bench.experts --tiles runs others
    check_experts("cpu", torch.float32, Tiles(32, 32, 64, group=3))  # blocks in groups, the last one short
    check_group_rows("cpu")


def test_triton_kernels_under_the_interpreter_on_cpu():
    """What CI can check of the kernels without a GPU: all of them, in fp32 and bf16, interpreted."""
    code = "from tests.test_triton_kernels import _interpreted; _interpreted()"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]


def test_bench_attention_runs_on_cpu(tmp_path):
    """The benchmark's CPU smoke run (kernel interpreted): both forms agree on every row."""
    out = tmp_path / "attention.json"
    args = ["--device", "cpu", "--max-seqs", "2", "--max-len", "70", "--ctx", "3,70", "--heads", "4", "--kv-heads", "2"]
    cmd = [sys.executable, "-m", "bench.attention", *args, "--head-dim", "16", "--out", str(out)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(row["max_seqs"], row["ctx"]) for row in rows] == [(2, 3), (2, 70)]
    assert all(row["max_abs_diff"] < 2e-2 for row in rows)


@pytest.mark.parametrize(
    "tiles,message",
    [
        ("64x48x64", "--tiles: '64x48x64': M, N, K and warps must be powers of two, stages and group >= 1"),
        ("64x64", "--tiles: '64x64' is not MxNxK[:warps[:stages[:group]]] in integers"),
        ("64x64x64:4:3:0", "--tiles: '64x64x64:4:3:0': M, N, K and warps must be powers of two, stages and group >= 1"),
        (
            "64x64x64:4:3:2:1",
            "--tiles: '64x64x64:4:3:2:1': M, N, K and warps must be powers of two, stages and group >= 1",
        ),
    ],
)
def test_bench_experts_refuses_a_bad_tiling(tiles, message):
    r = subprocess.run(
        [sys.executable, "-m", "bench.experts", "--tiles", tiles], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 2 and message in r.stderr, r.stderr


def test_bench_experts_reads_a_tiling():
    from bench.experts import parse_tiles
    from components.engine.kernels.expert_gemm import Tiles

    assert parse_tiles("128x128x64:8") == Tiles(128, 128, 64, warps=8, stages=3)
    assert parse_tiles(" 64x128x64:4:4") == Tiles(64, 128, 64, warps=4, stages=4)
    assert parse_tiles("128x128x64:8:4:8") == Tiles(128, 128, 64, warps=8, stages=4, group=8)
