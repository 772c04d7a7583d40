"""The checksum's device kernel (checksum.py): the three sums it mixes, per block of words, in one
read of the words.

checksum.py lays a tensor's n words out as rows of 251 and sums, mod 2**64 (wrapping int64),
S = sum w_i, C = sum w_i * (i % 251 + 1) and R = sum w_i * ((i // 251) % 257 + 1). Wrapping sums
are order-free, so any split of the words into blocks gives the same totals.

Why it is built this way:

* One program sums one block of BLOCK_ROWS whole rows; a table built on the host (numpy: no
  torch kernel to load, see copy_table) and copied to the device says where each block's
  words are (address, count, the row weight its first row starts at, which tensor), so
  every block of every tensor of one word type is one launch: checksums() of a model's thousands
  of tensors costs a few launches, not thousands.
* A block is read as tiles of [ROWS, 256] words with a row stride of 251 (lanes 251..255 masked):
  a word's column weight is its lane's and its row weight its tile row's, so no word needs a
  division, and each word is read once (the torch form reads it twice, ten kernels per chunk).
* A tile is summed over its rows into per-lane int64 accumulators, reduced across lanes once per
  program: the tile's rows of a lane sit in one thread, so the loop body is a load, a 64-bit add
  and a widening multiply-add per word (row weights are alike in all threads: uniform registers), and
  few registers, so many loads are in flight. A block's sums stay far below 2**63: none wraps here.

The copy that sums (`copy_block_sums`, a weight pull's same-node copies): one pass that stores each
word it reads and sums it, so a pull verifies what it copied without reading it again (a copy then a
checksum move 8.6 GB through memory three times, read, write and read: 4.4 + 3.3 ms on an H200;
copied and summed in 5.9 ms, bench.weight_pull). Its tiles are flat and contiguous,
TILE_ROWS whole rows (a row is 251 words, not a multiple of 4: the stride-251 tiles above store a
row with scalar, unaligned writes, 0.7 TB/s measured), padded to a power of two with the padding
lanes masked off by a constant, so loads and stores are 16-byte vectors where the addresses are
16-byte aligned (the caller checks they are, and says so with hints). A lane's column is then fixed
for the whole block (C is its lane sum times the column weight, as above) and its row is the tile's
first row plus its row in the tile.
"""

from __future__ import annotations

from contextlib import nullcontext

import numpy as np
import torch
import triton
import triton.language as tl

BLOCK_ROWS = 512  # rows of 251 words per program: ~0.5 MB of int32 words, thousands of programs a GB
_ROWS = 8  # rows per tile
_LANES = 256  # a row's 251 words, padded to a power of two
_WARPS = 4
_WORD_TYPES = {torch.int32: tl.int32, torch.int16: tl.int16, torch.uint8: tl.uint8}
COPY_TILE_ROWS = 8  # rows of 251 words per tile of the copy that sums: 2008 of 2048 lanes used
_COPY_WARPS = 8


@triton.jit
def _row_weights(phase, rows, ROW_MOD: tl.constexpr):
    """Weights of the rows `phase` + `rows` (phase < ROW_MOD, rows < ROW_MOD: one wrap at most)."""
    rw = phase + rows
    return tl.where(rw >= ROW_MOD, rw - ROW_MOD, rw) + 1


@triton.jit
def _block_sums(
    table,
    out,
    WORD: tl.constexpr,
    COLS: tl.constexpr,
    ROW_MOD: tl.constexpr,
    ROWS: tl.constexpr,
    LANES: tl.constexpr,
):
    pid = tl.program_id(0)
    entry = table + pid * 4
    words = tl.load(entry).to(tl.pointer_type(WORD))
    n = tl.load(entry + 1).to(tl.int32)
    phase = tl.load(entry + 2).to(tl.int32)  # (global row of the block's first word) % ROW_MOD
    tl.static_assert(ROWS <= ROW_MOD)  # a tile's row weights wrap at most once
    r = tl.arange(0, ROWS)
    c = tl.arange(0, LANES)
    offs = r[:, None] * COLS + c[None, :]
    in_row = c[None, :] < COLS
    col_acc = tl.zeros([LANES], tl.int64)
    row_acc = tl.zeros([LANES], tl.int64)
    for row in range(0, tl.cdiv(n, COLS), ROWS):
        start = row * COLS
        w = tl.load(words + start + offs, mask=in_row & (offs < n - start), other=0).to(tl.int64)
        rw = _row_weights(phase, r, ROW_MOD)
        # Over the tile's rows, which one thread holds per lane: no data crosses threads here.
        col_acc += tl.sum(w, axis=0)
        row_acc += tl.sum(w * rw[:, None].to(tl.int64), axis=0)
        phase = (phase + ROWS) % ROW_MOD
    tl.store(out + pid * 3, tl.sum(col_acc))
    tl.store(out + pid * 3 + 1, tl.sum(col_acc * (c + 1).to(tl.int64)))
    tl.store(out + pid * 3 + 2, tl.sum(row_acc))


