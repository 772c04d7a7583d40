"""The checksum (components/engine/weights/checksum.py) is the three weighted word sums its docstring names,
and its Triton kernel (kernels/checksum.py, what a GPU runs) gives the torch form's value bit for
bit: for every word type, sizes around a row and a block, several blocks, unaligned views, many
tensors at once. The kernel that copies and sums in one pass (a weight pull's same-node copies)
copies every word, touches nothing else, and gives the same value. On the CPU the kernels run
under Triton's interpreter in a subprocess (as in test_triton_kernels.py); on a GPU compiled, and
over more than 2**31 bytes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from components.engine.weights.checksum import (
    _CHUNK_WORDS,
    _MIX_COL,
    _MIX_ROW,
    _checksum_torch,
    _words,
    checksum,
    checksums,
)

ROOT = Path(__file__).resolve().parents[1]
SMALL_BLOCK_ROWS = 16  # many blocks from small tensors (the interpreter is slow)


def weighted_sums(t: torch.Tensor) -> int:
    """The checksum as the docstring defines it: S + C * _MIX_COL + R * _MIX_ROW mod 2**64 over the
    words, sign-extended (int32, int16) or zero-extended (bytes) to int64."""
    w = _words(t).numpy()
    s = c = r = 0
    for start in range(0, w.size, 1 << 22):
        x = w[start : start + (1 << 22)].astype(np.int64)
        i = np.arange(start, start + x.size, dtype=np.int64)
        s += int(x.sum(dtype=np.int64))
        c += int((x * (i % 251 + 1)).sum(dtype=np.int64))
        r += int((x * ((i // 251) % 257 + 1)).sum(dtype=np.int64))
    v = (s + c * _MIX_COL + r * _MIX_ROW) % 2**64
    return v - 2**64 if v >= 2**63 else v


def cases(block_rows: int) -> dict[str, torch.Tensor]:
    """CPU tensors around the edges of a row (251 words) and of a block of `block_rows` rows."""
    g = torch.Generator().manual_seed(0)
    b = block_rows * 251
    ints = torch.randint(-(2**31), 2**31 - 1, (3 * b + 1000,), dtype=torch.int32, generator=g)
    bf = torch.randn(2 * b + 7, generator=g).to(torch.bfloat16)
    raw = torch.randint(0, 256, (b + 13,), dtype=torch.uint8, generator=g)
    return {
        "empty": torch.empty(0),
        "0-dim": torch.tensor(3.0),
        "one byte": torch.tensor([200], dtype=torch.uint8),
        "one word": ints[:1],
        "row - 1": ints[:250],
        "row": ints[:251],
        "row + 1": ints[:252],
        "block - 1": ints[: b - 1],
        "block": ints[:b],
        "block + 1": ints[: b + 1],
        "blocks and a partial row": ints,
        "largest words": torch.full((b + 5,), 2**31 - 1, dtype=torch.int32),
        "smallest words": torch.full((b + 5,), -(2**31), dtype=torch.int32),
        "fp32": torch.randn(b // 2 + 3, generator=g),
        "int16 words": bf,
        "int16 words at an odd offset": bf[1:-1],
        "int32 words at an unaligned offset (copied)": bf[1:],
        "bytes": raw,
        "bytes at an odd offset": raw[3:-1],
        "int16 words at an odd byte offset (copied)": raw[3:],
    }


def check_kernel(device: str, block_rows: int) -> None:
    """Every case alone and all of them in one call (three word types, empty ones between)."""
    from components.engine.weights.checksum import _kernel_checksums

    ts = {k: v.to(device) for k, v in cases(block_rows).items()}
    want = {k: int(_checksum_torch(v)) for k, v in ts.items()}
    got = dict(zip(ts, _kernel_checksums(list(ts.values()), block_rows)()))
    assert got == want, [k for k in ts if got[k] != want[k]]
    for k, v in ts.items():
        assert _kernel_checksums([v], block_rows)() == [want[k]], k


def check_copy_kernel(device: str, block_rows: int) -> None:
    """Every case of 32-bit words copied in one call, each from and to 16-byte aligned offsets of
    two buffers: copies equal to their sources, the words between them untouched, and each sum
    the checksum of its words."""
    from components.engine.weights.checksum import _copy_kernel_checksums

    words = [w for w in (_words(v) for v in cases(block_rows).values()) if w.dtype == torch.int32]
    size = sum((w.numel() + 3) // 4 * 4 + 8 for w in words) + 8
    src = torch.zeros(size, dtype=torch.int32, device=device)
    dst = torch.full((size,), -7, dtype=torch.int32, device=device)
    pairs, s_at, d_at = [], 4, 8
    for w in words:
        s = src[s_at : s_at + w.numel()]
        s.copy_(w)
        pairs.append((dst[d_at : d_at + w.numel()], s))
        s_at += (w.numel() + 3) // 4 * 4 + 4
        d_at += (w.numel() + 3) // 4 * 4 + 8
    got = _copy_kernel_checksums(pairs, block_rows)()
    assert got == [int(_checksum_torch(w)) for w in words]
    untouched = torch.ones(size, dtype=torch.bool, device=device)
    for d, s in pairs:
        assert torch.equal(d, s)
        untouched[d.storage_offset() : d.storage_offset() + d.numel()] = False
    assert bool((dst[untouched] == -7).all())


def test_copy_table_covers_every_word_of_every_pair_once():
    """The copying kernel's table (built on the host): each pair's words in whole blocks from its
    own offsets, the row weight each block starts at, one launch per pair of storages with that
    pair's blocks consecutive, and empty pairs left out."""
    from components.engine.kernels.checksum import copy_table

    cols, row_mod, block_rows = 251, 257, 2
    block = cols * block_rows
    a, b, c, d = (torch.zeros(20 * block, dtype=torch.int32) for _ in range(4))
    pairs = [(b[4:9], a[8:13]), (d[:0], c[:0]), (b[100 : 100 + 3 * block + 7], a[40 : 40 + 3 * block + 7])]
    pairs.append((d[16 : 16 + block], c[:block]))  # another pair of storages: its own launch
    launches, table = copy_table(pairs, cols, row_mod, block_rows)
    want = []
    for i, (dst, src) in enumerate(pairs):
        for k in range(0, dst.numel(), block):
            phase = k // cols % row_mod
            want.append([src.storage_offset() + k, dst.storage_offset() + k, min(block, dst.numel() - k), phase, i])
    assert table.tolist() == want
    assert launches == [(0, 1 + 4), (3, 1)]


