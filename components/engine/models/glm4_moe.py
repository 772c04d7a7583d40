"""GLM-4.5 / 4.6 (Glm4MoeForCausalLM): DeepSeek-V3's MoE layout and routing (deepseek_v3.py:
sigmoid scores biased for the choice only, the best `topk_group` of n_group groups, renormalised
weights times routed_scaling_factor, shared experts, the first `first_k_dense_replace` layers
dense) under GQA attention: q/k/v bias where `attention_bias` says so, q and k RMS-normed per head
where `use_qk_norm` does (Qwen3-MoE's HeadNormAttention), and the rotary embedding on the first
head_dim * `partial_rotary_factor` dims of each head only (rotate-half over those dims, the rest
passed unchanged: layers.Rotary and the CUDA kernel rotate the width of their tables).

The MTP layers (num_nextn_predict_layers, tensors of layer index num_hidden_layers on) are not served.
"""

from __future__ import annotations

import msgspec

from components.engine.models.config import ConfigError, ModelConfig, common_fields, refuse_unless, rope_parameters
from components.engine.models.deepseek_v3 import DeepseekBlock, DeepseekV3, GroupedRouting, grouped_moe
from components.engine.models.family import KVLayout
from components.engine.models.hf_layout import decoder_tensors, layer_prefix
from components.engine.models.layers import MlpBlock, Rotary
from components.engine.models.qwen3_moe import HeadNormAttention

# Glm4MoeConfig's defaults for keys a config.json may leave out, where the shared readers'
# fallbacks differ from them.
_DEFAULTS = {"first_k_dense_replace": 1, "n_shared_experts": 1, "num_key_value_heads": 8, "partial_rotary_factor": 0.5}


class GlmParams(msgspec.Struct, frozen=True):
    routing: GroupedRouting
    rotary_dim: int  # the leading dims of a head the rotary embedding turns
    use_qk_norm: bool


class GlmBlock(DeepseekBlock):
    def attention(self, cfg, layer, rotary, bias):
        if cfg.params.use_qk_norm:
            return HeadNormAttention(cfg, layer, rotary, bias)
        return MlpBlock.attention(self, cfg, layer, rotary, bias)


class Glm4Moe(DeepseekV3):
    name = "glm4_moe"
    architectures = ("Glm4MoeForCausalLM",)

    def config(self, c):
        refuse_unless(c, hidden_act="silu")
        c = {**_DEFAULTS, **c}
        common = common_fields(c)
        # Published configs set it at the top level; transformers' save_pretrained in rope_parameters.
        factor = rope_parameters(c).get("partial_rotary_factor", c["partial_rotary_factor"])
        head_dim = common["head_dim"]
        rotary_dim = int(head_dim * float(factor))
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            why = f"head_dim={head_dim} times it must be an even number of dims, 2 to head_dim"
            raise ConfigError(f"unsupported partial_rotary_factor={factor!r} ({why})")
        moe, routing = grouped_moe(c, self.name)
        return ModelConfig(
            architecture=self.name,
            **common,
            **moe,
            qkv_bias=bool(c.get("attention_bias", False)),
            params=GlmParams(routing, rotary_dim, bool(c.get("use_qk_norm", False))),
        )

    def rotary(self, cfg, max_len):
        return Rotary(cfg.params.rotary_dim, cfg.rope_theta, max_len)

    def block(self, cfg, layer, ep, rotary):
        return GlmBlock(cfg, layer, ep, rotary)

    def tensors(self, cfg):
        out = decoder_tensors(cfg, qkv_bias=cfg.qkv_bias)
        for i in range(cfg.num_layers):
            if cfg.params.use_qk_norm:
                a = f"{layer_prefix(i)}.self_attn"
                out.update({f"{a}.q_norm.weight": (cfg.head_dim,), f"{a}.k_norm.weight": (cfg.head_dim,)})
            out.update(self.mlp_tensors(cfg, i))
        return out

    def kv_layout(self, cfg):
        return KVLayout(cfg.num_kv_heads, cfg.head_dim, cfg.head_dim)


FAMILY = Glm4Moe()
