"""The MoE layer's device work around the experts on CUDA, as Triton kernels: routing and the
dispatch layout in one launch, the row gather in a second, the combine in a third.

Done in torch (SparseMoE.dispatch / combine, still the CPU path) this is some twenty small
kernels a layer (softmax, top-k, the renorm, the replica lookup, the EP mask, a stable argsort,
the counts, the gathers and scatters), each a few microseconds of launch and gap in a decode
graph whose real work is the expert GEMMs. The results are the same tensors:

* `route_and_sort`: one program. Per token: the fp32 softmax of its router logits, computed as
  torch's warp softmax does (the max, exp(x - max) with the full-precision expf, the sum over a
  row in the same tree, an IEEE division), top-k by value with the lower expert index first on
  ties, the renorm (a sum in choice order, an IEEE division: torch's bits for k <= 2, a few ulps
  from its CUDA reduce above), the slot of the chosen replica (ExpertMap.route: replica =
  token % replicas) and the pair's key (destination rank; R for a
  masked rank; R + 1 for a padding row). Then a stable counting sort of the pairs by key, in
  pair order, BLOCK_P pairs at a time: the order, the local slots, the counts, each pair's
  position (the inverse of the order, for the combine), the load update and, for the peer-window
  exchange, the count of pairs routed to masked ranks (SparseMoE.exchange's torch form, 2 kernels).
  With `GroupedSigmoid` scoring (SCORING="sigmoid": DeepSeek-V3's, deepseek_v3.DeepseekMoE.route)
  the scores are instead torch's sigmoid (1 / (1 + expf(-x)), an IEEE division), the selection
  bias is added for the choice only, the experts outside the best topk_group of n_group groups (a
  group's score the sum of its two best biased scores, the lower group index on ties) are out of
  it, and the chosen unbiased scores, renormalised over (sum + 1e-20), times the scaling factor,
  are the weights.
* `gather_rows`: rows[i] = x[order[i] // k].
* `combine_pairs`: token t's output is the sum over its choices j, in j order, of
  out[position(t, j)] * w[t, j], each product rounded to the output dtype and accumulated in
  fp32 from zero, as torch's multiply then sum over k compute it (fp contraction off, so no FMA).

Batch invariance: a row's weights and experts depend on its logits alone, the combine of a token
on its own pairs alone; the sort is integer work. All three read their sizes on the host only
as shapes, so a graph captures them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

_TILE = 4096  # elements of the [rows, keys or experts] tiles a program works on at a time


class GroupedSigmoid(NamedTuple):
    """route_and_sort's sigmoid scoring (module docstring) and its settings."""

    bias: torch.Tensor  # [E] fp32: added to the scores for the choice only
    n_group: int
    topk_group: int
    scale: float  # multiplies the weights (routed_scaling_factor)


@triton.jit
def _row_sum(e, BLOCK_T: tl.constexpr, E_PAD: tl.constexpr):
    """Sum of each row of `e` [BLOCK_T, E_PAD] in the order torch's warp softmax adds: lane b of
    a warp of min(E_PAD, 32) lanes holds elements b, b + 32, ... and adds them in that order,
    then the lanes are added by halving (lane b + lane b + n/2)."""
    LANES: tl.constexpr = 32 if E_PAD > 32 else E_PAD
    ITERS: tl.constexpr = E_PAD // LANES
    e3 = tl.reshape(e, (BLOCK_T, ITERS, LANES))
    it = tl.arange(0, ITERS)[None, :, None]
    s = tl.sum(tl.where(it == 0, e3, 0.0), 1)  # one term and zeros: exact
    for i in tl.static_range(1, ITERS):
        s = s + tl.sum(tl.where(it == i, e3, 0.0), 1)
    if LANES >= 32:
        s = tl.sum(tl.reshape(s, (BLOCK_T, 2, 16)), 1)
    if LANES >= 16:
        s = tl.sum(tl.reshape(s, (BLOCK_T, 2, 8)), 1)
    if LANES >= 8:
        s = tl.sum(tl.reshape(s, (BLOCK_T, 2, 4)), 1)
    if LANES >= 4:
        s = tl.sum(tl.reshape(s, (BLOCK_T, 2, 2)), 1)
    return tl.sum(s, 1)  # two lanes: a + b in either order


