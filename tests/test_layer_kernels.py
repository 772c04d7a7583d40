"""The Triton kernels of layers.py's CUDA path against the torch code they replace there: RMSNorm
and the residual add fused into it (kernels/norm.py), the rotary embedding with the KV cache write
(kernels/rotary.py). Compiled on a GPU; on the CPU under Triton's interpreter, in a subprocess (see
test_triton_kernels.py for why)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
# Only the order of the mean's sum differs from torch: an fp32 result by a few ulps, a bf16 one
# by a rounding flipped at most (one ulp of the normed row, rounded again by the weight multiply).
NORM_TOL = {torch.float32: {"rtol": 4e-6, "atol": 1e-7}, torch.bfloat16: {"rtol": 2**-6, "atol": 1e-6}}


def check_rms_norm(device: str, dtype: torch.dtype, H: int, weight_dtype: torch.dtype | None = None) -> None:
    """rms_norm and add_rms_norm against layers.RMSNorm run on the CPU (whose fp32 maths the kernel
    rounds alike; CUDA's rsqrt is an approximation). Rows of small integers, whose sum of squares
    is exact in any order, match bit for bit; random rows within NORM_TOL; the residual sum is
    torch's bit for bit; and a row's results are the same alone and in the batch."""
    from components.engine.kernels.norm import add_rms_norm, rms_norm
    from components.engine.models.layers import RMSNorm

    torch.manual_seed(0)
    norm = RMSNorm(H, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(H) * 0.5 + 1)
    norm.to(weight_dtype or dtype)
    w = norm.weight.detach().to(device)
    exact = torch.randint(-8, 9, (3, H)).to(dtype)
    rand = (torch.randn(4, H) * torch.tensor([1e-3, 1.0, 30.0, 1e3])[:, None]).to(dtype)
    x = torch.cat([exact, rand]).to(device)
    res = torch.randn(x.shape).to(dtype).to(device)
    with torch.no_grad():
        want = norm(x.cpu())
        want_h = x.cpu() + res.cpu()
        want_hn = norm(want_h)
    got = rms_norm(x, w, norm.eps)
    h, hn = add_rms_norm(x, res, w, norm.eps)
    assert got.dtype == want.dtype and got.shape == x.shape and hn.dtype == want.dtype and h.dtype == dtype
    assert torch.equal(got[:3].cpu(), want[:3]), "integer rows differ from torch"
    torch.testing.assert_close(got.cpu(), want, **NORM_TOL[dtype])
    assert torch.equal(h.cpu(), want_h)
    torch.testing.assert_close(hn.cpu(), want_hn, **NORM_TOL[dtype])
    for i in range(len(x)):
        assert torch.equal(rms_norm(x[i : i + 1], w, norm.eps)[0], got[i]), f"row {i} differs alone"
        alone_h, alone_hn = add_rms_norm(x[i : i + 1], res[i : i + 1], w, norm.eps)
        assert torch.equal(alone_h[0], h[i]) and torch.equal(alone_hn[0], hn[i]), f"row {i} differs alone"


def check_rotary_cache(
    device: str, dtype: torch.dtype, nh: int, nkv: int, hd: int, rot_dim: int, table_dtype: torch.dtype
) -> None:
    """rotary_cache_write against layers.Rotary and the indexed cache stores: the rotated q and the
    caches bit for bit, so k and v landed at their (slot, position) and nothing else in either
    cache changed; q, k and v are slices of one fused projection (strided); and a token's results
    are the same written alone. `rot_dim` below `hd`: partial rotary, the rest of a head passed."""
    from components.engine.kernels.rotary import rotary_cache_write
    from components.engine.models.layers import Rotary

    torch.manual_seed(0)
    max_len = 50
    rot = Rotary(rot_dim, 10000.0, max_len).to(table_dtype).to(device)
    pos = torch.tensor([0, 5, max_len - 1, 17, 3, 3], device=device)
    slots = torch.tensor([2, 0, 1, 2, 3, 0], device=device)
    T = len(pos)
    qkv = (torch.randn(T, nh + 2 * nkv, hd) * 4).to(dtype).to(device)
    q, k, v = qkv.split([nh, nkv, nkv], dim=1)
    kc0, vc0 = (torch.randn(5, max_len, nkv, hd).to(dtype).to(device) for _ in range(2))
    want_kc, want_vc = kc0.clone(), vc0.clone()
    want_q = rot(q, pos)
    want_kc[slots, pos] = rot(k, pos)
    want_vc[slots, pos] = v
    kc, vc = kc0.clone(), vc0.clone()
    got = rotary_cache_write(q, k, v, rot.cos, rot.sin, pos, slots, kc, vc)
    assert got.dtype == dtype and got.shape == q.shape
    assert torch.equal(got, want_q)
    assert torch.equal(kc, want_kc) and torch.equal(vc, want_vc)
    written = torch.zeros(5, max_len, dtype=torch.bool, device=device)
    written[slots, pos] = True
    assert torch.equal(kc[~written], kc0[~written]) and torch.equal(vc[~written], vc0[~written])
    assert not torch.equal(kc[written], kc0[written])
    for i in range(T):
        kc1, vc1 = kc0.clone(), vc0.clone()
        one = slice(i, i + 1)
        alone = rotary_cache_write(q[one], k[one], v[one], rot.cos, rot.sin, pos[one], slots[one], kc1, vc1)
        s, p = slots[i], pos[i]
        assert torch.equal(alone[0], got[i]), f"token {i} differs alone"
        assert torch.equal(kc1[s, p], kc[s, p]) and torch.equal(vc1[s, p], vc[s, p]), f"token {i} differs alone"


# (nh, nkv, hd, rotated dims): GQA, MQA, a head dim not a power of two, partial rotary, Mixtral, GLM-4.5.
ROTARY_SHAPES = [(4, 2, 64, 64), (8, 1, 128, 128), (6, 3, 96, 96), (6, 3, 96, 48), (32, 8, 128, 128), (96, 8, 128, 64)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("H", [96, 1000, 4096])
def test_rms_norm_matches_torch_and_is_batch_invariant(dtype, H):
    check_rms_norm("cuda", dtype, H)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("table_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("nh,nkv,hd,rot_dim", ROTARY_SHAPES)
def test_rotary_cache_write_matches_torch_bitwise(dtype, table_dtype, nh, nkv, hd, rot_dim):
    check_rotary_cache("cuda", dtype, nh, nkv, hd, rot_dim, table_dtype)


@pytest.mark.gpu
def test_rotary_cache_write_in_a_cuda_graph_follows_the_positions_it_reads():
    """Captured once, replayed after positions and slots changed in place: the replay writes where
    an eager call with the new values writes, and rotates by the new positions."""
    from components.engine.kernels.rotary import rotary_cache_write
    from components.engine.models.layers import Rotary

    torch.manual_seed(0)
    rot = Rotary(64, 10000.0, 100).to(torch.bfloat16).to("cuda")
    q = torch.randn(3, 4, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(3, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    kc, vc = (torch.zeros(4, 100, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    pos = torch.tensor([0, 1, 2], device="cuda")
    slots = torch.tensor([0, 1, 2], device="cuda")
    out = torch.empty_like(q)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        out.copy_(rotary_cache_write(q, k, v, rot.cos, rot.sin, pos, slots, kc, vc))  # compiled outside the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out.copy_(rotary_cache_write(q, k, v, rot.cos, rot.sin, pos, slots, kc, vc))
    for new_pos, new_slots in (([7, 99, 40], [3, 0, 1]), ([50, 51, 52], [2, 2, 2])):
        pos.copy_(torch.tensor(new_pos))
        slots.copy_(torch.tensor(new_slots))
        kc.zero_(), vc.zero_()
        g.replay()
        got_kc, got_vc = kc.clone(), vc.clone()
        kc.zero_(), vc.zero_()
        assert torch.equal(out, rotary_cache_write(q, k, v, rot.cos, rot.sin, pos, slots, kc, vc))
        assert torch.equal(got_kc, kc) and torch.equal(got_vc, vc)
        assert torch.equal(kc[slots, pos], rot(k, pos))


def _interpreted() -> None:
    """Run in the subprocess: every check interpreted on CPU tensors, fp32 and bf16."""
    from harness.triton_interpreter import enable

    enable()
    for dtype in (torch.float32, torch.bfloat16):
        for H in (96, 1000):
            check_rms_norm("cpu", dtype, H)
        for shape in ROTARY_SHAPES[:4]:
            for table_dtype in (torch.float32, torch.bfloat16):
                check_rotary_cache("cpu", dtype, *shape, table_dtype)
    check_rms_norm("cpu", torch.bfloat16, 96, weight_dtype=torch.float32)  # an fp32 result, as torch promotes


def test_layer_kernels_under_the_interpreter_on_cpu():
    """What CI can check of the kernels without a GPU: all of them, fp32 and bf16, interpreted."""
    code = "from tests.test_layer_kernels import _interpreted; _interpreted()"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
