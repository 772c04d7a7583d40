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

    def create_dot(self, a, b, *rest):
        return dot(self, widen(a), widen(b), *rest)

    interpreter.InterpreterBuilder.create_dot = create_dot
