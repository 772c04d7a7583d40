"""The device-side expert map: physical slot -> logical expert per MoE layer, as tensors that a
new Placement is copied into (`install`), which is what lets a captured decode keep reading the map
across a scale operation. Tokens are spread over replicas deterministically by token index.
"""

from __future__ import annotations

import torch

from components.protocol.placement import Placement


class ExpertMap:
    """Device-side routing tables built from a Placement, updated in place."""

    def __init__(self, num_layers: int, num_experts: int, max_ranks: int, slots_per_rank: int, device="cpu"):
        self.num_layers, self.num_experts = num_layers, num_experts
        self.max_ranks, self.slots_per_rank = max_ranks, slots_per_rank
        total = max_ranks * slots_per_rank
        # A logical expert can have at most one replica per physical slot.
        self.max_replicas = total
        self.slot_to_expert = torch.full((num_layers, total), -1, dtype=torch.int32, device=device)
        self.replica_slots = torch.zeros((num_layers, num_experts, self.max_replicas), dtype=torch.int64, device=device)
        # Until a placement is installed every expert routes to slot 0: decode graphs are captured
        # before the first placement and must index in bounds (a modulo by zero would not).
        self.num_replicas = torch.ones((num_layers, num_experts), dtype=torch.int64, device=device)
        self.placement: Placement | None = None

    def install(self, placement: Placement) -> None:
        if placement.slots_per_rank != self.slots_per_rank or len(placement.slots) != self.num_layers:
            raise ValueError(
                f"placement has {len(placement.slots)} layers x {placement.slots_per_rank} slots/rank, "
                f"this map is {self.num_layers} x {self.slots_per_rank}"
            )
        s2e = torch.tensor(placement.slots, dtype=torch.int32)
        if s2e.shape[1] != self.slot_to_expert.shape[1]:
            raise ValueError(f"placement has {s2e.shape[1]} slots, expected {self.slot_to_expert.shape[1]}")
        reps = torch.zeros_like(self.replica_slots, device="cpu")
        counts = torch.zeros_like(self.num_replicas, device="cpu")
        for layer, row in enumerate(placement.slots):
            for slot, expert in enumerate(row):
                if expert >= 0:
                    reps[layer, expert, counts[layer, expert]] = slot
                    counts[layer, expert] += 1
            missing = (counts[layer] == 0).nonzero().flatten().tolist()
            if missing:
                raise ValueError(f"placement leaves experts {missing} of layer {layer} without a slot")
        self.slot_to_expert.copy_(s2e)
        self.replica_slots.copy_(reps)
        self.num_replicas.copy_(counts)
        self.placement = placement

    def route(self, layer: int, experts: torch.Tensor) -> torch.Tensor:
        """Logical experts [T, k] -> physical slots [T, k]; replicas chosen by token index."""
        t = torch.arange(experts.shape[0], device=experts.device).unsqueeze(1)
        replica = t % self.num_replicas[layer][experts]
        return self.replica_slots[layer][experts, replica]