@triton.jit
def _best_groups(
    c, cols, E, BLOCK_T: tl.constexpr, E_PAD: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr
):
    """`c` [BLOCK_T, E_PAD] with every expert outside its row's TOPK_GROUP best groups of E //
    N_GROUP consecutive experts at -inf; a group's score is the sum of its two best entries."""
    group = cols // (E // N_GROUP)  # padding columns (E on) fall in no group
    # Group g's score in column g (groups <= experts, so E_PAD columns hold them), -inf past them.
    scores = tl.full((BLOCK_T, E_PAD), float("-inf"), dtype=tl.float32)
    for g in tl.static_range(N_GROUP):
        v = tl.where((group == g)[None, :], c, float("-inf"))
        top = tl.max(v, 1)
        at = tl.min(tl.where(v == top[:, None], cols[None, :], E_PAD), 1)
        second = tl.max(tl.where(cols[None, :] == at[:, None], float("-inf"), v), 1)
        scores = tl.where(cols[None, :] == g, (top + second)[:, None], scores)
    keep = tl.zeros((BLOCK_T, E_PAD), dtype=tl.int1)
    for _ in tl.static_range(TOPK_GROUP):
        best = tl.max(scores, 1)
        gi = tl.min(tl.where(scores == best[:, None], cols[None, :], E_PAD), 1)
        scores = tl.where(cols[None, :] == gi[:, None], float("-inf"), scores)
        keep = keep | (group[None, :] == gi[:, None])
    return tl.where(keep, c, float("-inf"))


