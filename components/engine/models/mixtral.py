"""Mixtral: attention without bias, every layer a top-k sparse MoE (`block_sparse_moe`)."""

from __future__ import annotations

from components.engine.models.config import ModelConfig, common_fields, refuse_sliding_window, refuse_unless
from components.engine.models.family import KVLayout
from components.engine.models.hf_layout import decoder_tensors, layer_prefix, routed_expert_shapes
from components.engine.models.layers import DecoderBlock, Rotary
from components.engine.models.moe import SparseMoE


class MixtralBlock(DecoderBlock):
    def __init__(self, cfg, layer, ep, rotary):
        super().__init__(cfg, layer, rotary, bias=False)
        self.block_sparse_moe = SparseMoE(cfg, layer, ep)

    @property
    def ffn(self):
        return self.block_sparse_moe

    moe = ffn


class Mixtral:
    name = "mixtral"
    architectures = ("MixtralForCausalLM",)

    def config(self, c):
        # Mixtral has no use_sliding_window flag: a set sliding_window is in force.
        refuse_sliding_window(c, on_by_default=True)
        refuse_unless(c, hidden_act="silu")
        common = common_fields(c)
        return ModelConfig(
            architecture=self.name,
            **common,
            num_experts=int(c["num_local_experts"]),
            moe_intermediate_size=int(c["intermediate_size"]),
            norm_topk_prob=True,
            shared_expert_intermediate_size=0,
            dense_intermediate_size=0,
            sparse_layers=(True,) * common["num_layers"],
            qkv_bias=False,
        )

    def rotary(self, cfg, max_len):
        return Rotary(cfg.head_dim, cfg.rope_theta, max_len)

    def block(self, cfg, layer, ep, rotary):
        return MixtralBlock(cfg, layer, ep, rotary)

    def router_name(self, cfg, layer: int) -> str:
        return f"{layer_prefix(layer)}.block_sparse_moe.gate.weight"

    def expert_tensors(self, cfg, layer, expert):
        p = f"{layer_prefix(layer)}.block_sparse_moe.experts.{expert}"
        return f"{p}.w1.weight", f"{p}.w3.weight", f"{p}.w2.weight"

    def tensors(self, cfg):
        out = decoder_tensors(cfg, qkv_bias=False)
        for i in range(cfg.num_layers):
            out[self.router_name(cfg, i)] = (cfg.num_experts, cfg.hidden_size)
            out.update(routed_expert_shapes(cfg, self, i))
        return out

    def kv_layout(self, cfg):
        return KVLayout(cfg.num_kv_heads, cfg.head_dim, cfg.head_dim)


FAMILY = Mixtral()
