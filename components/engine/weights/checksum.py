"""Order-sensitive checksum of a contiguous tensor's bytes, computed on the tensor's device.

Why it is built this way: a weight pull verifies each tensor it received against a checksum its
source computed when it described the tensor (weights/store.py). So the checksum runs on the
tensor's device (no host round trip of the weights), checksums() of many tensors costs one device
sync, and the result depends only on the bytes (not on the dtype, the view or the device), so a
CPU source and a CUDA puller agree bit for bit. What kinds of damage it catches: _checksum_torch.

On a GPU the checksum must keep up with the transfer it verifies: a Triton kernel
(kernels/checksum.py) reads each word once and sums all tensors of one word type in one launch. The
CPU keeps the torch form; both compute the same sums (see _checksum_torch), so the same value.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np
import torch

_CHUNK_WORDS = 251 * (1 << 14)  # checksum chunk (a whole number of 251-word rows): bounds temporaries
_COLS = 251
_ROW_MOD = 257
# Odd multipliers mixing the three partial sums (int64 arithmetic wraps identically everywhere).
_MIX_COL = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX_ROW = 0xC2B2AE3D27D4EB4F - (1 << 64)


def _words(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as 1-D words. The word size depends only on the byte count (not on the
    dtype or alignment), so equal bytes give an equal checksum whatever view they came from."""
    b = t.reshape(-1).view(torch.uint8)
    n = b.numel()
    wdt = torch.int32 if n % 4 == 0 else torch.int16 if n % 2 == 0 else torch.uint8
    if wdt is torch.uint8:
        return b
    try:
        return b.view(wdt)
    except RuntimeError:  # storage offset not aligned to the word size: realign by copying
        return b.clone().view(wdt)


