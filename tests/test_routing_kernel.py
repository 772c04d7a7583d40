"""The MoE layer's kernels around the experts (kernels/routing.py, and the peer-window exchange's
own in exchange/windows.py) against the torch code they replace on CUDA: SparseMoE's dispatch and
combine, the exchange's slot validity and reply gather. Compiled on a GPU; on the CPU under
Triton's interpreter in a subprocess (see test_triton_kernels), where the softmax's exp is numpy's
rather than torch's, so the weights are checked to within an ulp there and bitwise on a GPU."""

from __future__ import annotations

import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

# (tokens, experts, top_k, max_ranks, slots per rank, renormalise, masked ranks)
CASES = [
    (1, 8, 2, 2, 4, True, []),
    (37, 8, 2, 4, 3, True, [2]),
    (512, 8, 2, 4, 3, True, [1]),
    (20, 8, 1, 3, 3, True, []),
    (45, 60, 4, 3, 24, False, [0]),
    (33, 16, 8, 8, 3, True, [3, 5]),
    (7, 6, 3, 5, 2, True, [1, 2, 3, 4]),
]
# DeepSeek's grouped sigmoid routing (DeepseekMoE): a case and (n_group, topk_group).
GROUPED = [
    (CASES[0], (4, 2)),
    ((37, 16, 4, 4, 5, True, [2]), (4, 2)),
    ((300, 64, 8, 4, 16, True, [1]), (8, 4)),  # V3's 8 groups, best 4, top 8
    ((20, 12, 3, 3, 4, False, []), (3, 1)),  # experts and groups not a power of two, no renorm
    (CASES[4], (1, 1)),  # biased sigmoid, no groups (Kimi-K2, GLM-4.5)
]


def make_moe(device, dtype, T, E, k, R, S, norm, masked, seed=0, groups=None):
    """A SparseMoE over a random placement (every expert placed, some replicated) of R ranks, the
    ranks in `masked` outside the EP mask; with `groups` (n_group, topk_group), a DeepseekMoE
    with a nonzero selection bias."""
    from components.engine.exchange.expert_map import ExpertMap
    from components.engine.models.deepseek_v3 import DeepseekMoE, GroupedRouting
    from components.engine.models.moe import SparseMoE
    from components.protocol.placement import Placement

    g = torch.Generator().manual_seed(seed)
    slots = list(range(E)) + torch.randint(-1, E, (R * S - E,), generator=g).tolist()
    slots = [slots[i] for i in torch.randperm(R * S, generator=g).tolist()]
    emap = ExpertMap(2, E, R, S, device=device)
    emap.install(Placement(S, [slots, slots[::-1]]))
    mask = torch.ones(R, dtype=torch.bool, device=device)
    mask[masked] = False
    ep = SimpleNamespace(slots_per_rank=S, map=emap, mask=mask, windows=None)
    cfg = SimpleNamespace(
        hidden_size=32, moe_intermediate_size=8, num_experts=E, top_k=k, norm_topk_prob=norm, sparse_layers=(True,) * 2
    )
    if groups is None:
        moe = SparseMoE(cfg, 1, ep).to(device=device, dtype=dtype)
        moe.gate.weight.data = torch.randn(E, 32, generator=g).to(device=device, dtype=dtype)
        return moe
    cfg.shared_expert_intermediate_size = 0
    cfg.params = SimpleNamespace(routing=GroupedRouting(groups[0], groups[1], 2.5))
    moe = DeepseekMoE(cfg, 1, ep).to(device=device, dtype=dtype)  # the router stays fp32
    moe.gate.weight.data = (torch.randn(E, 32, generator=g) * 0.3).to(device)
    moe.gate.e_score_correction_bias.data = (torch.randn(E, generator=g) * 0.1).to(device)
    return moe


@contextmanager
def lower_index_on_ties():
    """torch.topk, but equal values in index order, as the kernel takes them: torch leaves the
    order of ties unspecified (its CPU topk takes them in no fixed order), and bf16 logits of
    many experts tie often enough to matter."""
    topk = torch.topk

    def stable_topk(x, k, dim=-1):
        values, indices = torch.sort(x, dim=dim, descending=True, stable=True)
        return values.narrow(dim, 0, k), indices.narrow(dim, 0, k)

    torch.topk = stable_topk
    try:
        yield
    finally:
        torch.topk = topk