@triton.jit
def _copy_tile(s, d, j, mask, phase, lane_row, sum_acc, row_acc, ROW_MOD: tl.constexpr):
    """Copy one tile's words and add them to the lanes' sums; a lane's row is the tile's first
    (`phase`) plus its row in the tile."""
    w = tl.load(s + j, mask=mask, other=0)
    tl.store(d + j, w, mask=mask)
    rw = _row_weights(phase, lane_row, ROW_MOD)
    w = w.to(tl.int64)
    return sum_acc + w, row_acc + w * rw.to(tl.int64)


@triton.jit
def _copy_block_sums(
    src,
    dst,
    table,
    out,
    COLS: tl.constexpr,
    ROW_MOD: tl.constexpr,
    TILE_ROWS: tl.constexpr,
    LANES: tl.constexpr,
):
    pid = tl.program_id(0)
    entry = table + pid * 5
    # Word offsets from `src` and `dst`, multiples of 4 (16 bytes): the host checked.
    s = src + tl.multiple_of(tl.load(entry), 4)
    d = dst + tl.multiple_of(tl.load(entry + 1), 4)
    n = tl.load(entry + 2).to(tl.int32)
    phase = tl.load(entry + 3).to(tl.int32)  # (global row of the block's first word) % ROW_MOD
    tl.static_assert(TILE_ROWS * COLS <= LANES)
    tl.static_assert(TILE_ROWS <= ROW_MOD)
    TILE: tl.constexpr = TILE_ROWS * COLS
    j = tl.arange(0, LANES)
    used = j < TILE  # constant per group of 4 lanes (TILE is a multiple of 4): vectors stay whole
    lane_row = j // COLS
    sum_acc = tl.zeros([LANES], tl.int64)  # per lane: its words' sum (its column is fixed)
    row_acc = tl.zeros([LANES], tl.int64)
    full = n // TILE * TILE
    for start in range(0, full, TILE):
        start = tl.multiple_of(start, 4)
        sum_acc, row_acc = _copy_tile(s + start, d + start, j, used, phase, lane_row, sum_acc, row_acc, ROW_MOD)
        phase = (phase + TILE_ROWS) % ROW_MOD
    if full < n:  # the block's last, partial tile
        m = used & (j < n - full)
        sum_acc, row_acc = _copy_tile(s + full, d + full, j, m, phase, lane_row, sum_acc, row_acc, ROW_MOD)
    col_w = (j % COLS + 1).to(tl.int64)
    tl.store(out + pid * 3, tl.sum(sum_acc))
    tl.store(out + pid * 3 + 1, tl.sum(sum_acc * col_w))
    tl.store(out + pid * 3 + 2, tl.sum(row_acc))


def _block_numbers(blocks: np.ndarray) -> np.ndarray:
    """For tensors of blocks[i] blocks each, every block in order: its number within its tensor."""
    return np.arange(blocks.sum()) - np.repeat(np.cumsum(blocks) - blocks, blocks)


def _to_device(table: np.ndarray, dev: torch.device) -> torch.Tensor:
    host = torch.from_numpy(table)
    if dev.type == "cuda":
        host = host.pin_memory()  # the copy is then asynchronous, like the kernels behind it
    return host.to(dev, non_blocking=True)


def _table(words: list[torch.Tensor], idx: list[int], cols: int, row_mod: int, block_rows: int) -> np.ndarray:
    """[blocks, 4] int64: (address, words, row phase, tensor index) of each block of the words[i]
    for i in idx, a tensor's blocks in order."""
    block = block_rows * cols
    n = np.array([words[i].numel() for i in idx], dtype=np.int64)
    addr = np.array([words[i].data_ptr() for i in idx], dtype=np.int64)
    size = np.array([words[i].element_size() for i in idx], dtype=np.int64)
    blocks = (n + block - 1) // block
    k = _block_numbers(blocks) * block  # each block's first word
    return np.stack(
        [
            np.repeat(addr, blocks) + k * np.repeat(size, blocks),
            np.minimum(np.repeat(n, blocks) - k, block),
            k // cols % row_mod,
            np.repeat(np.asarray(idx, dtype=np.int64), blocks),
        ],
        1,
    )


