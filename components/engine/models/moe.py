"""Expert-parallel MoE layer: route locally, dispatch token rows to the ranks owning the chosen
experts, compute there, combine the results back.

Each rank holds `slots_per_rank` expert slots in fixed tensors; which logical expert sits in a
slot comes from the ExpertMap, so a new placement only rewrites slot contents and map entries,
never shapes or addresses. A dispatch row is the token's hidden state followed by the int32 local
slot index on the destination; the combine reply carries the expert output rows in the same order.

A layer runs in three steps so that CUDA graphs can hold two of them (see cuda_graphs):
`dispatch` (device only: route, apply the EP mask, sort pairs by destination, gather rows),
`exchange` (host-driven: the all_to_all, the local experts, the reply), `combine` (device only).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from components.engine.exchange.communicator import EPCommunicator
from components.engine.exchange.expert_map import ExpertMap


class ExpertParallel:
    """What every MoE layer of a rank shares: the communicator, the expert map and the EP mask."""

    def __init__(self, comm: EPCommunicator, expert_map: ExpertMap):
        self.comm, self.map = comm, expert_map
        self.rank = comm.rank
        self.slots_per_rank = expert_map.slots_per_rank
        self.windows = comm.windows
        dev = expert_map.slot_to_expert.device
        # The active set as the dispatch kernels read it, like nixl_ep's mask buffer: a device
        # tensor at a fixed address, so captured graphs follow membership changes without a
        # recapture. Pairs routed to a masked rank are not sent.
        self.mask = (
            self.windows.mask
            if self.windows is not None
            else torch.zeros(expert_map.max_ranks, dtype=torch.bool, device=dev)
        )
        # Counted on the device, read by the step loop from its copy of `counters` made after
        # each step: (token, expert) pairs this rank computed for any rank, and pairs the map
        # routed outside the active set (counted by the dispatch where the exchange is device
        # work; the host-driven one raises at once). `strict` is 0 in masked warmup.
        self.counters = torch.zeros(2, dtype=torch.int64, device=dev)
        self.rows_computed, self.misrouted = self.counters[0:1], self.counters[1:2]
        self.strict = torch.ones(1, dtype=torch.int64, device=dev)
        self._mask_of: tuple[int, ...] | None = None
        # A joiner warming up alone (remote peers masked) drops the pairs routed to masked ranks,
        # as vLLM's mask_remote_ranks does; outside warmup such a route is a bug and raises.
        self.masked_warmup = False

    def set_masked_warmup(self, on: bool) -> None:
        self.masked_warmup = on
        self.strict.fill_(0 if on else 1)

    def check_routes(self, n: int) -> None:
        """After a step with device exchanges: raise on `n`, the misrouted count it left."""
        if n:
            self.misrouted.zero_()
            raise RuntimeError(
                f"expert map routes {n} (token, expert) pairs to ranks outside the active set {list(self.comm.active)}"
            )

    def sync_mask(self) -> None:
        """Bring the device mask up to the communicator's active set (before a step)."""
        active = self.comm.active
        if active != self._mask_of:
            m = torch.zeros_like(self.mask, device="cpu")
            m[list(active)] = True
            self.mask.copy_(m)
            self._mask_of = active


class Dispatch(NamedTuple):
    """One layer's dispatch layout, on the device. Pairs are (token, expert choice) in the order
    they are sent: by destination rank, then pairs to masked ranks, then pairs of padding rows."""

    weights: torch.Tensor  # [T, k] routing weights
    order: torch.Tensor  # [T*k] pair index (token * k + choice) at each position
    rows: torch.Tensor  # [T*k, H] the token row of each position
    local: torch.Tensor  # [T*k] int32 slot on the destination rank
    counts: torch.Tensor  # [max_ranks + 2] pairs per destination, then masked, then padding
    position: torch.Tensor | None = None  # [T*k] int32 position of each pair (CUDA: for the combine)


