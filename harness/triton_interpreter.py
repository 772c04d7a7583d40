"""Triton's interpreter, so the engine's Triton kernels run on CPU tensors where there is no GPU
(CI, a CPU smoke run of a benchmark)."""

from __future__ import annotations

import os


def enable() -> None:
    """Interpret every Triton kernel defined from now on in this process: call it before the
    kernels' modules are imported (TRITON_INTERPRET is read when a kernel is defined), and only in
    a process that runs no compiled kernel."""
    os.environ["TRITON_INTERPRET"] = "1"
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    # The interpreter keeps bf16 as uint16 bit patterns and its tl.dot multiplies those (Triton
    # documents bf16 arithmetic as unsupported there). Widening bf16 operands to fp32 first is
    # exact, and is what a GPU's bf16 dot computes with its fp32 accumulator.
    dot = interpreter.InterpreterBuilder.create_dot

    def widen(t):
        if t.dtype != tl.bfloat16:
            return t
        return interpreter.TensorHandle((t.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    def create_dot(self, a, b, d, *rest):
        a, b = widen(a), widen(b)
        if a.data.ndim != 2:
            return dot(self, a, b, d, *rest)
        # Row by row (one matrix-vector product a row, numpy's loop over the leading axis): a
        # block's matmul would let BLAS pick its summation order by the block's shape, so a row
        # would differ in its last bits with the rows beside it; a GPU's dot does not.
        rows = [interpreter.TensorHandle(x.data[:, None, :], x.dtype.scalar) for x in (a, d)]
        out = dot(self, rows[0], b, rows[1], *rest)
        return interpreter.TensorHandle(out.data[:, 0, :], out.dtype.scalar)

    interpreter.InterpreterBuilder.create_dot = create_dot

    # Its fp32 -> bf16 cast truncates the mantissa (`.to(tl.bfloat16)` rounds to nearest even on a
    # GPU) and mangles subnormals, so a kernel's bf16 result could not equal torch's bitwise: both
    # directions go through torch (bf16 -> fp32 is exact: the bit pattern shifted).
    cast, fp_to_fp = interpreter.InterpreterBuilder.cast_impl, interpreter.InterpreterBuilder.create_fp_to_fp

    def to_bf16(src):
        import torch

        bf16 = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32)).to(torch.bfloat16)
        return interpreter.TensorHandle(bf16.view(torch.int16).numpy().view(np.uint16), tl.bfloat16)

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return to_bf16(src)
        if src.dtype.scalar == tl.bfloat16 and dst_type.scalar == tl.float32:
            return widen(src)
        return cast(self, src, dst_type)

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return to_bf16(src)
        return fp_to_fp(self, src, dst_type, rounding_mode)

    interpreter.InterpreterBuilder.cast_impl = cast_impl
    interpreter.InterpreterBuilder.create_fp_to_fp = create_fp_to_fp

    # libdevice's functions are stubs the compiler links in, which the interpreter cannot call;
    # the kernels use libdevice.exp (torch's expf) where tl.exp would be the approximate ex2, and
    # here numpy's exp stands in (the interpreted tl.exp), within an ulp of it.
    from triton.language.extra import libdevice

    libdevice.exp = lambda x: tl.exp(x)
