"""Expert-parallel MoE layer: route locally, dispatch token rows to the ranks owning the chosen
experts, compute there, combine the results back.

Each rank holds `slots_per_rank` expert slots in fixed tensors; which logical expert sits in a
slot comes from the ExpertMap, so a new placement only rewrites slot contents and map entries,
never shapes or addresses. A dispatch row is the token's hidden state followed by the int32 local
slot index on the destination; the combine reply carries the expert output rows in the same order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from components.engine.ep_comm import EPCommunicator
from components.engine.expert_map import ExpertMap


class ExpertParallel:
    """What every MoE layer of a rank shares: the communicator and the expert map."""

    def __init__(self, comm: EPCommunicator, expert_map: ExpertMap):
        self.comm, self.map = comm, expert_map
        self.rank = comm.rank
        self.slots_per_rank = expert_map.slots_per_rank
        # A joiner warming up alone (remote peers masked) drops the pairs routed to masked ranks,
        # as vLLM's mask_remote_ranks does; outside warmup such a route is a bug and raises.
        self.masked_warmup = False


def _pack(x: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    return torch.cat((x.contiguous().view(torch.uint8).flatten(), local.to(torch.int32).view(torch.uint8)))


def _unpack(buf: torch.Tensor, hidden: int, dtype: torch.dtype, src: int) -> tuple[torch.Tensor, torch.Tensor]:
    row = hidden * dtype.itemsize
    n, rest = divmod(buf.numel(), row + 4)
    if rest:  # a torn or mismatched collective; garbage slot indices would follow
        raise RuntimeError(f"EP dispatch from rank {src}: {buf.numel()} bytes is not a whole number of "
                           f"{row + 4}-byte rows")
    return buf[: n * row].view(dtype).view(n, hidden), buf[n * row :].view(torch.int32)


class SparseMoE(nn.Module):
    """Top-k routed experts over EP. `gate` is the router; expert weights live in slot tensors."""

    def __init__(self, cfg, layer: int, ep: ExpertParallel):
        super().__init__()
        H, I, S = cfg.hidden_size, cfg.moe_intermediate_size, ep.slots_per_rank
        self.layer, self.top_k, self.norm_topk = layer, cfg.top_k, cfg.norm_topk_prob
        self.hidden, self.ep = H, ep
        self.gate = nn.Linear(H, cfg.num_experts, bias=False)
        self.register_buffer("w_gate", torch.zeros(S, I, H), persistent=False)
        self.register_buffer("w_up", torch.zeros(S, I, H), persistent=False)
        self.register_buffer("w_down", torch.zeros(S, H, I), persistent=False)
        # Tokens routed to each logical expert since the last reset: the input of EPLB.
        self.register_buffer("load", torch.zeros(cfg.num_experts, dtype=torch.int64), persistent=False)
        self.rows_computed = 0  # (token, expert) pairs this rank computed for any rank

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

    def experts(self, x: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        self.rows_computed += x.shape[0]
        for s in local.unique().tolist():
            rows = (local == s).nonzero().flatten()
            h = x[rows]
            h = F.silu(h @ self.w_gate[s].T) * (h @ self.w_up[s].T)
            out[rows] = h @ self.w_down[s].T
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T, k, S = x.shape[0], self.top_k, self.ep.slots_per_rank
        comm = self.ep.comm
        weights, experts = self.route(x)
        self.load.index_add_(0, experts.flatten(), torch.ones_like(experts.flatten()))
        slots = self.ep.map.route(self.layer, experts).flatten()
        dest = slots // S
        order = torch.argsort(dest, stable=True)
        tokens = order // k
        counts = torch.bincount(dest, minlength=self.ep.map.max_ranks).tolist()
        active = comm.active
        sends, starts, off = {}, {}, 0
        for r in range(len(counts)):
            if counts[r] and r not in active and not self.ep.masked_warmup:
                raise RuntimeError(f"layer {self.layer}: expert map routes tokens to inactive rank {r}")
            if r in active:
                idx = order[off : off + counts[r]]
                starts[r] = off
                sends[r] = _pack(x[tokens[off : off + counts[r]]], slots[idx] % S)
            off += counts[r]
        # The communicator may hand back host memory (see rank.nixl_comm).
        received = {r: t.to(x.device) for r, t in comm.all_to_all(sends).items()}

        srcs = sorted(received)
        parts = [_unpack(received[r], self.hidden, x.dtype, r) for r in srcs]
        rows = torch.cat([p[0] for p in parts]) if parts else x.new_zeros(0, self.hidden)
        local = torch.cat([p[1] for p in parts]) if parts else torch.zeros(0, dtype=torch.int32)
        y = self.experts(rows, local.to(rows.device))
        replies, off = {}, 0
        for r, (xs, _) in zip(srcs, parts):
            replies[r] = y[off : off + xs.shape[0]].contiguous().view(torch.uint8).flatten()
            off += xs.shape[0]
        back = {r: t.to(x.device) for r, t in comm.all_to_all(replies).items()}

        out_sorted = torch.zeros(T * k, self.hidden, dtype=x.dtype, device=x.device)
        for r in active:
            if counts[r]:
                out_sorted[starts[r] : starts[r] + counts[r]] = back[r].view(x.dtype).view(-1, self.hidden)
        per_pair = torch.empty_like(out_sorted)
        per_pair[order] = out_sorted
        # A fixed summation order over k, whichever ranks computed the pairs.
        return (per_pair.view(T, k, self.hidden) * weights.unsqueeze(-1)).sum(dim=1)
