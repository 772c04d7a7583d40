"""MLA's rotary embedding of q and k and its latent KV cache write on CUDA (deepseek_v3's
LatentAttention), as one Triton kernel.

The torch form is about twenty kernels a layer: DeepSeek's interleaved rotary pairs laid out as
rotate-half (deepseek_v3._deinterleave, a copy each for q and k), layers.Rotary on each (table
gathers and casts, a negation, a concatenation, two multiplies and an add), then the normed latent
and the rotated key concatenated and stored at the token's (slot, position). Here one program owns
one head of one token: a q head's rotary part is read in the rotate-half order (the permutation
is in the load) and rotated into the output; the token's last program rotates the shared key and
stores it behind the latent in the token's cache row. Positions and slots are read on the device,
so a captured graph follows the values its static buffers hold at replay.

The numerics are the torch form's bit for bit, as rotary.py's (its `_rotate`: the tables cast to
x's dtype, each product and the sum rounded to it, floating-point contraction off); the latent is
copied as it is. Each program reads its own token only, so a row's result does not depend on the
batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from components.engine.kernels.rotary import _rotate


@triton.jit
def _latent_rotary_kernel(
    q_ptr,  # [T, nh, ROPE] the queries' rotary parts
    k_ptr,  # [T, ROPE] the shared rotary key
    c_ptr,  # [T, LORA] the normed latent
    cos_ptr,  # [max_len, ROPE] the rotary tables
    sin_ptr,
    pos_ptr,  # [T] int64 positions
    slot_ptr,  # [T] int64 KV slots
    cache_ptr,  # [slots, max_len, 1, LORA + ROPE] the layer's latent cache
    out_ptr,  # [T, nh, ROPE] the rotated q, contiguous
    stride_qt,
    stride_qh,
    stride_kt,
    stride_ct,
    stride_tab,
    stride_cs,  # cache strides: slot, position (the row is contiguous)
    stride_cl,
    NH: tl.constexpr,
    ROPE: tl.constexpr,
    LORA: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_L: tl.constexpr,
    INTERLEAVE: tl.constexpr,  # pairs (x0, x1), (x2, x3), ...: read as (x0, x2, ..., x1, x3, ...)
):
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)  # a q head below NH, else the token's key and latent
    pos = tl.load(pos_ptr + t).to(tl.int64)
    HALF: tl.constexpr = ROPE // 2
    offs = tl.arange(0, BLOCK_R)
    ok = offs < ROPE
    partner = tl.where(offs < HALF, offs + HALF, offs - HALF)
    if INTERLEAVE:
        at = tl.where(offs < HALF, 2 * offs, 2 * (offs - HALF) + 1)
        partner_at = tl.where(partner < HALF, 2 * partner, 2 * (partner - HALF) + 1)
    else:
        at, partner_at = offs, partner
    dt = q_ptr.dtype.element_ty
    cos = tl.load(cos_ptr + pos * stride_tab + offs, mask=ok, other=0.0).to(dt)
    sin = tl.load(sin_ptr + pos * stride_tab + offs, mask=ok, other=0.0).to(dt)
    if head < NH:
        src = q_ptr + t * stride_qt + head * stride_qh
        x = tl.load(src + at, mask=ok, other=0.0)
        y = tl.load(src + partner_at, mask=ok, other=0.0)
        tl.store(out_ptr + (t * NH + head) * ROPE + offs, _rotate(x, y, cos, sin, ROT=ROPE, offs=offs), mask=ok)
    else:
        row = cache_ptr + tl.load(slot_ptr + t).to(tl.int64) * stride_cs + pos * stride_cl
        x = tl.load(k_ptr + t * stride_kt + at, mask=ok, other=0.0)
        y = tl.load(k_ptr + t * stride_kt + partner_at, mask=ok, other=0.0)
        k = _rotate(x, y, cos, sin, ROT=ROPE, offs=offs)
        tl.store(row + LORA + offs, k.to(cache_ptr.dtype.element_ty), mask=ok)
        lo = tl.arange(0, BLOCK_L)
        c = tl.load(c_ptr + t * stride_ct + lo, mask=lo < LORA, other=0.0)
        tl.store(row + lo, c.to(cache_ptr.dtype.element_ty), mask=lo < LORA)


def latent_rotary_cache_write(
    q_rope: torch.Tensor,
    k_rope: torch.Tensor,
    latent: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    token_slots: torch.Tensor,
    cache: torch.Tensor,
    interleave: bool,
) -> torch.Tensor:
    """Rotary of q_rope [T, nh, rope] and k_rope [T, rope] at `positions` (tables cos/sin
    [max_len, rope], layers.Rotary's), their pairs interleaved where `interleave` (DeepSeek's
    rope_interleave); [latent [T, lora], rotated k] is stored into cache [slots, max_len, 1,
    lora + rope] at (token_slots[t], positions[t]). Returns the rotated q [T, nh, rope] in the
    rotate-half order, contiguous. Every operand has a contiguous last dim."""
    assert q_rope.dtype == k_rope.dtype and q_rope.stride(-1) == k_rope.stride(-1) == latent.stride(-1) == 1
    assert cos.stride() == sin.stride() and cos.stride(-1) == 1 and cache.stride(-1) == 1
    T, nh, rope = q_rope.shape
    lora = latent.shape[1]
    out = torch.empty((T, nh, rope), dtype=q_rope.dtype, device=q_rope.device)
    _latent_rotary_kernel[(T, nh + 1)](
        q_rope, k_rope, latent, cos, sin, positions, token_slots, cache, out,
        q_rope.stride(0), q_rope.stride(1), k_rope.stride(0), latent.stride(0), cos.stride(0),
        cache.stride(0), cache.stride(1),
        NH=nh, ROPE=rope, LORA=lora, BLOCK_R=triton.next_power_of_2(rope), BLOCK_L=triton.next_power_of_2(lora),
        INTERLEAVE=interleave, num_warps=1, enable_fp_fusion=False,
    )  # fmt: skip
    return out
