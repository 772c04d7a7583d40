"""OLMoE: every layer a routed MoE under Qwen2-MoE's tensor names (no shared expert, no attention
bias), softmax routing whose top-k weights are renormalised only where `norm_topk_prob` says so
(its checkpoints do not), q and k RMS-normed over their whole projections (every head together)
ahead of the rotary embedding, then q, k and v clamped to +-clip_qkv where it is set."""

from __future__ import annotations

import msgspec

from components.engine.models.config import ConfigError, refuse_sliding_window
from components.engine.models.layers import Attention, RMSNorm
from components.engine.models.qwen3_moe import Qwen3Moe, Qwen3MoeBlock


class ProjectionNormAttention(Attention):
    def __init__(self, cfg, layer, rotary, bias: bool):
        super().__init__(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, bias, rotary, layer)
        self.q_norm = RMSNorm(cfg.num_heads * cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.num_kv_heads * cfg.head_dim, cfg.rms_norm_eps)
        self.clip = cfg.clip_qkv

    def project(self, x):
        T = x.shape[0]
        q, k, v = self.q_norm(self.q_proj(x)), self.k_norm(self.k_proj(x)), self.v_proj(x)
        if self.clip is not None:
            q, k, v = (t.clamp(-self.clip, self.clip) for t in (q, k, v))
        return q.view(T, self.nh, self.hd), k.view(T, self.nkv, self.hd), v.view(T, self.nkv, self.hd)


class OlmoeBlock(Qwen3MoeBlock):
    attention_class = ProjectionNormAttention


class Olmoe(Qwen3Moe):
    name = "olmoe"
    architectures = ("OlmoeForCausalLM",)

    def config(self, c):
        # transformers' OLMoE attention takes any sliding_window in its config as in force.
        refuse_sliding_window(c, on_by_default=True)
        hidden, heads = int(c["hidden_size"]), int(c["num_attention_heads"])
        if c.get("head_dim") is not None and int(c["head_dim"]) != hidden // heads:
            # Its q_norm is hidden_size long: the projections must be hidden_size wide too.
            raise ConfigError(f"head_dim={c['head_dim']} is unsupported (only hidden_size / num_attention_heads)")
        # The experts are intermediate_size wide, and every layer is sparse.
        dense = {"moe_intermediate_size": c["intermediate_size"], "mlp_only_layers": [], "decoder_sparse_step": 1}
        clip = c.get("clip_qkv")
        return msgspec.structs.replace(super().config({**c, **dense}), clip_qkv=None if clip is None else float(clip))

    def block(self, cfg, layer, ep, rotary):
        return OlmoeBlock(cfg, layer, ep, rotary)

    def qk_norm_dims(self, cfg):
        return cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim


FAMILY = Olmoe()
