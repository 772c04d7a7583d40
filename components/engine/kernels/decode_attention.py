"""Decode attention on CUDA: one query token per sequence against that sequence's KV cache, read
in place, as one Triton kernel: GQA over K and V caches (`decode_attention`), and MLA's multi-query
attention over a latent cache whose rows are the keys and whose first columns are the values
(`latent_decode_attention`, deepseek_v3.py).

Gathering each row's cache rows first (layers.gathered_decode, the CPU path) copies the whole
cache length for every row of a graph, padding rows and short contexts alike, so at a realistic
max_len the copy is most of the step. Here one program owns one sequence and a block of the q
heads of one KV head: it reads the row's slot and context length on the device and walks that
slot's cache BLOCK_N positions at a time up to the context length only, with an online softmax in
fp32. The launch grid depends on the batch size alone, so a graph captures it, and a padding row
(one scratch token) costs one block.

The q heads sharing a KV head go through one program, as the M dimension of its dots, so they
share its K/V loads (on tensor cores); they are padded to the 16 rows a dot needs (the padding
rows are zero and never stored), and the head dim to at least 16 likewise. Where a KV head has
more q heads than an fp32 accumulator of ACC_ELEMENTS holds (MLA: 128 heads of 512 latent
columns), they are split into blocks of heads, each program reading the same K tiles (from L2).
A key is its value's columns followed by TAIL more (MLA's rotary key, dotted separately so the
512 + 64 columns are not padded to 1024), and so is a query, its two parts read from two tensors
(MLA's latent query and rotated rope query, as LatentAttention computes them: no concatenation);
when the values are the keys' first columns (V_IS_K) the one tile loaded serves both dots.

A mixed step lays a prompt piece out a token a row, each row's context ending at itself
(cuda_graphs.py), and a program a row read the piece's cache once per token, a 1024-token prompt
half a million block loads a KV head, and padded a GQA group of 4 q heads to the dot's 16 rows:
the prompt's attention ran at a fraction of its tensor-core rate. So the rows from `alone` on (a
mixed step's prompt rows) go to programs 16 // heads at a time, their q heads stacked in the
dot's M; a run of them sharing a slot walks its cache once, each row masked at its own context.

A row's result depends only on its query, its cache and its context length: no split of the
sequence across programs, a fixed block order, and positions past the context masked to exactly
zero weight. So a row's output does not change with the batch size or the padding rows beside it,
nor with the rows it shares a program with: its dots have the same shape, its elements the same
sums, and a block past its context changes nothing of its softmax state (weight 0, rescale 1).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

BLOCK_N = 64  # cache positions per step of a program's loop
LATENT_BLOCK_N = 32  # the same for MLA, whose 576-column key tiles are 4.5 times GQA's
ACC_ELEMENTS = 8192  # a program's fp32 accumulator, heads x value columns: 64 registers a thread at 4 warps


@triton.jit
def _run(q, q_t, k_ptr, v_ptr, cache, n, n_row, stride_cl, offs_d, d_ok, offs_t, t_ok, qk_scale,
         HD: tl.constexpr, TAIL: tl.constexpr, M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
         V_IS_K: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """Softmax attention of the M query rows `q` over the first `n` positions of one cache slot
    (`cache`: its offset and kv head's), row i seeing the first n_row[i] <= n of them."""
    m = tl.full((M,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((M,), dtype=tl.float32)
    acc = tl.zeros((M, BLOCK_D), dtype=tl.float32)
    for start in range(0, n, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        p_ok = pos < n
        at = cache + pos[:, None].to(tl.int64) * stride_cl
        kv_mask = p_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + at + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if TAIL > 0:
            k_t = tl.load(k_ptr + at + HD + offs_t[None, :], mask=p_ok[:, None] & t_ok[None, :], other=0.0)
            s += tl.dot(q_t, tl.trans(k_t), input_precision=PRECISION)
        # Each row's first block holds a position it sees, so m_new is finite, a masked position's
        # weight is exp2(-inf) = 0 exactly, and a block wholly past a row's context leaves its
        # state exactly as it was (alpha = exp2(0) = 1, weights 0): a row's bits are those it has
        # alone, whatever n the rows beside it walk to.
        s = tl.where(pos[None, :] < n_row[:, None], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        if V_IS_K:
            v = k
        else:
            v = tl.load(v_ptr + at + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    return acc / l[:, None]


@triton.jit
def _decode_kernel(
    q_ptr,  # [B, nh, HD]
    qt_ptr,  # [B, nh, TAIL] the queries' last columns (unread when TAIL is 0)
    k_ptr,  # [slots, max_len, n_kv, HD + TAIL] the layer's key cache
    v_ptr,  # same slots, positions and heads: the value cache (HD columns); unread when V_IS_K
    slots_ptr,  # [B] int64: each row's cache slot
    ctx_ptr,  # [B] int64: each row's context length (>= 1)
    out_ptr,  # [B, nh, HD] in q's dtype
    n_rows,  # B
    alone,  # rows [0, alone) take a program each; the rest go ROWS to a program
    stride_qb,
    stride_qh,
    stride_qtb,
    stride_qth,
    stride_ob,
    stride_oh,
    stride_cs,  # cache strides: slot, position, kv head (the head dim is contiguous)
    stride_cl,
    stride_ch,
    qk_scale,  # softmax scale * log2(e): the softmax runs in base 2
    HD: tl.constexpr,  # the value columns, and the keys' first columns
    TAIL: tl.constexpr,  # the keys' columns past HD (0 for GQA)
    GROUP: tl.constexpr,  # q heads per kv head
    BLOCK_G: tl.constexpr,  # q heads of a row a program takes
    ROWS: tl.constexpr,  # rows a program past `alone`: the dots' M is ROWS x BLOCK_G
    BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    V_IS_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    first = tl.where(pid < alone, pid, alone + (pid - alone) * ROWS)
    end = tl.minimum(tl.where(pid < alone, pid + 1, first + ROWS), n_rows)
    offs_m = tl.arange(0, ROWS * BLOCK_G)
    row = first + offs_m // BLOCK_G
    offs_g = tl.program_id(2) * BLOCK_G + offs_m % BLOCK_G
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = row < end
    g_ok = offs_g < GROUP
    d_ok = offs_d < HD
    heads = kvh * GROUP + offs_g
    m_ok = row_ok & g_ok
    n_m = tl.load(ctx_ptr + row, mask=row_ok, other=0)
    q = tl.load(
        q_ptr + row[:, None].to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=m_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    offs_t = tl.arange(0, BLOCK_T)
    t_ok = offs_t < TAIL
    q_t = q
    if TAIL > 0:
        q_t = tl.load(
            qt_ptr + row[:, None].to(tl.int64) * stride_qtb + heads[:, None] * stride_qth + offs_t[None, :],
            mask=m_ok[:, None] & t_ok[None, :],
            other=0.0,
        )
    dtype = out_ptr.dtype.element_ty
    if ROWS == 1:  # a row a program: its heads are the dot's rows
        slot = tl.load(slots_ptr + first)
        n = tl.load(ctx_ptr + first)
        cache = slot.to(tl.int64) * stride_cs + kvh * stride_ch
        o = _run(q, q_t, k_ptr, v_ptr, cache, n, n_m, stride_cl, offs_d, d_ok, offs_t, t_ok, qk_scale,
                 HD, TAIL, ROWS * BLOCK_G, BLOCK_D, BLOCK_N, V_IS_K, PRECISION)  # fmt: skip
        out = row[:, None].to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(out_ptr + out, o.to(dtype), mask=m_ok[:, None] & d_ok[None, :])
    else:
        # Each run of the program's rows that shares a slot (a prompt piece's tokens) walks that
        # slot's cache once, for all its rows, each row masked at its own context; the other rows
        # (not stored) see the run's, so their softmax stays finite.
        slot_m = tl.load(slots_ptr + row, mask=row_ok, other=-1)
        for lead in range(first, end):
            slot = tl.load(slots_ptr + lead)
            if (lead == first) | (tl.load(slots_ptr + tl.maximum(lead - 1, 0)) != slot):
                run = row_ok & (row >= lead) & (slot_m == slot)
                n = tl.max(tl.where(run, n_m, 0), 0)
                cache = slot.to(tl.int64) * stride_cs + kvh * stride_ch
                o = _run(q, q_t, k_ptr, v_ptr, cache, n, tl.where(run, n_m, n), stride_cl, offs_d, d_ok, offs_t,
                         t_ok, qk_scale, HD, TAIL, ROWS * BLOCK_G, BLOCK_D, BLOCK_N, V_IS_K, PRECISION)  # fmt: skip
                out = row[:, None].to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
                tl.store(out_ptr + out, o.to(dtype), mask=(run & g_ok)[:, None] & d_ok[None, :])


def _attend(q, q_tail, k_cache, v_cache, slots, ctx_lens, out, scale: float, block_n: int, alone: int) -> torch.Tensor:
    B, nh, hd = q.shape
    n_kv = k_cache.shape[2]
    group = nh // n_kv
    block_d = max(16, triton.next_power_of_2(hd))
    block_g = min(triton.next_power_of_2(group), ACC_ELEMENTS // block_d)
    alone = min(alone, B)
    # A dot's 16 rows of M: a row's q heads and padding, or past `alone` several rows' heads.
    rows = max(1, 16 // block_g) if alone < B else 1
    block_g = max(block_g, 16 // rows)
    tail = k_cache.shape[3] - hd
    _decode_kernel[(alone + triton.cdiv(B - alone, rows), n_kv, triton.cdiv(group, block_g))](
        q, q_tail, k_cache, v_cache, slots, ctx_lens, out, B, alone,
        q.stride(0), q.stride(1), q_tail.stride(0), q_tail.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), scale * math.log2(math.e),
        HD=hd, TAIL=tail, GROUP=group, BLOCK_G=block_g, ROWS=rows, BLOCK_D=block_d,
        BLOCK_T=max(16, triton.next_power_of_2(tail)), BLOCK_N=block_n, V_IS_K=v_cache is k_cache,
        PRECISION="ieee" if q.dtype == torch.float32 else None,  # fp32 stays fp32 (no TF32)
    )  # fmt: skip
    return out


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    ctx_lens: torch.Tensor,
    alone: int | None = None,
) -> torch.Tensor:
    """Softmax attention of q [B, nh, hd] (one token per row) over the first ctx_lens[i] positions
    of cache slot slots[i] of k_cache/v_cache [slots, max_len, n_kv, hd], q head h reading kv head
    h // (nh // n_kv), scale 1/sqrt(hd) (scaled_dot_product_attention's). Returns [B, nh, hd] in
    q's dtype. Every ctx_lens[i] must be at least 1, and the two caches must share one layout with
    a contiguous head dim, as KVCache allocates them. Rows from `alone` on (default: none) go to
    programs several at a time (a mixed step's prompt tokens): rows of one slot there read its
    cache once between them; a row's result is the same either way."""
    q = q.contiguous()
    scale, alone = 1.0 / math.sqrt(q.shape[-1]), q.shape[0] if alone is None else alone
    return _attend(q, q, k_cache, v_cache, slots, ctx_lens, torch.empty_like(q), scale, BLOCK_N, alone)


def latent_decode_attention(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    cache: torch.Tensor,
    slots: torch.Tensor,
    ctx_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """MLA decode (deepseek_v3.latent_decode of the query [q_latent, q_rope]): q_latent [B, nh,
    lora] and q_rope [B, nh, rope] against the first ctx_lens[i] rows of slot slots[i] of the
    latent cache [slots, max_len, 1, lora + rope], keys the whole rows, values their first `lora`
    columns. Returns [B, nh, lora] in q's dtype, heads outermost in memory (a transpose of a
    contiguous [nh, B, lora]: what the value up-projection's bmm reads). Both query parts may
    have any strides with a contiguous last dim."""
    B, nh, lora = q_latent.shape
    assert q_latent.stride(-1) == q_rope.stride(-1) == cache.stride(-1) == 1
    assert q_rope.shape[-1] == cache.shape[-1] - lora
    out = torch.empty((nh, B, lora), dtype=q_latent.dtype, device=q_latent.device).transpose(0, 1)
    return _attend(q_latent, q_rope, cache, cache, slots, ctx_lens, out, scale, LATENT_BLOCK_N, B)
