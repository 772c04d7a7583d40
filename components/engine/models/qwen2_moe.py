"""Qwen2-MoE: attention with q/k/v bias; sparse layers add a shared expert scaled by a sigmoid
gate to the routed experts; layers listed as MLP-only are dense."""

import torch
from torch import nn

from components.engine.layers import DecoderBlock, GatedMLP
from components.engine.moe import SparseMoE


class Qwen2MoeSparse(SparseMoE):
    def __init__(self, cfg, layer, ep):
        super().__init__(cfg, layer, ep)
        self.shared_expert = GatedMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def combine(self, x, d, out):
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return super().combine(x, d, out) + shared


class Qwen2MoeBlock(DecoderBlock):
    def __init__(self, cfg, layer, ep, rotary):
        super().__init__(cfg, layer, rotary, bias=cfg.qkv_bias)
        if not cfg.sparse_layers[layer]:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.dense_intermediate_size)
        elif cfg.shared_expert_intermediate_size:
            self.mlp = Qwen2MoeSparse(cfg, layer, ep)
        else:
            self.mlp = SparseMoE(cfg, layer, ep)

    @property
    def ffn(self):
        return self.mlp

    @property
    def moe(self):
        return self.mlp if isinstance(self.mlp, SparseMoE) else None
