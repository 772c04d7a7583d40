"""Giving back the physical pages of host tensors whose contents no longer matter.

Linux refills a dropped anonymous page with zeros when it is next touched, and CRIU dumps only
pages present: a dropped tensor costs neither the process's memory nor a snapshot image's bytes,
and keeps its address.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterable

import torch

MADV_DONTNEED = 4


def drop(tensors: Iterable[torch.Tensor]) -> int:
    """Drop the pages wholly inside each CPU tensor (their contents become zeros when next
    read). Returns the bytes dropped."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = os.sysconf("SC_PAGE_SIZE")
    total = 0
    for t in tensors:
        if t.device.type != "cpu":
            raise ValueError(f"host_pages.drop: a {t.device} tensor has no host pages")
        start = -(-t.data_ptr() // page) * page
        end = (t.data_ptr() + t.numel() * t.element_size()) // page * page
        if end > start:
            if libc.madvise(start, end - start, MADV_DONTNEED) != 0:
                raise OSError(ctypes.get_errno(), f"madvise: {os.strerror(ctypes.get_errno())}")
            total += end - start
    return total
