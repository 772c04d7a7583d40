"""The CUDA context's stack reserve: local memory for every thread the GPU can hold at once.

The driver sizes it as the per-thread stack limit (1 KiB by default) times every resident thread
slot, grows it when a kernel needs more, and never shrinks it by itself: 277 MB on an H200,
over a third of the device memory a CUDA checkpoint of a released worker moved (docs/design.md,
"What a restore costs"; halving the limit freed 138 MB at once).

A rank lowers the limit while its memory is released (parked, or baked into a snapshot), so
neither the checkpoint nor the image holds the reserve, and sets it back before it steps again:
the driver would regrow it on the first launch anyway, but then inside the first decode step.
`cuda.bindings` is imported lazily, so this module imports anywhere.
"""

from __future__ import annotations

import torch

from components.engine.memory.vmm import _check, _driver


def _limit(device: torch.device, value: int | None = None) -> int:
    """The per-thread limit, then set to `value` if one is given."""
    d = _driver()
    with torch.cuda.device(device):
        torch.cuda.synchronize()  # the primary context is current, and no kernel is using the reserve
        had = int(_check(d, "cuCtxGetLimit(CU_LIMIT_STACK_SIZE)", d.cuCtxGetLimit(d.CUlimit.CU_LIMIT_STACK_SIZE)))
        if value is not None:
            _check(d, "cuCtxSetLimit(CU_LIMIT_STACK_SIZE)", d.cuCtxSetLimit(d.CUlimit.CU_LIMIT_STACK_SIZE, value))
        return had


def lower(device: torch.device) -> int:
    """Shrink the reserve to the least the driver keeps; returns the per-thread limit it had."""
    return _limit(device, 0)


def restore(device: torch.device, per_thread: int) -> None:
    """Set the per-thread limit back to `per_thread` (what `lower` returned): the reserve is
    allocated again now, not in the next kernel launch."""
    _limit(device, per_thread)


def per_thread(device: torch.device) -> int:
    return _limit(device)
