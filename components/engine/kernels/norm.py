"""RMSNorm on CUDA as one Triton kernel, alone or fused with the residual add in front of it.

The torch form (layers.RMSNorm) is eight kernels (cast, square, mean, add, rsqrt, multiply, cast,
weight multiply), and a decoder block runs it after a residual add: in a decode graph of a few
rows every one of them is a launch plus a gap. Here one program owns one row and does all of it
in one read of the row and one write.

The numerics are the torch form's on the CPU: the norm in fp32 with the mean's division, the
square root and the reciprocal each correctly rounded (torch's CPU rsqrt is 1 / sqrt; its CUDA
rsqrt and Triton's are approximations), the normed row rounded to the input's dtype, then the
weight multiply in fp32 rounded once to the promoted dtype (what torch does for bf16 * bf16). The
fused residual add rounds its sum to the input's dtype before the norm reads it, as torch's add
does. Only the order of the mean's sum differs from torch, so where that sum is exact (the tests'
integer rows) the result is torch's bit for bit. Floating-point contraction is off
(enable_fp_fusion=False), so no multiply and add are fused into one FMA that torch does not do.

A row's result depends on that row alone: the grid is one program per row and the reduction is
within the program, so the result is the same whatever the batch around it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [R, H]
    res_ptr,  # [R, H] added to x first when ADD
    w_ptr,  # [H]
    h_ptr,  # [R, H] x + res in x's dtype, written when ADD
    out_ptr,  # [R, H] the normed row times the weight
    stride_x,
    stride_res,
    stride_h,
    stride_out,
    eps,
    H: tl.constexpr,
    BLOCK: tl.constexpr,
    ADD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < H
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0)
    if ADD:
        r = tl.load(res_ptr + row * stride_res + offs, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(h_ptr + row * stride_h + offs, x, mask=ok)
    h = x.to(tl.float32)
    mean = tl.math.div_rn(tl.sum(h * h, axis=0), H)
    normed = (h * tl.math.div_rn(1.0, tl.math.sqrt_rn(mean + eps))).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0)
    out = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, out.to(out_ptr.dtype.element_ty), mask=ok)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    H = x.shape[-1]
    x2 = x.reshape(-1, H)
    if x2.stride(-1) != 1:  # rows may be apart (a slice of a fused projection), not their elements
        x2 = x2.contiguous()
    res2 = x2 if residual is None else residual.reshape(-1, H).contiguous()
    h = x2 if residual is None else torch.empty_like(x2)
    out = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    block = triton.next_power_of_2(H)
    _rms_norm_kernel[(x2.shape[0],)](
        x2, res2, weight, h, out,
        x2.stride(0), res2.stride(0), h.stride(0), out.stride(0), eps,
        H=H, BLOCK=block, ADD=residual is not None,
        num_warps=min(max(block // 512, 1), 16), enable_fp_fusion=False,
    )  # fmt: skip
    return h.view(x.shape), out.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """layers.RMSNorm over the last dim of x (contiguous there): weight * norm(x).to(x.dtype), in
    the dtype torch promotes weight and x to."""
    return _launch(x, None, weight, eps)[1]


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, rms_norm(h)) for h = x + residual in x's dtype (x and residual share a dtype and shape)."""
    assert x.dtype == residual.dtype and x.shape == residual.shape
    return _launch(x, residual, weight, eps)