def _pack(x: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    return torch.cat((x.contiguous().view(torch.uint8).flatten(), local.view(torch.uint8)))


def _unpack(buf: torch.Tensor, hidden: int, dtype: torch.dtype, src: int) -> tuple[torch.Tensor, torch.Tensor]:
    row = hidden * dtype.itemsize
    n, rest = divmod(buf.numel(), row + 4)
    if rest:  # a torn or mismatched collective; garbage slot indices would follow
        raise RuntimeError(
            f"EP dispatch from rank {src}: {buf.numel()} bytes is not a whole number of {row + 4}-byte rows"
        )
    return buf[: n * row].view(dtype).view(n, hidden), buf[n * row :].view(torch.int32)


def _grouped_mm_runs(w: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether torch._grouped_mm takes these [S, I, H] expert weights and [N, H] rows on the CPU
    (CUDA has expert_gemm): every operand's row stride must be a multiple of 16 bytes (H for the
    gate/up views, I for the down view and the rows)."""
    if not hasattr(torch, "_grouped_mm") or x.dtype != w.dtype:
        return False
    S, I, H = w.shape
    return (H * w.element_size()) % 16 == 0 and (I * w.element_size()) % 16 == 0


def group_by_slot(key: torch.Tensor, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For `key` [M] in 0..slots (slots: no slot): the row at each group-order position, rows of
    one slot together in their original order, and each slot's group end. A counting sort of a
    few small kernels, its scan along the rows' (innermost) dimension: torch.argsort's radix sort
    and a scan across the outer dimension each cost tens of microseconds at these sizes."""
    M = key.shape[0]
    onehot = torch.arange(slots + 1, device=key.device).unsqueeze(1) == key  # [slots + 1, M]
    within = torch.cumsum(onehot, 1, dtype=torch.int32)
    counts = within[:, -1]
    starts = torch.cumsum(counts, 0, dtype=torch.int32) - counts
    pos = (starts[key] + within.gather(0, key.unsqueeze(0)).squeeze(0) - 1).long()
    rows = torch.empty(M, dtype=torch.int32, device=key.device)
    rows[pos] = torch.arange(M, dtype=torch.int32, device=key.device)
    return rows, (starts + counts)[:slots].contiguous()


class SparseMoE(nn.Module):
    """Top-k routed experts over EP. `gate` is the router; expert weights live in slot tensors."""

    def __init__(self, cfg, layer: int, ep: ExpertParallel):
        super().__init__()
        H, I, S = cfg.hidden_size, cfg.moe_intermediate_size, ep.slots_per_rank
        self.layer, self.top_k, self.norm_topk = layer, cfg.top_k, cfg.norm_topk_prob
        # This layer's row of the expert map and of placements (dense layers have none).
        self.row = sum(cfg.sparse_layers[:layer])
        self.hidden, self.ep = H, ep
        self.gate = nn.Linear(H, cfg.num_experts, bias=False)
        self.register_buffer("w_gate", torch.zeros(S, I, H), persistent=False)
        self.register_buffer("w_up", torch.zeros(S, I, H), persistent=False)
        self.register_buffer("w_down", torch.zeros(S, H, I), persistent=False)
        # Tokens routed to each logical expert since the last reset: the input of EPLB.
        self.register_buffer("load", torch.zeros(cfg.num_experts, dtype=torch.int64), persistent=False)

    def load_slot(self, slot: int, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
        self.w_gate[slot].copy_(gate)
        self.w_up[slot].copy_(up)
        self.w_down[slot].copy_(down)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def scoring(self):
        """How the CUDA routing kernel computes `route` (kernels.routing.route_and_sort's
        `scoring`): None, the softmax top-k above; a family routing otherwise says so."""
        return None

    def experts(self, x: torch.Tensor, local: torch.Tensor, zero_unrouted: bool = True) -> torch.Tensor:
        """The SwiGLU expert of slot `local[i]` applied to row `x[i]`, zeros for rows whose slot
        is out of range (-1 marks padding; on CUDA left unwritten without `zero_unrouted`),
        without a host sync: the row count can stay fixed, so a graph can capture it. On CUDA the
        Triton kernels of expert_gemm; on the CPU rows are grouped by slot (group_by_slot) and
        each projection is one grouped GEMM over the groups."""
        S = self.ep.slots_per_rank
        if x.shape[0] == 0:
            return torch.zeros_like(x)
        if x.is_cuda:  # the slot validity, the count and the grouping in one launch (group_rows)
            from components.engine.kernels.expert_gemm import swiglu_experts

            return swiglu_experts(
                x, local, self.w_gate, self.w_up, self.w_down, self.ep.rows_computed, zero_unrouted=zero_unrouted
            )
        real = (local >= 0) & (local < S)
        self.ep.rows_computed.add_(real.sum())
        key = torch.where(real, local.long(), S)  # padding sorts behind every group
        if not _grouped_mm_runs(self.w_gate, x):
            return self._experts_per_slot(x, key)
        rows, ends = group_by_slot(key, S)
        order = rows.long()
        h = x[order]
        # [S, I, H] slots read as [S, H, I] views: no copy, and slot names keep their tensors.
        gate = torch._grouped_mm(h, self.w_gate.transpose(1, 2), offs=ends)
        up = torch._grouped_mm(h, self.w_up.transpose(1, 2), offs=ends)
        y = torch._grouped_mm(F.silu(gate) * up, self.w_down.transpose(1, 2), offs=ends)
        # Rows past the last group end come back uninitialised (NaN or Inf alike): select, not scale.
        y = torch.where(real[order].unsqueeze(1), y, 0)
        return torch.empty_like(x).index_copy_(0, order, y)

    def _experts_per_slot(self, x: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        """Every slot over every row, each row keeping its own slot's result: S times the FLOPs of
        the grouped form, for shapes torch._grouped_mm does not take."""
        out = torch.zeros_like(x)
        for s in range(self.ep.slots_per_rank):
            y = (F.silu(x @ self.w_gate[s].T) * (x @ self.w_up[s].T)) @ self.w_down[s].T
            out = torch.where((key == s).unsqueeze(1), y, out)
        return out

    def dispatch(self, x: torch.Tensor, valid: torch.Tensor | None = None) -> Dispatch:
        """Device only (no host sync), so a graph can capture it. `valid` marks real rows of a
        padded batch; padding rows are routed but neither sent nor counted as load."""
        if x.is_cuda:  # the same layout from two launches after the router (routing_kernel)
            from components.engine.kernels.routing import gather_rows, route_and_sort

            m, ep = self.ep.map, self.ep
            # The peer-window exchange's count of misrouted pairs comes with the counts.
            misrouted = (ep.misrouted, ep.strict) if ep.windows is not None else None
            weights, order, local, counts, position = route_and_sort(
                self.gate(x), valid, m.replica_slots[self.row], m.num_replicas[self.row], ep.mask,
                self.load, self.top_k, self.norm_topk, ep.slots_per_rank, x.dtype, misrouted, self.scoring(),
            )  # fmt: skip
            return Dispatch(weights, order, gather_rows(x, order, self.top_k), local, counts, position)
        return self._dispatch_torch(x, valid)

    def _dispatch_torch(self, x: torch.Tensor, valid: torch.Tensor | None) -> Dispatch:
        """The dispatch in torch ops: the CPU path, and what the CUDA kernels must reproduce."""
        T, k, S, R = x.shape[0], self.top_k, self.ep.slots_per_rank, self.ep.map.max_ranks
        weights, experts = self.route(x)
        pair_valid = (
            valid.unsqueeze(1).expand(T, k).flatten()
            if valid is not None
            else torch.ones(T * k, dtype=torch.bool, device=x.device)
        )
        self.load.index_add_(0, experts.flatten(), pair_valid.to(torch.int64))
        slots = self.ep.map.route(self.row, experts).flatten()
        dest = slots // S
        key = torch.where(self.ep.mask[dest], dest, R)
        key = torch.where(pair_valid, key, R + 1)
        order = torch.argsort(key, stable=True)
        counts = torch.zeros(R + 2, dtype=torch.int64, device=x.device).index_add_(0, key, torch.ones_like(key))
        local = (slots[order] % S).to(torch.int32)
        if self.ep.windows is not None:  # the device exchange's count of misrouted pairs, as route_and_sort's
            self.ep.misrouted.add_(counts[R] * self.ep.strict)
        return Dispatch(weights, order, x[order // k], local, counts)

    def exchange(self, d: Dispatch, out: torch.Tensor) -> None:
        """Send each destination its run of rows, compute the rows sent here, and write the
        replies into `out` ([T*k, H]) in dispatch order, zeros for pairs not sent. Device work
        through peer windows where the communicator has them, else host-driven."""
        comm, R = self.ep.comm, self.ep.map.max_ranks
        if self.ep.windows is not None:  # the dispatch counted the misrouted pairs (route_and_sort)
            self.ep.windows.exchange(d.rows, d.local, d.counts, out, self.experts)
            return
        counts = d.counts.tolist()
        if counts[R] and not self.ep.masked_warmup:
            raise RuntimeError(
                f"layer {self.layer}: expert map routes {counts[R]} (token, expert) pairs to ranks "
                f"outside the active set {list(comm.active)}"
            )
        sends, starts, off = {}, {}, 0
        for r in range(R):
            if counts[r]:
                starts[r] = off
                sends[r] = _pack(d.rows[off : off + counts[r]], d.local[off : off + counts[r]])
                off += counts[r]
        # The communicator may hand back host memory (see rank.nixl_comm).
        received = {r: t.to(out.device) for r, t in comm.all_to_all(sends).items()}

        srcs = sorted(received)
        parts = [_unpack(received[r], self.hidden, out.dtype, r) for r in srcs]
        rows = torch.cat([p[0] for p in parts]) if parts else out.new_zeros(0, self.hidden)
        local = torch.cat([p[1] for p in parts]) if parts else torch.zeros(0, dtype=torch.int32)
        y = self.experts(rows, local.to(rows.device))
        replies, pos = {}, 0
        for r, (xs, _) in zip(srcs, parts):
            replies[r] = y[pos : pos + xs.shape[0]].contiguous().view(torch.uint8).flatten()
            pos += xs.shape[0]
        back = comm.all_to_all(replies)
        for r, start in starts.items():
            out[start : start + counts[r]] = back[r].to(out.device).view(out.dtype).view(-1, self.hidden)
        out[off:].zero_()

    def combine(self, x: torch.Tensor, d: Dispatch, out: torch.Tensor) -> torch.Tensor:
        """Device only. `x` is the layer input (for layers that add a dense part)."""
        if d.position is not None:
            from components.engine.kernels.routing import combine_pairs

            return combine_pairs(out, d.position, d.weights)
        return self._combine_torch(d, out)

    def _combine_torch(self, d: Dispatch, out: torch.Tensor) -> torch.Tensor:
        T, k = d.weights.shape
        per_pair = torch.empty_like(out)
        per_pair[d.order] = out
        # A fixed summation order over k, whichever ranks computed the pairs.
        return (per_pair.view(T, k, self.hidden) * d.weights.unsqueeze(-1)).sum(dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.ep.sync_mask()
        d = self.dispatch(x)
        out = x.new_empty(x.shape[0] * self.top_k, self.hidden)
        self.exchange(d, out)
        return self.combine(x, d, out)