@triton.jit
def _route_kernel(
    logits_ptr,  # [T, E] router logits (any float dtype; the softmax is fp32)
    stride_l,
    valid_ptr,  # [T] bool: real rows (HAS_VALID)
    replicas_ptr,  # [E, max_replicas] int64: the layer's replica slots
    stride_rep,
    nrep_ptr,  # [E] int64: replicas per expert
    mask_ptr,  # [R] bool: the EP mask
    load_ptr,  # [E] int64, added to: pairs of real rows per expert
    misrouted_ptr,  # [1] int64, added to (HAS_MISROUTED): pairs of key R times strict
    strict_ptr,  # [1] int64: 0 in masked warmup (HAS_MISROUTED)
    weights_ptr,  # [T, K] out, the routing weights in the activations' dtype
    order_ptr,  # [T*K] int64 out: the pair at each position
    local_ptr,  # [T*K] int32 out: the slot on the destination at each position
    position_ptr,  # [T*K] int32 out: the position of each pair
    counts_ptr,  # [R + 2] int64 out: pairs per key
    keys_ptr,  # [T*K] int32 scratch: key * S + local slot of each pair
    bias_ptr,  # [E] fp32: the selection bias (SCORING "sigmoid")
    scale,  # multiplies the weights (SCORING "sigmoid")
    T,
    E,
    R,
    S,
    SCORING: tl.constexpr,  # "softmax" or "sigmoid" (GroupedSigmoid)
    N_GROUP: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    NORM: tl.constexpr,
    HAS_VALID: tl.constexpr,
    HAS_MISROUTED: tl.constexpr,
    E_PAD: tl.constexpr,
    NKEY: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    cols = tl.arange(0, E_PAD)
    col_ok = cols < E
    kcols = tl.arange(0, NKEY)
    kj = tl.arange(0, K_PAD)
    counts = tl.zeros((NKEY,), dtype=tl.int32)
    load = tl.zeros((E_PAD,), dtype=tl.int32)
    for t0 in range(0, T, BLOCK_T):
        rows = t0 + tl.arange(0, BLOCK_T)
        row_ok = rows < T
        x = tl.load(
            logits_ptr + rows[:, None].to(tl.int64) * stride_l + cols[None, :],
            mask=row_ok[:, None] & col_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        if SCORING == "softmax":
            x = tl.where(col_ok[None, :], x, float("-inf"))
            m = tl.max(x, 1)
            e = libdevice.exp(x - m[:, None])
            score = tl.math.div_rn(e, _row_sum(e, BLOCK_T, E_PAD)[:, None])
            pick = score
        else:
            score = tl.math.div_rn(1.0, 1.0 + libdevice.exp(-x))
            pick = score + tl.load(bias_ptr + cols, mask=col_ok, other=0.0)[None, :]
            if N_GROUP > 1:
                pick = _best_groups(pick, cols, E, BLOCK_T, E_PAD, N_GROUP, TOPK_GROUP)
        pick = tl.where(col_ok[None, :], pick, float("-inf"))  # never chosen
        if HAS_VALID:
            real = row_ok & (tl.load(valid_ptr + rows, mask=row_ok, other=0) != 0)
        else:
            real = row_ok
        chosen = tl.zeros((BLOCK_T, K_PAD), dtype=tl.float32)
        total = tl.zeros((BLOCK_T,), dtype=tl.float32)
        for j in tl.static_range(K):
            c = tl.max(pick, 1)
            ex = tl.min(tl.where(pick == c[:, None], cols[None, :], E_PAD), 1)  # the lower index on ties
            pick = tl.where(cols[None, :] == ex[:, None], float("-inf"), pick)
            if SCORING == "softmax":
                w = c
            else:  # the unbiased score: one term and zeros, exact
                w = tl.sum(tl.where(cols[None, :] == ex[:, None], score, 0.0), 1)
            chosen = tl.where(kj[None, :] == j, w[:, None], chosen)
            total = total + w
            load += tl.sum(((cols[None, :] == ex[:, None]) & real[:, None]).to(tl.int32), 0)
            # A row without a choice (non-finite logits: a padding row over garbage) reads expert 0's
            # replicas, not past the table; torch.topk would take the NaN's index instead.
            ex = tl.where(row_ok & (ex < E), ex, 0)
            nrep = tl.load(nrep_ptr + ex)
            slot = tl.load(replicas_ptr + ex.to(tl.int64) * stride_rep + rows % nrep)
            dest = slot // S
            on = tl.load(mask_ptr + dest, mask=row_ok, other=0) != 0
            key = tl.where(real, tl.where(on, dest, R), R + 1).to(tl.int32)
            counts += tl.sum(((kcols[None, :] == key[:, None]) & row_ok[:, None]).to(tl.int32), 0)
            tl.store(keys_ptr + rows * K + j, key * S + (slot % S).to(tl.int32), mask=row_ok)
        if SCORING == "softmax":
            if NORM:
                chosen = tl.math.div_rn(chosen, total[:, None])
        else:
            if NORM:
                chosen = tl.math.div_rn(chosen, total[:, None] + 1e-20)
            chosen = chosen * scale
        w_at = weights_ptr + rows[:, None] * K + kj[None, :]
        tl.store(w_at, chosen.to(weights_ptr.dtype.element_ty), mask=row_ok[:, None] & (kj[None, :] < K))
    tl.store(counts_ptr + kcols, counts.to(tl.int64), mask=kcols < R + 2)
    tl.store(load_ptr + cols, tl.load(load_ptr + cols, mask=col_ok, other=0) + load, mask=col_ok)
    if HAS_MISROUTED:
        bad = tl.sum(tl.where(kcols == R, counts, 0), 0).to(tl.int64)
        tl.store(misrouted_ptr, tl.load(misrouted_ptr) + bad * tl.load(strict_ptr))
    starts = tl.cumsum(counts, 0) - counts
    tl.debug_barrier()  # the pair keys above, written by other threads of this program
    P = T * K
    for p0 in range(0, P, BLOCK_P):
        pairs = p0 + tl.arange(0, BLOCK_P)
        ok = pairs < P
        packed = tl.load(keys_ptr + pairs, mask=ok, other=0)
        key = tl.where(ok, packed // S, NKEY)  # NKEY matches no key column
        hit = (kcols[None, :] == key[:, None]).to(tl.int32)  # [BLOCK_P, NKEY]
        before = tl.sum(tl.cumsum(hit, 0) * hit, 1) - 1  # earlier pairs of the same key in the block
        pos = tl.sum(hit * starts[None, :], 1) + before
        tl.store(order_ptr + pos, pairs.to(tl.int64), mask=ok)
        tl.store(local_ptr + pos, packed % S, mask=ok)
        tl.store(position_ptr + pairs, pos, mask=ok)
        starts += tl.sum(hit, 0)


def route_and_sort(
    logits: torch.Tensor,
    valid: torch.Tensor | None,
    replicas: torch.Tensor,
    num_replicas: torch.Tensor,
    mask: torch.Tensor,
    load: torch.Tensor,
    top_k: int,
    norm: bool,
    slots_per_rank: int,
    dtype: torch.dtype,
    misrouted: tuple[torch.Tensor, torch.Tensor] | None = None,
    scoring: GroupedSigmoid | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """SparseMoE.route and the dispatch layout in one launch: (weights [T, k] in `dtype`, order
    [T*k] int64, local [T*k] int32, counts [R + 2] int64, position [T*k] int32), adding the real
    rows' pairs to `load`. `replicas` [E, max_replicas] and `num_replicas` [E] are the layer's rows
    of the ExpertMap; `mask` [R] the EP mask. `misrouted` (counter, strict): the counter gains
    the pairs routed to masked ranks (counts[R]) times strict. `scoring`: None for softmax
    top-k, else DeepSeek's grouped sigmoid (module docstring)."""
    T, E = logits.shape
    R, P = mask.shape[0], T * top_k
    dev = logits.device
    weights = torch.empty(T, top_k, dtype=dtype, device=dev)
    order = torch.empty(P, dtype=torch.int64, device=dev)
    local = torch.empty(P, dtype=torch.int32, device=dev)
    position = torch.empty(P, dtype=torch.int32, device=dev)
    counts = torch.empty(R + 2, dtype=torch.int64, device=dev)
    keys = torch.empty(P, dtype=torch.int32, device=dev)
    e_pad, nkey = max(2, triton.next_power_of_2(E)), triton.next_power_of_2(R + 2)
    bad, strict = misrouted if misrouted is not None else (load, load)
    sig = scoring or GroupedSigmoid(logits, 1, 1, 1.0)  # softmax: unread
    _route_kernel[(1,)](
        logits, logits.stride(0), valid if valid is not None else logits, replicas, replicas.stride(0),
        num_replicas, mask, load, bad, strict, weights, order, local, position, counts, keys, sig.bias, sig.scale,
        T, E, R, slots_per_rank,
        SCORING="softmax" if scoring is None else "sigmoid", N_GROUP=sig.n_group, TOPK_GROUP=sig.topk_group,
        K=top_k, K_PAD=triton.next_power_of_2(top_k), NORM=norm, HAS_VALID=valid is not None,
        HAS_MISROUTED=misrouted is not None, E_PAD=e_pad, NKEY=nkey,
        BLOCK_T=max(1, _TILE // max(e_pad, nkey)), BLOCK_P=max(1, _TILE // nkey),
        # The sigmoid's live tiles (scores, biased choice, group scores) spill at 4 warps (sm_90, 256 experts).
        num_warps=4 if scoring is None else 8, enable_fp_fusion=False,
    )  # fmt: skip
    return weights, order, local, counts, position


@triton.jit
def _gather_kernel(x_ptr, stride_x, order_ptr, rows_ptr, H, K: tl.constexpr, BLOCK_H: tl.constexpr):
    i = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = offs < H
    src = tl.load(order_ptr + i) // K
    tl.store(rows_ptr + i.to(tl.int64) * H + offs, tl.load(x_ptr + src * stride_x + offs, mask=ok), mask=ok)


def gather_rows(x: torch.Tensor, order: torch.Tensor, top_k: int) -> torch.Tensor:
    """x[order // top_k]: each position's token row."""
    P, H = order.shape[0], x.shape[1]
    x = x if x.stride(1) == 1 else x.contiguous()
    rows = torch.empty(P, H, dtype=x.dtype, device=x.device)
    if P:
        block = min(1024, triton.next_power_of_2(H))
        _gather_kernel[(P, triton.cdiv(H, block))](x, x.stride(0), order, rows, H, K=top_k, BLOCK_H=block)
    return rows


@triton.jit
def _combine_kernel(out_ptr, position_ptr, w_ptr, y_ptr, H, K: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = offs < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(K):
        pos = tl.load(position_ptr + t * K + j).to(tl.int64)
        w = tl.load(w_ptr + t * K + j).to(tl.float32)
        v = tl.load(out_ptr + pos * H + offs, mask=ok, other=0.0).to(tl.float32)
        # The product of two values of y's dtype is exact in fp32, so this is its one rounding.
        acc = acc + (v * w).to(y_ptr.dtype.element_ty).to(tl.float32)
    tl.store(y_ptr + t.to(tl.int64) * H + offs, acc.to(y_ptr.dtype.element_ty), mask=ok)


def combine_pairs(out: torch.Tensor, position: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Token t: the sum over j of out[position[t*k + j]] * weights[t, j] ([T*k, H] -> [T, H])."""
    T, k = weights.shape
    H = out.shape[1]
    out = out.contiguous()
    y = torch.empty(T, H, dtype=out.dtype, device=out.device)
    if T:
        block = min(1024, triton.next_power_of_2(H))
        _combine_kernel[(T, triton.cdiv(H, block))](
            out, position, weights, y, H, K=k, BLOCK_H=block, enable_fp_fusion=False
        )
    return y
