"""Mixtral: attention without bias, every layer a top-k sparse MoE (`block_sparse_moe`)."""

from torch import nn

from components.engine.layers import Attention, RMSNorm
from components.engine.moe import SparseMoE


class MixtralBlock(nn.Module):
    def __init__(self, cfg, layer, ep, rotary):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                   False, rotary, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.block_sparse_moe = SparseMoE(cfg, layer, ep)
        self.moe = self.block_sparse_moe

    def forward(self, x, batch, kv):
        x = x + self.self_attn(self.input_layernorm(x), batch, kv)
        return x + self.block_sparse_moe(self.post_attention_layernorm(x))