def _checksum_torch(t: torch.Tensor) -> torch.Tensor:
    """0-dim int64 checksum on the tensor's device (no sync), in torch ops: the CPU's form.

    Words are laid out as rows of 251: the column sums weighted by (column + 1) catch moves by any
    distance that is not a multiple of 251 words, and the row sums weighted by (row % 257 + 1)
    catch those that are, so swapped blocks change the result unless they are 64507-word aligned
    and sized. Plus the plain sum. Integer arithmetic wraps mod 2**64 in any order, so CPU and CUDA
    agree bit for bit.

    Per word w_i (int32 and int16 words sign-extended, bytes zero-extended, as torch's int64 sums
    do), the value is S + C * _MIX_COL + R * _MIX_ROW with S = sum w_i, C = sum w_i * (i % 251 + 1)
    and R = sum w_i * ((i // 251) % 257 + 1), all mod 2**64: chunks start on a row, and a partial
    row is the last, so i % 251 is a word's column and i // 251 its row. The kernel sums the same."""
    dev = t.device
    w = _words(t)
    n = w.numel()
    cols = torch.zeros(_COLS, dtype=torch.int64, device=dev)
    rowacc = torch.zeros((), dtype=torch.int64, device=dev)
    for start in range(0, n, _CHUNK_WORDS):
        c = w[start : start + _CHUNK_WORDS]
        full = c.numel() // _COLS * _COLS
        row0 = start // _COLS
        if full:
            x = c[:full].view(-1, _COLS)
            cols += x.sum(0, dtype=torch.int64)
            rows = x.sum(1, dtype=torch.int64)
            rw = torch.arange(row0, row0 + rows.numel(), device=dev, dtype=torch.int64) % _ROW_MOD + 1
            rowacc += (rows * rw).sum()
        if full < c.numel():  # only in the last chunk: a partial row
            tail = c[full:].to(torch.int64)
            cols[: tail.numel()] += tail
            rowacc += tail.sum() * ((row0 + full // _COLS) % _ROW_MOD + 1)
    colw = torch.arange(1, _COLS + 1, dtype=torch.int64, device=dev)
    return cols.sum() + (cols * colw).sum() * _MIX_COL + rowacc * _MIX_ROW


def _kernel_checksums(ts: list[torch.Tensor], block_rows: int | None = None) -> Callable[[], list[int]]:
    """checksum() of contiguous tensors on one device by the Triton kernel, queued (no sync): the
    call returned waits for them."""
    from components.engine.kernels import checksum as ck  # Triton is imported only where a GPU checksums

    words = [_words(t) for t in ts]
    sums, owner = ck.block_sums(words, _COLS, _ROW_MOD, block_rows or ck.BLOCK_ROWS)
    return lambda: _combine(sums, owner, len(ts))


def _combine(sums: torch.Tensor, owner: np.ndarray, n: int) -> list[int]:
    """n checksums from the kernels' per-block (column sum, column-weighted, row-weighted) sums,
    block i belonging to tensor owner[i] (a tensor's blocks consecutive). Waits for the kernels:
    the sums are mixed on the host, as torch ops on the device would load modules a snapshot's
    image then carries (checksum_kernel.copy_block_sums)."""
    total = np.zeros((n, 3), dtype=np.int64)
    if owner.size:  # each tensor's blocks are consecutive: one run each, summed at once
        starts = np.flatnonzero(np.r_[True, owner[1:] != owner[:-1]])
        total[owner[starts]] = np.add.reduceat(sums.cpu().numpy(), starts)
    # numpy's int64 arithmetic on arrays wraps mod 2**64, as torch's does on the device.
    return (total * np.array([1, _MIX_COL, _MIX_ROW], dtype=np.int64)).sum(1).tolist()


def checksum(t: torch.Tensor) -> int:
    """Order-sensitive checksum of a contiguous tensor's bytes, computed on its device."""
    return checksums([t])[0]


def checksums_later(ts: Iterable[torch.Tensor]) -> Callable[[], list[int]]:
    """checksum() of each tensor, started now on GPUs (queued on the current stream, no sync): the
    call returned waits for them (one sync per device) and computes CPU tensors' checksums."""
    ts = list(ts)
    for t in ts:
        if not t.is_contiguous():
            raise ValueError("checksum needs a contiguous tensor")
    by_dev: dict[torch.device, list[int]] = {}
    for i, t in enumerate(ts):
        by_dev.setdefault(t.device, []).append(i)
    on_gpu = {d: _kernel_checksums([ts[i] for i in idx]) for d, idx in by_dev.items() if d.type == "cuda"}

    def wait() -> list[int]:
        out = [0] * len(ts)
        for d, idx in by_dev.items():
            vals = on_gpu[d]() if d in on_gpu else torch.stack([_checksum_torch(ts[i]) for i in idx]).tolist()
            for i, v in zip(idx, vals):
                out[i] = int(v)
        return out

    return wait


def checksums(ts: Iterable[torch.Tensor]) -> list[int]:
    """checksum() of many tensors with one device sync instead of one per tensor."""
    return checksums_later(ts)()


def fused_copy_ok(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """copy_checksums_later can take this pair: contiguous, on one GPU, the same whole number of
    32-bit words, each starting a multiple of 16 bytes into its storage."""
    return (
        dst.is_cuda
        and src.device == dst.device
        and dst.is_contiguous()
        and src.is_contiguous()
        and dst.nbytes == src.nbytes
        and dst.nbytes % 4 == 0
        and all((t.data_ptr() - t.untyped_storage().data_ptr()) % 16 == 0 for t in (dst, src))
    )


def copy_checksums_later(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Callable[[], list[int]]:
    """Copy each (destination, source) pair's bytes (fused_copy_ok pairs) and checksum them in the
    same pass, queued on the current stream: the call returned waits (one sync) and gives each
    pair's checksum() of the bytes copied. Reading the bytes once instead of twice is what lets
    a weight pull verify at close to copy speed (kernels/checksum.py)."""
    for d, s in pairs:
        if not fused_copy_ok(d, s):
            raise ValueError(f"cannot copy and checksum {s.nbytes} bytes at {s.data_ptr():#x} in one pass")
    if not pairs:
        return lambda: []
    return _copy_kernel_checksums(pairs)


def _copy_kernel_checksums(
    pairs: list[tuple[torch.Tensor, torch.Tensor]], block_rows: int | None = None
) -> Callable[[], list[int]]:
    """checksum() of the bytes each (destination, source) pair copies, as 32-bit words, by the
    copying kernel, queued (no sync): the call returned waits for them."""
    from components.engine.kernels import checksum as ck

    sums, owner = ck.copy_block_sums(pairs, _COLS, _ROW_MOD, block_rows or ck.BLOCK_ROWS)
    return lambda: _combine(sums, owner, len(pairs))


def warm_kernels(device: torch.device) -> None:
    """Compile (or find in Triton's cache) and load the checksum kernels on `device`: each word
    type's and the copy that sums. A process's first launch of a Triton kernel compiles it or
    loads it; done when the engine is built, that is not a joiner's first pull, and a snapshot's
    image holds the loaded kernels."""
    # The word type follows the byte count (_words): 32, 6 and 7 bytes are 32-bit, 16-bit and byte words.
    ts = [torch.zeros(n, dtype=torch.uint8, device=device) for n in (32, 6, 7)]
    checksums(ts)
    copy_checksums_later([(torch.empty_like(ts[0]), ts[0])])()
