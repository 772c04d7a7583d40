"""The experts of one MoE layer on CUDA: SwiGLU of each row through its slot's expert, as two
Triton kernels over rows grouped by slot, which a third, small one groups.

A decode step sends each expert a few rows, so the step is bound by reading expert weights, and
torch._grouped_mm's CUTLASS kernel streams them at about two thirds of HBM bandwidth at these
sizes (H200, Mixtral shapes). Here one program owns one block of BLOCK_M rows of one slot's group
and one tile of output columns: a slot no row goes to costs nothing, and a touched one is read at
close to bandwidth. A prompt chunk sends each expert hundreds of rows, in blocks that are
neighbours in launch order (the block varies fastest), so they run together and read the slot's
weight tile once from HBM, then from L2: the chunk runs at tensor-core rate, not re-reading every
expert's weights per BLOCK_M rows. Thousands of rows (a step of 8192 prompt tokens: 16k rows of
8 KB, 28 KB once through Wg and Wu) outgrow L2, so the blocks go in groups (`Tiles.group`) that
take every column tile before the next group starts: the programs running together share a few
blocks' rows as well as a few column tiles' weights. At 16,448 rows on an H100 that took the
layer from 14.0 to 11.3 ms (bench/results/experts_h100_group.json), with the same bits. The grid
is fixed, so a graph captures it, and each program loops over the (block, column tile) pairs the
grouping made (program p takes pairs p, p + P, ...; the block count is read on the device). Its size
is not the most blocks M rows can have: M is the EP window's
capacity, which the token budget sets, and a decode step fills a few blocks of it, so a grid of
that size launched thousands of idle programs per layer each step. The first kernel
gathers each group's rows and writes silu(x Wg^T) * (x Wu^T) in group order; the second applies
Wd and scatters the results back to the rows' own places, leaving rows of no slot zero.

The grouping (`group_rows`) is SparseMoE's torch form on the CPU (the slot validity, the count of
rows computed, the key, moe.group_by_slot's counting sort: some fifteen small kernels, each a
launch and a gap in a decode graph) in two launches of one program per chunk of rows: each
chunk's histogram of keys, then each chunk's rows placed behind the rows of smaller keys and of
the same key in earlier chunks (a one-hot prefix sum within the chunk), so the order within a
group is the rows' own and nothing is atomic. One program scanning the rows once per key took
67 us a layer at 32 slots (DeepSeek-shaped, H200), growing with the slots and the rows. It also
counts each group's blocks, for the block table.

A row's result depends on that row alone (the reduction over K runs in order, with no split
across programs), so an expert's output does not change with the batch it came in. Nor does it
change with the tiling: each output element is one thread's fp32 sum over K in the same order
whatever the rows, columns and K step of a tile (tests/test_triton_kernels.py holds every
tiling here to the same bits), so steps with prompt rows run a tiling made for hundreds of rows a
slot (`PROMPT_TILES`, under `expert_tiles`) and decode steps one made for a few (`TILES`).
Nothing syncs with the host: the row count can be a fixed capacity, and a graph captures it.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import NamedTuple

import torch
import triton
import triton.language as tl


class Tiles(NamedTuple):
    """The expert kernels' tiling: rows a block (m), output columns (n) and the reduction step (k)
    a program takes, its warps and pipeline stages. One tiling serves every row count, so a row's
    bits depend on it and never on the batch; `bench.experts --tiles` compares tilings."""

    m: int
    n: int
    k: int
    warps: int = 4
    stages: int = 3
    # Blocks of rows whose tiles are taken column tile by column tile before the next blocks'
    # (the launch order): few keep the blocks' rows in L2 while every column tile reads them,
    # which a prompt step's thousands of rows need; a decode step's handful of blocks is one group.
    group: int = 1 << 16


# Measured on an H200 (8 slots, H 4096, I 14336, bf16): 64-row blocks keep a slot's weights read
# once up to 256 rows in all (0.71-0.77 ms, the bandwidth floor 0.70); 16-row blocks re-read them
# from 128 rows on (1.1 ms), and torch._grouped_mm takes 1.04-1.08 ms throughout. A prompt's
# 4096 rows take 4.9 ms against grouped_mm's 2.7 and a compute floor near 1.9: a larger tiling
# would serve prompts better if it keeps decode at the floor, which bench.experts --tiles shows.
TILES = Tiles(64, 64, 128)
# Steps with prompt rows: at 4160 rows (2048 prompt tokens and 32 decodes, top-2) on an H100, 3.4
# ms against TILES' 5.8 and torch._grouped_mm's 3.0, the floor 1.85 (bench.experts); at 64 rows
# 1.05 ms against 0.98, so decode steps keep TILES. Groups of 8 blocks: 3.03 / 6.07 / 11.3 ms at
# 4160 / 8256 / 16448 rows against 3.11 / 6.21 / 14.0 in one order (4: 3.32 / 5.86 / 11.6; 16:
# 3.16 / 6.19 / 11.4; H100).
PROMPT_TILES = Tiles(128, 128, 64, 8, 4, 8)

_chosen = threading.local()


@contextmanager
def expert_tiles(tiles: Tiles, rows: int = 0):
    """Inside: `swiglu_experts` runs `tiles`, its grid sized for `rows` rows computed (0: a
    decode step's few blocks a slot). A graph captures what it launched inside."""
    _chosen.tiles, _chosen.rows = tiles, rows
    try:
        yield
    finally:
        _chosen.tiles, _chosen.rows = TILES, 0


@triton.jit
def _expert_kernel(
    x_ptr,  # [M, K] rows: gathered through rows_ptr (GATED) or already in group order
    rows_ptr,  # [M] int32: the row at each group-order position
    ends_ptr,  # [S] int32: end of each slot's group in group order
    blocks_ptr,  # [S] int32: end of each slot's blocks in block order
    w_ptr,  # [S, N, K] weights (Wg, or Wd)
    v_ptr,  # [S, N, K] weights multiplied in by the gate (Wu); unused unless GATED
    out_ptr,  # [M, N]: in group order (GATED), or scattered back to the rows' places
    N,
    K,
    S,
    GATED: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_S: tl.constexpr,
    GROUP: tl.constexpr,
):
    offs_s = tl.arange(0, BLOCK_S)
    block_ends = tl.load(blocks_ptr + offs_s, mask=offs_s < S, other=2**31 - 1)
    total = tl.load(blocks_ptr + S - 1)  # the blocks this grouping has, of the grid's most
    tiles_n = tl.cdiv(N, BLOCK_N)
    # Tile t of (blocks x column tiles): GROUP blocks at a time, the block varying fastest, so
    # the programs running together read a few blocks' rows and a few column tiles' weights
    # (each from L2 after the first) rather than every block's rows for one column tile.
    for t in range(tl.program_id(0), total * tiles_n, tl.num_programs(0)):
        first = (t // (GROUP * tiles_n)) * GROUP
        size = tl.minimum(total - first, GROUP)
        b = first + (t - first * tiles_n) % size
        offs_n = ((t - first * tiles_n) // size) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        s = tl.sum((block_ends <= b).to(tl.int32), 0)  # the slot whose blocks hold block b
        slot_first = tl.load(blocks_ptr + s - 1, mask=s > 0, other=0)
        start = tl.load(ends_ptr + s - 1, mask=s > 0, other=0)
        end = tl.load(ends_ptr + s)
        m0 = start + (b - slot_first) * BLOCK_M
        w_tile = s.to(tl.int64) * N * K + offs_n[None, :].to(tl.int64) * K
        pos = m0 + tl.arange(0, BLOCK_M)
        m_ok = pos < end
        row = tl.load(rows_ptr + pos, mask=m_ok, other=0).to(tl.int64)
        src = row if GATED else pos.to(tl.int64)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_v = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < K
            a = tl.load(x_ptr + src[:, None] * K + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w_mask = k_ok[:, None] & n_ok[None, :]
            w = tl.load(w_ptr + w_tile + offs_k[:, None], mask=w_mask, other=0.0)
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
            if GATED:
                v = tl.load(v_ptr + w_tile + offs_k[:, None], mask=w_mask, other=0.0)
                acc_v = tl.dot(a, v, acc_v, input_precision=PRECISION)
        if GATED:
            acc = acc * tl.sigmoid(acc) * acc_v
            dst = pos.to(tl.int64)
        else:
            dst = row
        out = acc.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + dst[:, None] * N + offs_n[None, :], out, mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _slot_key(local_ptr, i, M, S):
    """The sort key of rows i: the slot, S for no slot, S + 1 past the rows."""
    slot = tl.load(local_ptr + i, mask=i < M, other=-1)
    return tl.where(i < M, tl.where((slot >= 0) & (slot < S), slot, S), S + 1).to(tl.int32)


@triton.jit
def _count_kernel(local_ptr, hist_ptr, M, S, BLOCK: tl.constexpr, KEYS: tl.constexpr):
    """hist[b, key]: the rows of chunk b (BLOCK rows) with each key."""
    b = tl.program_id(0)
    key = _slot_key(local_ptr, b * BLOCK + tl.arange(0, BLOCK), M, S)
    tl.store(hist_ptr + b * KEYS + tl.arange(0, KEYS), tl.histogram(key, KEYS))


@triton.jit
def _place_kernel(
    local_ptr,  # [M] the slot of each row; outside 0..S-1: no slot
    hist_ptr,  # [NB, KEYS] int32: _count_kernel's
    rows_ptr,  # [M] int32 out: the row at each group-order position
    ends_ptr,  # [S] int32 out: end of each slot's group
    blocks_ptr,  # [S] int32 out: end of each slot's blocks of BLOCK_M rows
    count_ptr,  # [1] int64, added to: rows with a slot (HAS_COUNT)
    M,
    S,
    NB,
    HAS_COUNT: tl.constexpr,
    BLOCK: tl.constexpr,
    KEYS: tl.constexpr,
    CHUNKS: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    b = tl.program_id(0)
    keys = tl.arange(0, KEYS)
    # Every key's total, and this chunk's start within it: the rows of that key in earlier chunks.
    total = tl.zeros((KEYS,), dtype=tl.int32)
    earlier = tl.zeros((KEYS,), dtype=tl.int32)
    for c0 in range(0, NB, CHUNKS):
        c = c0 + tl.arange(0, CHUNKS)
        h = tl.load(hist_ptr + c[:, None] * KEYS + keys[None, :], mask=(c < NB)[:, None], other=0)
        total += tl.sum(h, 0)
        earlier += tl.sum(tl.where((c < b)[:, None], h, 0), 0)
    key_start = tl.cumsum(total, 0) - total
    i = b * BLOCK + tl.arange(0, BLOCK)
    key = _slot_key(local_ptr, i, M, S)
    hit = (key[:, None] == keys[None, :]).to(tl.int32)  # [BLOCK, KEYS]
    before = tl.sum(tl.cumsum(hit, 0) * hit, 1) - 1  # earlier rows of the same key in the chunk
    pos = tl.sum(hit * (key_start + earlier)[None, :], 1) + before
    tl.store(rows_ptr + pos, i, mask=key <= S)
    if b == 0:
        real = keys < S
        tl.store(ends_ptr + keys, key_start + total, mask=real)
        tl.store(blocks_ptr + keys, tl.cumsum((total + BLOCK_M - 1) // BLOCK_M, 0), mask=real)
        if HAS_COUNT:
            tl.store(count_ptr, tl.load(count_ptr) + tl.sum(tl.where(real, total, 0), 0))


def group_rows(
    local: torch.Tensor, slots: int, count: torch.Tensor | None = None, block_m: int = TILES.m
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """moe.group_by_slot of local's keys (a slot in 0..slots-1, anything else: no slot, key
    `slots`): (rows [M] int32 in group order, ends [slots] int32, block ends [slots] int32: the
    running count of each group's blocks of `block_m` rows); `count` gains the number of rows with
    a slot. Two launches of one program per chunk of rows: each chunk's histogram of keys, then
    each chunk's rows placed behind the rows of smaller keys and the earlier chunks' of their own."""
    M = local.shape[0]
    rows = torch.empty(M, dtype=torch.int32, device=local.device)
    ends = torch.empty(slots, dtype=torch.int32, device=local.device)
    blocks = torch.empty(slots, dtype=torch.int32, device=local.device)
    if M == 0:
        return rows, ends.zero_(), blocks.zero_()
    keys = triton.next_power_of_2(slots + 2)
    block = min(max(8192 // keys, 64), 1024)  # rows a program places, as a [rows, keys] one-hot tile
    nb = triton.cdiv(M, block)
    hist = torch.empty(nb, keys, dtype=torch.int32, device=local.device)
    _count_kernel[(nb,)](local, hist, M, slots, BLOCK=block, KEYS=keys)
    _place_kernel[(nb,)](
        local, hist, rows, ends, blocks, count if count is not None else rows, M, slots, nb,
        HAS_COUNT=count is not None, BLOCK=block, KEYS=keys, CHUNKS=max(1, 4096 // keys), BLOCK_M=block_m,
    )  # fmt: skip
    return rows, ends, blocks


def swiglu_experts(
    x: torch.Tensor,
    local: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    count: torch.Tensor | None = None,
    tiles: Tiles | None = None,
    zero_unrouted: bool = True,
) -> torch.Tensor:
    """Row i through the expert in slot local[i] ([S, I, H] gate and up, [S, H, I] down weights);
    a row whose slot is outside 0..S-1 (-1: padding) comes back zero, or unwritten without
    `zero_unrouted`. `count` gains the number of rows with a slot. `tiles`: the tiling, else
    `expert_tiles`'s choice."""
    M, H = x.shape
    S, I, _ = w_gate.shape
    t = tiles or getattr(_chosen, "tiles", TILES)
    if tiles is None and x.element_size() > 2:  # fp32 tiles of PROMPT_TILES' shape overflow shared memory
        t = TILES
    expected = getattr(_chosen, "rows", 0) if tiles is None else 0
    rows, ends, blocks = group_rows(local, S, count, t.m)
    precision = "ieee" if x.dtype == torch.float32 else None  # fp32 stays fp32 (no TF32)
    # Decode fills at most one block per slot (under t.m rows each), so it runs in one pass; a
    # step's prompt rows fill a block row of the grid once (`expected`): a grid of fewer programs
    # ran their blocks in two rounds, the second mostly idle.
    grid = min(triton.cdiv(M, t.m) + min(S, M), max(2 * S + 16, triton.cdiv(expected, t.m) + S))
    launch = dict(
        BLOCK_M=t.m, BLOCK_N=t.n, BLOCK_K=t.k, BLOCK_S=triton.next_power_of_2(S), GROUP=t.group,
        num_warps=t.warps, num_stages=t.stages,
    )  # fmt: skip
    h = torch.empty(M, I, dtype=x.dtype, device=x.device)
    _expert_kernel[(grid * triton.cdiv(I, t.n),)](
        x.contiguous(), rows, ends, blocks, w_gate, w_up, h, I, H, S, GATED=True, PRECISION=precision, **launch
    )
    y = (torch.zeros if zero_unrouted else torch.empty)(M, H, dtype=x.dtype, device=x.device)
    _expert_kernel[(grid * triton.cdiv(H, t.n),)](
        h, rows, ends, blocks, w_down, w_down, y, H, I, S, GATED=False, PRECISION=precision, **launch
    )
    return y