def block_sums(
    words: list[torch.Tensor], cols: int, row_mod: int, block_rows: int = BLOCK_ROWS
) -> tuple[torch.Tensor, np.ndarray]:
    """(S, C, R) of every block of the 1-D word tensors `words` (int32, int16 or uint8, one
    device), launched on the current stream without a sync: ([blocks, 3] int64 on the device,
    [blocks] index into `words` of each block's tensor, on the host). The word tensors may be
    freed once this returns: the allocator reuses their memory in stream order, after the kernels."""
    dev = words[0].device
    groups: dict[torch.dtype, list[int]] = {}
    for i, w in enumerate(words):
        if w.numel():
            groups.setdefault(w.dtype, []).append(i)
    if not groups:
        return torch.empty(0, 3, dtype=torch.int64, device=dev), np.empty(0, dtype=np.int64)
    tables = [(dt, _table(words, idx, cols, row_mod, block_rows)) for dt, idx in groups.items()]
    host = np.concatenate([t for _, t in tables])
    table = _to_device(host, dev)
    out = torch.empty(host.shape[0], 3, dtype=torch.int64, device=dev)
    start = 0
    with torch.cuda.device(dev) if dev.type == "cuda" else nullcontext():  # launch on the words' GPU
        for dt, t in tables:
            end = start + t.shape[0]
            _block_sums[(t.shape[0],)](
                table[start:end],
                out[start:end],
                WORD=_WORD_TYPES[dt],
                COLS=cols,
                ROW_MOD=row_mod,
                ROWS=_ROWS,
                LANES=_LANES,
                num_warps=_WARPS,
            )
            start = end
    return out, host[:, 3]


def copy_table(
    pairs: list[tuple[torch.Tensor, torch.Tensor]], cols: int, row_mod: int, block_rows: int = BLOCK_ROWS
) -> tuple[list[tuple[int, int]], np.ndarray]:
    """copy_block_sums's work on the host: ([(a pair in each pair of storages, its blocks)], the
    [blocks, 5] int64 table: per block its source and destination offsets in words, its words,
    the row weight its first row starts at, and its pair), the blocks of one pair of storages
    consecutive, in the list's order. Per pair only its offsets are read from torch (no views
    made): a pull hands over hundreds of tensors, and its copies cannot start before the table is
    on the device.

    The rows are expanded into blocks here, not by torch ops on the device: a torch kernel's first
    launch loads its module, and the driver keeps host memory for it that a snapshot's image
    carries. With the expansion (and checksum._combine) as torch ops on an H200, the checksum
    warm-up grew a fresh process by 182 MB; in numpy, by nothing measurable."""
    block = block_rows * cols
    # storages -> per pair: (source and destination offsets in words, words, pair, blocks)
    groups: dict[tuple[int, int], list[tuple[int, int, int, int, int]]] = {}
    for i, (d, s) in enumerate(pairs):
        if n := d.nbytes // 4:
            key = (s.untyped_storage().data_ptr(), d.untyped_storage().data_ptr())
            groups.setdefault(key, []).append(
                ((s.data_ptr() - key[0]) // 4, (d.data_ptr() - key[1]) // 4, n, i, (n + block - 1) // block)
            )
    launches = [(rows[0][3], sum(r[4] for r in rows)) for rows in groups.values()]
    rows = np.array([r for rs in groups.values() for r in rs], dtype=np.int64).reshape(-1, 5)
    host = np.repeat(rows, rows[:, 4], axis=0)  # a pair's row for each of its blocks, then made the block's
    k = _block_numbers(rows[:, 4]) * block  # each block's first word
    host[:, 0] += k
    host[:, 1] += k
    np.minimum(host[:, 2] - k, block, out=host[:, 2])
    host[:, 4] = host[:, 3]
    host[:, 3] = k // cols % row_mod
    return launches, host


def copy_block_sums(
    pairs: list[tuple[torch.Tensor, torch.Tensor]], cols: int, row_mod: int, block_rows: int = BLOCK_ROWS
) -> tuple[torch.Tensor, np.ndarray]:
    """Copy each (destination, source) pair's bytes, a whole number of 32-bit words, and sum them
    as words as block_sums does (same return), in one launch per pair of storages, on the current
    stream, no sync. Every tensor must be contiguous, on one device, and start a multiple of 16
    bytes into its storage (checksum.fused_copy_ok): the kernel is told its offsets are whole
    16-byte vectors."""
    dev = pairs[0][0].device
    launches, host = copy_table(pairs, cols, row_mod, block_rows)
    if not launches:
        return torch.empty(0, 3, dtype=torch.int64, device=dev), np.empty(0, dtype=np.int64)
    table = _to_device(host, dev)
    out = torch.empty(host.shape[0], 3, dtype=torch.int64, device=dev)
    start = 0
    with torch.cuda.device(dev) if dev.type == "cuda" else nullcontext():
        for pair, n_blocks in launches:
            d, s = pairs[pair]
            end = start + n_blocks
            _copy_block_sums[(n_blocks,)](
                _storage_words(s),
                _storage_words(d),
                table[start:end],
                out[start:end],
                COLS=cols,
                ROW_MOD=row_mod,
                TILE_ROWS=COPY_TILE_ROWS,
                LANES=triton.next_power_of_2(COPY_TILE_ROWS * cols),
                num_warps=_COPY_WARPS,
            )
            start = end
    return out, host[:, 4]


def _storage_words(t: torch.Tensor) -> torch.Tensor:
    """The int32 words of `t`'s whole storage, from its start (the base its offsets count from)."""
    st = t.untyped_storage()
    return torch.empty(0, dtype=torch.int32, device=t.device).set_(st, 0, (st.nbytes() // 4,))