def check_dispatch(device: str, exact_weights: bool) -> None:
    """Every field of the dispatch equal to the torch code's (with ties to the lower expert), and
    the load update, with padding rows, masked ranks and replicas; `position` is the inverse of
    `order`; the misrouted counter gains the masked ranks' pairs times strict (0 in warmup). For
    softmax routing and DeepSeek's grouped sigmoid (its weights times the scaling factor)."""
    from components.engine.kernels.routing import gather_rows, route_and_sort

    for dtype in (torch.float32, torch.bfloat16):
        for (T, E, k, R, S, norm, masked), groups in [(c, None) for c in CASES] + GROUPED:
            moe = make_moe(device, dtype, T, E, k, R, S, norm, masked, groups=groups)
            g = torch.Generator().manual_seed(T)
            x = torch.randn(T, 32, generator=g).to(device=device, dtype=dtype)
            for valid in (None, torch.rand(T, generator=g).to(device) < 0.7):
                moe.load.copy_(torch.arange(E))
                with lower_index_on_ties():
                    want = moe._dispatch_torch(x, valid)
                want_load = moe.load.clone()
                moe.load.copy_(torch.arange(E))
                m = moe.ep.map
                misrouted = torch.tensor([3], device=device)
                strict = torch.tensor([int(valid is None)], device=device)
                w, order, local, counts, position = route_and_sort(
                    moe.gate(x), valid, m.replica_slots[1], m.num_replicas[1], moe.ep.mask, moe.load, k, norm, S, dtype,
                    (misrouted, strict), moe.scoring(),
                )  # fmt: skip
                case = f"{dtype} T={T} E={E} k={k} R={R} S={S} masked={masked} valid={valid is not None} {groups=}"
                assert misrouted.item() == 3 + want.counts[R].item() * strict.item(), case
                assert torch.equal(order, want.order), case
                assert torch.equal(local, want.local), case
                assert torch.equal(counts, want.counts), case
                assert torch.equal(moe.load, want_load), case
                assert torch.equal(order[position.long()], torch.arange(T * k, device=device)), case
                assert torch.equal(gather_rows(x, order, k), want.rows), case
                assert w.dtype == dtype and w.shape == (T, k)
                # The renorm adds k weights: two in any order give the same sum, more in the order
                # of torch's CUDA reduce, which changed between releases (its warp shuffles ran
                # by rising offsets, then by falling ones), so a few fp32 ulps apart.
                if exact_weights and (k <= 2 or not norm):
                    assert torch.equal(w, want.weights), case
                else:  # numpy's exp against torch's (and its sigmoid's): a few fp32 ulps, at most one of bf16
                    tol = 4 * torch.finfo(torch.float32).eps if dtype == torch.float32 else torch.finfo(dtype).eps
                    torch.testing.assert_close(w, want.weights, rtol=tol, atol=0, msg=case)


def check_ties_and_batch_invariance(device: str) -> None:
    """Equal probabilities go to the lower expert index (a zero row: experts 0..k-1); a row's
    weights and experts are bitwise the same alone and in batches of other sizes, with softmax
    and with grouped sigmoid scoring."""
    from components.engine.kernels.routing import GroupedSigmoid, route_and_sort

    E, k, R, S = 8, 2, 2, 4
    m = make_moe(device, torch.float32, 1, E, k, R, S, True, []).ep.map
    mask = torch.ones(R, dtype=torch.bool, device=device)
    ones = torch.ones(E, 1, dtype=torch.int64, device=device)

    def route(logits, scoring=None):
        load = torch.zeros(E, dtype=torch.int64, device=device)
        w, *_ = route_and_sort(
            logits, None, m.replica_slots[0][:, :1], ones[:, 0], mask, load, k, True, S, torch.float32, None, scoring
        )
        return w, load

    w, load = route(torch.zeros(1, E, device=device))
    assert w.tolist() == [[0.5, 0.5]] and load.tolist() == [1, 1] + [0] * (E - 2)
    w, load = route(torch.tensor([[0.0, 2.0, 1.0, 2.0, 2.0, 0.0, 0.0, 0.0]], device=device))
    assert load.tolist() == [0, 1, 0, 1, 0, 0, 0, 0]

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(300, E, generator=g).to(device)
    for scoring in (None, GroupedSigmoid((torch.randn(E, generator=g) * 0.1).to(device), 4, 2, 2.5)):
        w_all, _ = route(logits, scoring)
        for i in (0, 7, 299):
            for lo, hi in ((i, i + 1), (max(0, i - 5), min(300, i + 40))):
                w_part, load = route(logits[lo:hi], scoring)
                assert torch.equal(w_part[i - lo], w_all[i]), (i, lo, hi, scoring is None)
    for i in (3, 150):
        _, load = route(logits[i : i + 1])
        _, ex = torch.topk(logits[i], k)
        assert load.nonzero().flatten().tolist() == sorted(ex.tolist())


