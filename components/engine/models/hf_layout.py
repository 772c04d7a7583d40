"""Tensor names and shapes of the Hugging Face decoder layout the families share: embeddings,
norms, q/k/v/o attention, SwiGLU MLPs (`gate_proj`/`up_proj`/`down_proj`)."""

from __future__ import annotations

from components.engine.models.config import ModelConfig


def layer_prefix(i: int) -> str:
    return f"model.layers.{i}"


def swiglu_names(prefix: str) -> tuple[str, str, str]:
    """(gate, up, down) of the SwiGLU MLP at `prefix`."""
    return f"{prefix}.gate_proj.weight", f"{prefix}.up_proj.weight", f"{prefix}.down_proj.weight"


def swiglu_shapes(prefix: str, hidden: int, intermediate: int) -> dict[str, tuple[int, ...]]:
    g, u, d = swiglu_names(prefix)
    return {g: (intermediate, hidden), u: (intermediate, hidden), d: (hidden, intermediate)}


def embedding_and_norm_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Embeddings, final norm, lm_head, and each layer's two norms."""
    H, V = cfg.hidden_size, cfg.vocab_size
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (V, H)
    for i in range(cfg.num_layers):
        out[f"{layer_prefix(i)}.input_layernorm.weight"] = (H,)
        out[f"{layer_prefix(i)}.post_attention_layernorm.weight"] = (H,)
    return out


def decoder_tensors(cfg: ModelConfig, qkv_bias: bool) -> dict[str, tuple[int, ...]]:
    """embedding_and_norm_tensors, and each layer's GQA attention."""
    H, D = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_heads * D, cfg.num_kv_heads * D
    out = embedding_and_norm_tensors(cfg)
    for i in range(cfg.num_layers):
        a = f"{layer_prefix(i)}.self_attn"
        out.update({f"{a}.q_proj.weight": (q, H), f"{a}.k_proj.weight": (kv, H)})
        out.update({f"{a}.v_proj.weight": (kv, H), f"{a}.o_proj.weight": (H, q)})
        if qkv_bias:
            out.update({f"{a}.q_proj.bias": (q,), f"{a}.k_proj.bias": (kv,), f"{a}.v_proj.bias": (kv,)})
    return out


def routed_expert_shapes(cfg: ModelConfig, family, layer: int) -> dict[str, tuple[int, ...]]:
    """Every routed expert of a sparse layer, under the names `family` gives them."""
    H, I = cfg.hidden_size, cfg.moe_intermediate_size
    out = {}
    for e in range(cfg.num_experts):
        g, u, d = family.expert_tensors(cfg, layer, e)
        out.update({g: (I, H), u: (I, H), d: (H, I)})
    return out
