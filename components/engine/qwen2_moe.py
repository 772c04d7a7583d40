"""Qwen2-MoE: attention with q/k/v bias; sparse layers add a shared expert scaled by a sigmoid
gate to the routed experts; layers listed as MLP-only are dense."""

import torch
from torch import nn

from components.engine.layers import Attention, GatedMLP, RMSNorm
from components.engine.moe import SparseMoE


class Qwen2MoeSparse(SparseMoE):
    def __init__(self, cfg, layer, ep):
        super().__init__(cfg, layer, ep)
        self.shared_expert = GatedMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x):
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return super().forward(x) + shared


class Qwen2MoeBlock(nn.Module):
    def __init__(self, cfg, layer, ep, rotary):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                   cfg.qkv_bias, rotary, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if not cfg.sparse_layers[layer]:
            self.mlp, self.moe = GatedMLP(cfg.hidden_size, cfg.dense_intermediate_size), None
        elif cfg.shared_expert_intermediate_size:
            self.mlp = self.moe = Qwen2MoeSparse(cfg, layer, ep)
        else:
            self.mlp = self.moe = SparseMoE(cfg, layer, ep)

    def forward(self, x, batch, kv):
        x = x + self.self_attn(self.input_layernorm(x), batch, kv)
        return x + self.mlp(self.post_attention_layernorm(x))