def check_combine(device: str) -> None:
    """The torch combine (scatter back, multiply, sum over k) in fp32 and bf16, bitwise for k <= 2,
    and a token's result bitwise the same alone."""
    from components.engine.kernels.routing import combine_pairs
    from components.engine.models.moe import Dispatch

    for dtype in (torch.float32, torch.bfloat16):
        for T, k, H in ((1, 2, 64), (37, 2, 96), (20, 1, 64), (9, 4, 1030), (5, 8, 64)):
            moe = make_moe(device, dtype, T, 8, k, 2, 4, True, [])
            g = torch.Generator().manual_seed(T * k)
            order = torch.randperm(T * k, generator=g).to(device)
            position = torch.empty_like(order).scatter_(0, order, torch.arange(T * k, device=device)).int()
            weights = torch.rand(T, k, generator=g).to(device=device, dtype=dtype)
            out = (torch.randn(T * k, H, generator=g) * 4).to(device=device, dtype=dtype)
            out[-1] = 0  # a pair not sent
            moe.hidden = H
            want = moe._combine_torch(Dispatch(weights, order, None, None, None), out)
            got = combine_pairs(out, position, weights)
            if k <= 2:
                assert torch.equal(got, want), (dtype, T, k, H)
            else:  # torch's CUDA sum over k adds in its reduce's order, not in j order (see above)
                eps = torch.finfo(dtype).eps * (4 if dtype == torch.float32 else 1)
                torch.testing.assert_close(
                    got, want, rtol=eps, atol=eps * want.abs().max().item(), msg=str((dtype, T, k, H))
                )
            t = T // 2
            alone = combine_pairs(out, position[t * k : t * k + k].contiguous(), weights[t : t + 1])
            assert torch.equal(alone[0], got[t])


def check_exchange_kernels(device: str) -> None:
    """The peer-window exchange's slot validity and reply gather against the torch code they
    replaced, with a masked peer, an empty one and rows past the sent ones."""
    from components.engine.exchange.windows import _BLOCK, _received_kernel, _replies_kernel

    R, C, words = 4, 40, 6
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([True, False, True, True], device=device)
    recv_counts = torch.tensor([5, 7, 0, 40], device=device)
    recv_slots = torch.randint(0, 9, (R, C), generator=g, dtype=torch.int32).to(device)
    got = torch.empty(R, dtype=torch.int64, device=device)
    slots = torch.empty(R * C, dtype=torch.int32, device=device)
    _received_kernel[(R,)](recv_counts, recv_slots, mask, got, slots, C, BLOCK=_BLOCK)
    want_got = torch.where(mask, recv_counts, 0)
    valid = torch.arange(C, device=device).unsqueeze(0) < want_got.unsqueeze(1)
    assert torch.equal(got, want_got)
    assert torch.equal(slots, torch.where(valid, recv_slots, -1).flatten())

    ret = torch.randint(-(2**31), 2**31 - 1, (R * C, words), generator=g, dtype=torch.int32).to(device)
    for counts in ([3, 0, 2, 4, 1, 2], [0, 0, 0, 0, 5, 0], [C, 0, 0, 0, 0, 0], [1, 2, 3, 4, 0, 0]):
        c = torch.tensor(counts, device=device)
        P = sum(counts)
        out = torch.full((P, words), 7, dtype=torch.int32, device=device)
        _replies_kernel[(P,)](ret, c, out, C, words, R, R_PAD=R, BLOCK=4)
        ends = torch.cumsum(c[:R], 0)
        starts = ends - c[:R]
        pos = torch.arange(P, device=device)
        dest = torch.searchsorted(ends, pos, right=True)
        sent = dest < R
        d = dest.clamp(max=R - 1)
        idx = torch.where(sent, d * C + pos - starts[d], 0)
        assert torch.equal(out, torch.where(sent.unsqueeze(1), ret[idx], 0)), counts


def _interpreted() -> None:
    from harness.triton_interpreter import enable

    enable()
    check_dispatch("cpu", exact_weights=False)
    check_ties_and_batch_invariance("cpu")
    check_combine("cpu")
    check_exchange_kernels("cpu")


def test_routing_kernels_under_the_interpreter_on_cpu():
    code = "from tests.test_routing_kernel import _interpreted; _interpreted()"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]


@pytest.mark.gpu
def test_dispatch_kernel_is_bitwise_the_torch_dispatch_on_cuda():
    check_dispatch("cuda", exact_weights=True)
    check_ties_and_batch_invariance("cuda")


@pytest.mark.gpu
def test_combine_and_exchange_kernels_match_torch_on_cuda():
    check_combine("cuda")
    check_exchange_kernels("cuda")
