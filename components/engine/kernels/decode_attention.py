"""Decode attention on CUDA: one query token per sequence against that sequence's KV cache, read
in place, as one Triton kernel.

Gathering each row's cache rows first (layers.gathered_decode, the CPU path) copies the whole
cache length for every row of a graph, padding rows and short contexts alike, so at a realistic
max_len the copy is most of the step. Here one program owns one sequence and one KV head: it
reads the row's slot and context length on the device and walks that slot's cache BLOCK_N
positions at a time up to the context length only, with an online softmax in fp32. The launch
grid depends on the batch size alone, so a graph captures it, and a padding row (one scratch
token) costs one block.

The q heads sharing a KV head (GQA) go through one program, so they share its K/V loads; they are
padded to the 16 rows a dot needs (the padding rows are zero and never stored), and the head dim
to at least 16 likewise.

A row's result depends only on its query, its cache and its context length: no split of the
sequence across programs, a fixed block order, and positions past the context masked to exactly
zero weight. So a row's output does not change with the batch size or the padding rows beside it.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

BLOCK_N = 64  # cache positions per step of a program's loop


@triton.jit
def _decode_kernel(
    q_ptr,  # [B, nh, hd]
    k_ptr,  # [slots, max_len, n_kv, hd] the layer's key cache
    v_ptr,  # same layout: the value cache
    slots_ptr,  # [B] int64: each row's cache slot
    ctx_ptr,  # [B] int64: each row's context length (>= 1)
    out_ptr,  # [B, nh, hd] in q's dtype, with q's strides
    stride_qb,
    stride_qh,
    stride_cs,  # cache strides: slot, position, kv head (the head dim is contiguous)
    stride_cl,
    stride_ch,
    qk_scale,  # softmax scale * log2(e): the softmax runs in base 2
    HD: tl.constexpr,
    GROUP: tl.constexpr,  # q heads per kv head
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    n = tl.load(ctx_ptr + b)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_ok = offs_g < GROUP
    d_ok = offs_d < HD
    heads = kvh * GROUP + offs_g
    q_off = b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    qo_mask = g_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + q_off, mask=qo_mask, other=0.0)
    cache = slot * stride_cs + kvh * stride_ch + offs_d[None, :]
    m = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
    for start in range(0, n, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        p_ok = pos < n
        kv_off = cache + pos[:, None].to(tl.int64) * stride_cl
        kv_mask = p_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        s = tl.where(p_ok[None, :], s, float("-inf"))
        # Every block holds at least one position below n, so m_new is finite and a masked
        # position's weight is exp2(-inf) = 0 exactly.
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    tl.store(out_ptr + q_off, (acc / l[:, None]).to(out_ptr.dtype.element_ty), mask=qo_mask)


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, ctx_lens: torch.Tensor
) -> torch.Tensor:
    """Softmax attention of q [B, nh, hd] (one token per row) over the first ctx_lens[i] positions
    of cache slot slots[i] of k_cache/v_cache [slots, max_len, n_kv, hd], q head h reading kv head
    h // (nh // n_kv), scale 1/sqrt(hd) (scaled_dot_product_attention's). Returns [B, nh, hd] in
    q's dtype. Every ctx_lens[i] must be at least 1, and the two caches must share one layout with
    a contiguous head dim, as KVCache allocates them."""
    q = q.contiguous()
    B, nh, hd = q.shape
    n_kv = k_cache.shape[2]
    group = nh // n_kv
    out = torch.empty_like(q)
    _decode_kernel[(B, n_kv)](
        q, k_cache, v_cache, slots, ctx_lens, out,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        (1.0 / math.sqrt(hd)) * math.log2(math.e),
        HD=hd, GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_D=max(16, triton.next_power_of_2(hd)),
        BLOCK_N=BLOCK_N, PRECISION="ieee" if q.dtype == torch.float32 else None,  # fp32 stays fp32 (no TF32)
    )  # fmt: skip
    return out