def _interpreted() -> None:
    """Run in the subprocess: the kernel interpreted on CPU tensors, small blocks and the real size."""
    from harness.triton_interpreter import enable

    enable()
    check_kernel("cpu", SMALL_BLOCK_ROWS)
    check_copy_kernel("cpu", SMALL_BLOCK_ROWS)
    from components.engine.kernels.checksum import BLOCK_ROWS
    from components.engine.weights.checksum import _kernel_checksums

    x = torch.randint(-(2**31), 2**31 - 1, (2 * BLOCK_ROWS * 251 + 300,), dtype=torch.int32)
    assert _kernel_checksums([x])() == [int(_checksum_torch(x))]


def test_checksum_is_the_weighted_word_sums():
    """The torch form (chunks, partial last row) computes S + C * _MIX_COL + R * _MIX_ROW: here
    also across checksum chunks, and with C and R past 2**63 (wrapped)."""
    ts = cases(SMALL_BLOCK_ROWS)
    ts["chunks"] = torch.randint(-(2**31), 2**31 - 1, (2 * _CHUNK_WORDS + 1000,), dtype=torch.int32)
    n = 40_000_000  # C and R near n * 2**31 * 127 > 2**63
    ts["wrapping"] = torch.full((n,), 2**31 - 1, dtype=torch.int32)
    for k, t in ts.items():
        assert checksum(t) == weighted_sums(t), k


def test_checksum_kernel_under_the_interpreter_on_cpu():
    code = "from tests.test_checksum import _interpreted; _interpreted()"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]


@pytest.mark.gpu
@pytest.mark.parametrize("block_rows", [SMALL_BLOCK_ROWS, None], ids=["small blocks", "real blocks"])
def test_checksum_kernel_on_cuda(block_rows):
    """Compiled, against the torch form on the GPU and against the CPU through the public calls."""
    from components.engine.kernels.checksum import BLOCK_ROWS

    check_kernel("cuda", block_rows or BLOCK_ROWS)
    check_copy_kernel("cuda", block_rows or BLOCK_ROWS)
    ts = cases(block_rows or BLOCK_ROWS)
    assert checksums([t.cuda() for t in ts.values()]) == checksums(ts.values())


@pytest.mark.gpu
def test_copy_checksums_on_cuda():
    """copy_checksums_later through its public rules: a bf16 weight and an fp32 one copied and
    summed as checksums() sums them; a pair it cannot take (not 16-byte aligned, or on the CPU)
    is refused with the reason, and fused_copy_ok says so beforehand."""
    from components.engine.weights.checksum import copy_checksums_later, fused_copy_ok

    src = [torch.randn(4096, 3000, device="cuda").to(torch.bfloat16), torch.randn(1001, device="cuda")]
    dst = [torch.empty_like(t) for t in src]
    pairs = [(d, s) for d, s in zip(dst, src)]
    assert all(fused_copy_ok(d, s) for d, s in pairs)
    assert copy_checksums_later(pairs)() == checksums(src)
    assert all(torch.equal(d, s) for d, s in pairs)
    odd = (dst[1][1:], src[1][:-1])  # 4 bytes into their storages
    assert not fused_copy_ok(*odd) and not fused_copy_ok(dst[1].cpu(), src[1].cpu())
    with pytest.raises(ValueError, match="cannot copy and checksum 4000 bytes"):
        copy_checksums_later([odd])


@pytest.mark.gpu
def test_checksum_kernel_over_2_gib_on_cuda():
    """3 GiB of large words (C and R wrap; byte offsets past 2**31) and bf16 views of it at an odd
    offset: 16-bit words read in place, and 32-bit words realigned by a copy."""
    n = 3 << 28
    x = torch.randint(2**30, 2**31 - 1, (n,), dtype=torch.int32, device="cuda")
    h = x.view(torch.bfloat16)
    for t in (x, h[1:], h[1:-1]):
        assert checksum(t) == int(_checksum_torch(t)), (t.dtype, t.numel())
    before = checksum(x)
    x[n // 2] ^= 1
    assert checksum(x) == int(_checksum_torch(x)) != before
