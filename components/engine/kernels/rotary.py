"""The rotary embedding of q and k and the KV cache write of k and v on CUDA, as one Triton kernel.

The torch form (layers.Rotary, then two indexed stores into the cache) is about sixteen kernels a
layer: per tensor two table gathers, a negation, a concatenation, two multiplies and an add, then
one index_put per cache. Here one program owns one head of one token: a q head is rotated into
the output; a kv head's k is rotated and stored, with its v, straight into the cache at the
token's (slot, position). Positions and slots are read on the device, so a captured graph follows
the values its static buffers hold at replay.

The numerics are the torch form's bit for bit: the table entries are cast to x's dtype, each
product is rounded to that dtype, and so is their sum (rotate_half over split halves, HF's
convention; a negation is exact). Floating-point contraction is off (enable_fp_fusion=False), so
in fp32 a multiply and the add are not fused into an FMA that torch's separate kernels do not do.
Partial rotary (GLM) follows the tables' width, as transformers does: the first ROT dims of a
head are rotated, the rest copied as they are.

Each program reads its own token and head only, so a row's result does not depend on the batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate(x, partner, cos, sin, ROT: tl.constexpr, offs):
    """x * cos + rotate_half(x) * sin in the first ROT dims, each product and the sum rounded to
    x's dtype; x past them."""
    dt = x.dtype
    rot = tl.where(offs < ROT // 2, -partner.to(tl.float32), partner.to(tl.float32))
    a = (x.to(tl.float32) * cos.to(tl.float32)).to(dt)
    b = (rot * sin.to(tl.float32)).to(dt)
    return tl.where(offs < ROT, (a.to(tl.float32) + b.to(tl.float32)).to(dt), x)


@triton.jit
def _rotary_cache_kernel(
    q_ptr,  # [T, nh, hd]
    k_ptr,  # [T, n_kv, hd]
    v_ptr,  # [T, n_kv, hd]
    cos_ptr,  # [max_len, ROT] the rotary tables
    sin_ptr,
    pos_ptr,  # [T] int64 positions
    slot_ptr,  # [T] int64 KV slots
    kc_ptr,  # [slots, max_len, n_kv, hd] the layer's key cache
    vc_ptr,  # same layout: the value cache
    out_ptr,  # [T, nh, hd] the rotated q, contiguous
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_tab,
    stride_cs,  # cache strides: slot, position, kv head (the head dim is contiguous)
    stride_cl,
    stride_ch,
    NH: tl.constexpr,
    HD: tl.constexpr,
    ROT: tl.constexpr,  # the rotated dims, HD or fewer
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)  # a q head below NH, else kv head head - NH
    pos = tl.load(pos_ptr + t).to(tl.int64)
    HALF: tl.constexpr = ROT // 2
    offs = tl.arange(0, BLOCK_D)
    ok = offs < HD
    rotated = offs < ROT
    # A rotated dim's rotate_half partner; a dim past ROT is its own (and passes unchanged).
    partner = tl.where(offs < HALF, offs + HALF, tl.where(rotated, offs - HALF, offs))
    dt = q_ptr.dtype.element_ty
    cos = tl.load(cos_ptr + pos * stride_tab + offs, mask=rotated, other=0.0).to(dt)
    sin = tl.load(sin_ptr + pos * stride_tab + offs, mask=rotated, other=0.0).to(dt)
    if head < NH:
        src = q_ptr + t * stride_qt + head * stride_qh
        x = tl.load(src + offs, mask=ok, other=0.0)
        y = tl.load(src + partner, mask=ok, other=0.0)
        tl.store(out_ptr + (t * NH + head) * HD + offs, _rotate(x, y, cos, sin, ROT, offs), mask=ok)
    else:
        kvh = head - NH
        slot = tl.load(slot_ptr + t).to(tl.int64)
        dst = slot * stride_cs + pos * stride_cl + kvh * stride_ch + offs
        src = k_ptr + t * stride_kt + kvh * stride_kh
        x = tl.load(src + offs, mask=ok, other=0.0)
        y = tl.load(src + partner, mask=ok, other=0.0)
        tl.store(kc_ptr + dst, _rotate(x, y, cos, sin, ROT, offs).to(kc_ptr.dtype.element_ty), mask=ok)
        v = tl.load(v_ptr + t * stride_vt + kvh * stride_vh + offs, mask=ok, other=0.0)
        tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty), mask=ok)


def rotary_cache_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    token_slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> torch.Tensor:
    """Rotary of q [T, nh, hd] and k [T, n_kv, hd] at `positions` (tables cos/sin [max_len, rot],
    layers.Rotary's: the first rot <= hd dims of each head are rotated); the rotated k and v
    [T, n_kv, hd] are stored into k_cache/v_cache [slots, max_len, n_kv, hd] at (token_slots[t],
    positions[t]). Returns the rotated q, contiguous. q, k and v share a dtype and have a
    contiguous head dim, as do the tables and the caches."""
    assert q.dtype == k.dtype == v.dtype and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
    assert cos.stride() == sin.stride() and cos.stride(-1) == 1
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    T, nh, hd = q.shape
    n_kv, rot = k.shape[1], cos.shape[1]
    assert rot % 2 == 0 and rot <= hd
    out = torch.empty((T, nh, hd), dtype=q.dtype, device=q.device)
    _rotary_cache_kernel[(T, nh + n_kv)](
        q, k, v, cos, sin, positions, token_slots, k_cache, v_cache, out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NH=nh, HD=hd, ROT=rot, BLOCK_D=triton.next_power_of_2(hd), num_warps=1, enable_fp_fusion=False,
    )  # fmt: skip
    return out
