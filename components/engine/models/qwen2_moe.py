"""Qwen2-MoE: attention with q/k/v bias; sparse layers add a shared expert scaled by a sigmoid
gate to the routed experts; layers listed as MLP-only are dense."""

from __future__ import annotations

import torch
from torch import nn

from components.engine.models.config import ModelConfig, common_fields, refuse_sliding_window, refuse_unless
from components.engine.models.family import KVLayout
from components.engine.models.hf_layout import (
    decoder_tensors,
    layer_prefix,
    routed_expert_shapes,
    swiglu_names,
    swiglu_shapes,
)
from components.engine.models.layers import GatedMLP, MlpBlock, Rotary
from components.engine.models.moe import SparseMoE


class Qwen2MoeSparse(SparseMoE):
    def __init__(self, cfg, layer, ep):
        super().__init__(cfg, layer, ep)
        self.shared_expert = GatedMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def combine(self, x, d, out):
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return super().combine(x, d, out) + shared


class Qwen2MoeBlock(MlpBlock):
    def __init__(self, cfg, layer, ep, rotary):
        super().__init__(cfg, layer, rotary, bias=cfg.qkv_bias)
        if not cfg.sparse_layers[layer]:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.dense_intermediate_size)
        elif cfg.shared_expert_intermediate_size:
            self.mlp = Qwen2MoeSparse(cfg, layer, ep)
        else:
            self.mlp = SparseMoE(cfg, layer, ep)


class Qwen2Moe:
    name = "qwen2_moe"
    architectures = ("Qwen2MoeForCausalLM",)

    def config(self, c):
        refuse_sliding_window(c, on_by_default=False)
        refuse_unless(c, hidden_act="silu")
        common = common_fields(c)
        experts, layers = int(c["num_experts"]), common["num_layers"]
        mlp_only, step = set(c.get("mlp_only_layers") or ()), int(c.get("decoder_sparse_step", 1))
        return ModelConfig(
            architecture=self.name,
            **common,
            num_experts=experts,
            moe_intermediate_size=int(c["moe_intermediate_size"]),
            norm_topk_prob=bool(c.get("norm_topk_prob", False)),
            shared_expert_intermediate_size=int(c.get("shared_expert_intermediate_size") or 0),
            dense_intermediate_size=int(c["intermediate_size"]),
            sparse_layers=tuple(i not in mlp_only and experts > 0 and (i + 1) % step == 0 for i in range(layers)),
            qkv_bias=bool(c.get("qkv_bias", True)),
        )

    def rotary(self, cfg, max_len):
        return Rotary(cfg.head_dim, cfg.rope_theta, max_len)

    def block(self, cfg, layer, ep, rotary):
        return Qwen2MoeBlock(cfg, layer, ep, rotary)

    def router_name(self, cfg, layer: int) -> str:
        return f"{layer_prefix(layer)}.mlp.gate.weight"

    def expert_tensors(self, cfg, layer, expert):
        return swiglu_names(f"{layer_prefix(layer)}.mlp.experts.{expert}")

    def shared_expert_names(self, cfg, layer: int) -> tuple[str, str, str, str] | None:
        """(gate, up, down, shared_expert_gate) of a sparse layer's shared expert, None if it has none."""
        if cfg.shared_expert_intermediate_size <= 0 or not cfg.sparse_layers[layer]:
            return None
        p = f"{layer_prefix(layer)}.mlp"
        return (*swiglu_names(f"{p}.shared_expert"), f"{p}.shared_expert_gate.weight")

    def dense_mlp_names(self, cfg, layer: int) -> tuple[str, str, str]:
        """(gate, up, down) of a non-sparse layer's MLP."""
        if cfg.sparse_layers[layer]:
            raise ValueError(f"layer {layer} is sparse")
        return swiglu_names(f"{layer_prefix(layer)}.mlp")

    def tensors(self, cfg):
        H = cfg.hidden_size
        out = decoder_tensors(cfg, qkv_bias=cfg.qkv_bias)
        for i in range(cfg.num_layers):
            p = f"{layer_prefix(i)}.mlp"
            if not cfg.sparse_layers[i]:
                out.update(swiglu_shapes(p, H, cfg.dense_intermediate_size))
                continue
            out[self.router_name(cfg, i)] = (cfg.num_experts, H)
            out.update(routed_expert_shapes(cfg, self, i))
            if self.shared_expert_names(cfg, i):
                out.update(swiglu_shapes(f"{p}.shared_expert", H, cfg.shared_expert_intermediate_size))
                out[f"{p}.shared_expert_gate.weight"] = (1, H)
        return out

    def kv_layout(self, cfg):
        return KVLayout(cfg.num_kv_heads, cfg.head_dim, cfg.head_dim)


FAMILY = Qwen2Moe()
