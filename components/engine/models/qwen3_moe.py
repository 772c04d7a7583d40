"""Qwen3-MoE: Qwen2-MoE's layout (dense layers by `mlp_only_layers` / `decoder_sparse_step`)
without attention bias or a shared expert, q and k each RMS-normed per head ahead of the rotary
embedding, and an explicit head_dim (num_heads * head_dim need not be hidden_size)."""

from __future__ import annotations

from components.engine.models.config import refuse_unless
from components.engine.models.hf_layout import layer_prefix
from components.engine.models.layers import Attention, RMSNorm
from components.engine.models.qwen2_moe import Qwen2Moe, Qwen2MoeBlock


class HeadNormAttention(Attention):
    """q and k RMS-normed over each head (one head_dim weight for every head) before the rotary
    embedding; on CUDA the norm is the row-local Triton kernel, a row per (token, head)."""

    def __init__(self, cfg, layer, rotary, bias: bool):
        super().__init__(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, bias, rotary, layer)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def project(self, x):
        q, k, v = super().project(x)
        return self.q_norm(q), self.k_norm(k), v


class Qwen3MoeBlock(Qwen2MoeBlock):
    attention_class: type[Attention] = HeadNormAttention

    def attention(self, cfg, layer, rotary, bias):
        return self.attention_class(cfg, layer, rotary, bias)


class Qwen3Moe(Qwen2Moe):
    name = "qwen3_moe"
    architectures = ("Qwen3MoeForCausalLM",)

    def config(self, c):
        refuse_unless(c, attention_bias=False)
        # Published configs say num_experts; transformers' save_pretrained writes the name its
        # attribute map gives it, num_local_experts.
        experts = c.get("num_experts", c.get("num_local_experts"))
        return super().config({**c, "num_experts": experts, "qkv_bias": False, "shared_expert_intermediate_size": 0})

    def block(self, cfg, layer, ep, rotary):
        return Qwen3MoeBlock(cfg, layer, ep, rotary)

    def qk_norm_dims(self, cfg) -> tuple[int, int]:
        """The lengths of the q_norm and k_norm weights."""
        return cfg.head_dim, cfg.head_dim

    def tensors(self, cfg):
        out = super().tensors(cfg)
        q, k = self.qk_norm_dims(cfg)
        for i in range(cfg.num_layers):
            a = f"{layer_prefix(i)}.self_attn"
            out.update({f"{a}.q_norm.weight": (q,), f"{a}.k_norm.weight": (k,)})
        return out


FAMILY = Qwen3Moe()
