"""DeepSeek-V3 (also R1, V3.1, Kimi-K2, Moonlight): multi-head latent attention (MLA) whose KV
cache holds the compressed latent, sigmoid routing biased for selection and limited to the best
expert groups, shared experts beside the routed ones, the first layers dense.

MLA. A token's keys and values are the `kv_lora_rank` latent c (normed) times kv_b_proj, and a
`qk_rope_head_dim` rotary key shared by every head. The cache keeps one row of [c, k_rope] per
token and layer (KVLayout(1, kv_lora_rank + qk_rope_head_dim, 0)), and attention runs on it
directly, kv_b_proj absorbed into the query and the output: head h's score is
(q_nope W_uk[h]) . c + q_rope . k_rope and its output (softmax . c) W_uv[h]: one multi-query
attention of 1 KV head, keys [c, k_rope], values c (a view of the same rows). The softmax scale is
1/sqrt(qk_nope + qk_rope) times yarn's mscale squared.

Routing. Scores are sigmoid(router logits) in fp32; `e_score_correction_bias` is added for the
choice only: with n_group groups, the best `topk_group` groups by the sum of their two best biased
scores stay, top_k experts are chosen among them, and their unbiased scores, renormalised
(norm_topk_prob), times routed_scaling_factor, weigh them. On CUDA the routing kernel computes
it (kernels.routing's GroupedSigmoid scoring, DeepseekMoE.scoring).

The MTP layer (num_nextn_predict_layers, tensors of layer index num_hidden_layers) is not served.
"""

from __future__ import annotations

import itertools
import logging
import math
from typing import Any

import msgspec
import torch
import torch.nn.functional as F
from torch import nn

from components.engine.models.config import ConfigError, ModelConfig, common_fields, rope_parameters
from components.engine.models.family import KVLayout
from components.engine.models.hf_layout import (
    embedding_and_norm_tensors,
    layer_prefix,
    routed_expert_shapes,
    swiglu_names,
    swiglu_shapes,
)
from components.engine.models.layers import ForwardBatch, GatedMLP, KVCache, MlpBlock, RMSNorm, Rotary, split_rows
from components.engine.models.moe import SparseMoE

log = logging.getLogger(__name__)

# transformers' DeepseekV3RMSNorm default: the q and kv latent norms do not take rms_norm_eps.
LATENT_NORM_EPS = 1e-6


class Yarn(msgspec.Struct, frozen=True):
    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float
    attention_factor: float  # multiplies the rotary tables
    truncate: bool


class GroupedRouting(msgspec.Struct, frozen=True):
    """The routing's settings (module docstring); GLM-4.5 routes the same way."""

    n_group: int
    topk_group: int
    routed_scaling_factor: float


class DeepseekParams(msgspec.Struct, frozen=True):
    q_lora_rank: int  # 0: queries straight from q_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    attention_bias: bool
    rope_interleave: bool
    yarn: Yarn | None
    softmax_scale: float
    routing: GroupedRouting


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _refuse(field: str, value: Any, why: str) -> None:
    raise ConfigError(f"unsupported {field}={value!r} ({why})")


def _yarn(rope: dict[str, Any], max_positions: int) -> tuple[Yarn, float]:
    """Yarn's settings, and the softmax scale's factor (mscale_all_dim's mscale squared), as
    transformers computes them (_compute_yarn_parameters, yarn_apply_mscale)."""
    original = int(rope["original_max_position_embeddings"])
    factor = rope.get("factor")
    factor = float(factor) if factor is not None else max_positions / original
    mscale, mscale_all = rope.get("mscale"), rope.get("mscale_all_dim")
    attention = rope.get("attention_factor")
    if attention is None:
        attention = _mscale(factor, mscale) / _mscale(factor, mscale_all) if mscale and mscale_all else _mscale(factor)
    yarn = Yarn(
        factor=factor,
        original_max_position_embeddings=original,
        beta_fast=float(rope.get("beta_fast") or 32),
        beta_slow=float(rope.get("beta_slow") or 1),
        attention_factor=float(attention),
        truncate=bool(rope.get("truncate", True)),
    )
    return yarn, _mscale(factor, mscale_all) ** 2 if mscale_all else 1.0


def yarn_inv_freq(dim: int, theta: float, y: Yarn) -> torch.Tensor:
    """Yarn's rotary frequencies for `dim` dims: interpolated below the correction range,
    extrapolated above it, a linear ramp between (transformers' _compute_yarn_parameters)."""

    def correction_dim(rotations):
        return dim * math.log(y.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(y.beta_fast), correction_dim(y.beta_slow)
    if y.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1 - ramp
    return (1.0 / (y.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Pairs (x0, x1), (x2, x3), ... laid out as (x0, x2, ..., x1, x3, ...): the rotate-half layout
    of DeepSeek's interleaved rotary. Queries and keys alike, so their dot product is unchanged."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


def latent_decode(query: torch.Tensor, cache: torch.Tensor, lora: int, slots, ctx_lens, kv_len: int, scale: float):
    """Decode attention of query [B, nh, lora + rope] over each row's first kv_len cache rows,
    masked past its context: a row's heads are the queries of its one latent KV head. The torch
    form decode_attention.latent_decode_attention is checked against, not the CPU path (its
    rounding depends on kv_len, the longest row's: layers.Attention). Returns [B, nh, lora]."""
    rows = cache[slots, :kv_len, 0]  # [B, kv_len, lora + rope]
    mask = (torch.arange(kv_len, device=query.device) < ctx_lens.unsqueeze(1)).unsqueeze(1)
    return F.scaled_dot_product_attention(query, rows, rows[..., :lora], attn_mask=mask, scale=scale)


def latent_prefill(query, cache, lora: int, batch: ForwardBatch, i: int, start: int, scale: float) -> torch.Tensor:
    """Sequence i of `batch` (its tokens start at `start`), causally over its cache slot: its
    (token, head) pairs as the queries of the one latent KV head. Returns [n, nh, lora]."""
    n, ctx, slot = batch.q_lens[i], batch.ctx_lens_list[i], batch.slots_list[i]
    _, nh, dim = query.shape
    rows = cache[slot, :ctx, 0].unsqueeze(0)  # [1, ctx, lora + rope]
    # Token j sits at absolute position ctx - n + j and sees keys up to that position.
    mask = None  # a decode's one token sees every key (layers.Attention._prefill)
    if n > 1:
        qpos = torch.arange(ctx - n, ctx, device=query.device).unsqueeze(1).expand(n, nh).reshape(n * nh, 1)
        mask = (torch.arange(ctx, device=query.device).unsqueeze(0) <= qpos).unsqueeze(0)
    q = query[start : start + n].reshape(1, n * nh, dim)
    out = F.scaled_dot_product_attention(q, rows, rows[..., :lora], attn_mask=mask, scale=scale)
    return out.view(n, nh, lora)


class LatentAttention(nn.Module):
    """MLA over a latent KV cache (module docstring); names as the checkpoint's `self_attn`."""

    def __init__(self, cfg: ModelConfig, layer: int, rotary: Rotary):
        super().__init__()
        p: DeepseekParams = cfg.params
        H, nh = cfg.hidden_size, cfg.num_heads
        self.nh, self.layer, self.p, self.rotary = nh, layer, p, rotary
        q_dim = nh * (p.qk_nope_head_dim + p.qk_rope_head_dim)
        if p.q_lora_rank:
            self.q_a_proj = nn.Linear(H, p.q_lora_rank, bias=p.attention_bias)
            self.q_a_layernorm = RMSNorm(p.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(p.q_lora_rank, q_dim, bias=False)
        else:
            self.q_proj = nn.Linear(H, q_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(H, p.kv_lora_rank + p.qk_rope_head_dim, bias=p.attention_bias)
        self.kv_a_layernorm = RMSNorm(p.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(p.kv_lora_rank, nh * (p.qk_nope_head_dim + p.v_head_dim), bias=False)
        self.o_proj = nn.Linear(nh * p.v_head_dim, H, bias=p.attention_bias)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        p, T, nh = self.p, x.shape[0], self.nh
        nope, rope, lora = p.qk_nope_head_dim, p.qk_rope_head_dim, p.kv_lora_rank
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if p.q_lora_rank else self.q_proj(x)
        q_nope, q_rope = q.view(T, nh, nope + rope).split([nope, rope], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([lora, rope], dim=-1)
        latent = self.kv_a_layernorm(latent)
        cache = kv.k[self.layer]  # [slots, max_len, 1, kv_lora_rank + qk_rope_head_dim]
        if x.is_cuda:  # one kernel: rotary of q and k, [latent, k] into the cache (torch: ~20)
            from components.engine.kernels.latent_cache import latent_rotary_cache_write

            cos, sin = self.rotary.cos, self.rotary.sin
            q_rope = latent_rotary_cache_write(
                q_rope, k_rope, latent, cos, sin, batch.positions, batch.token_slots, cache, p.rope_interleave
            )
        else:
            k_rope = k_rope.unsqueeze(1)
            if p.rope_interleave:
                q_rope, k_rope = _deinterleave(q_rope), _deinterleave(k_rope)
            q_rope, k_rope = self.rotary(q_rope, batch.positions), self.rotary(k_rope, batch.positions)
            cache[batch.token_slots, batch.positions] = torch.cat((latent.unsqueeze(1), k_rope), dim=-1)
        w = self.kv_b_proj.weight.view(nh, nope + p.v_head_dim, lora)
        # q_nope through each head's key up-projection: a query in latent space [T, nh, lora].
        q_latent = split_rows(lambda q: torch.bmm(q.transpose(0, 1), w[:, :nope]).transpose(0, 1), q_nope)
        scale = p.softmax_scale
        if batch.decode_only and q_latent.is_cuda:  # reads each row's cache in place up to its own context
            from components.engine.kernels.decode_attention import latent_decode_attention

            out = latent_decode_attention(q_latent, q_rope, cache, batch.slots, batch.ctx_lens, scale)
        else:  # a sequence at a time, decodes too, as layers.Attention says why
            query = torch.cat((q_latent, q_rope), dim=-1)
            starts = itertools.accumulate(batch.q_lens[:-1], initial=0)
            out = torch.cat([latent_prefill(query, cache, lora, batch, i, s, scale) for i, s in enumerate(starts)])
        # Each head's latent output through its value up-projection: [T, nh, v_head_dim].
        out = split_rows(lambda o: torch.bmm(o.transpose(0, 1), w[:, nope:].transpose(1, 2)).transpose(0, 1), out)
        return self.o_proj(out.reshape(T, nh * p.v_head_dim))


class Router(nn.Module):
    """The router's weight and its selection bias (`gate`), in fp32 whatever the model's dtype,
    as transformers keeps them (_keep_in_fp32_modules_strict): in bf16, biased scores a bf16 step
    apart (2^-8 near 1) would choose other experts."""

    def __init__(self, hidden: int, experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(experts, hidden, dtype=torch.float32))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(experts, dtype=torch.float32))

    def _apply(self, fn, recurse=True):
        # Module.to(dtype) of the whole model reaches here: moves apply, the dtype does not.
        return super()._apply(lambda t: fn(t).float(), recurse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The router logits, in fp32 (a projection: split as a mixed step's rows are, layers.split_rows)."""
        return split_rows(lambda r: F.linear(r.float(), self.weight), x)


class DeepseekMoE(SparseMoE):
    """The routed and shared experts of a sparse layer; `cfg.params.routing` says how it routes."""

    def __init__(self, cfg: ModelConfig, layer: int, ep):
        super().__init__(cfg, layer, ep)
        self.p: GroupedRouting = cfg.params.routing
        self.gate = Router(cfg.hidden_size, cfg.num_experts)
        self.shared_experts = (
            GatedMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
            if cfg.shared_expert_intermediate_size
            else None
        )

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        p, T, E = self.p, x.shape[0], self.gate.weight.shape[0]
        scores = self.gate(x).sigmoid()
        choice = scores + self.gate.e_score_correction_bias
        if p.n_group > 1:
            groups = choice.view(T, p.n_group, E // p.n_group)
            best = torch.topk(groups.topk(2, dim=-1)[0].sum(dim=-1), p.topk_group, dim=-1)[1]
            keep = torch.zeros(T, p.n_group, dtype=torch.bool, device=x.device).scatter_(1, best, True)
            keep = keep.unsqueeze(-1).expand(T, p.n_group, E // p.n_group).reshape(T, E)
            choice = choice.masked_fill(~keep, float("-inf"))
        experts = torch.topk(choice, self.top_k, dim=-1)[1]
        weights = scores.gather(1, experts)
        if self.norm_topk:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return (weights * p.routed_scaling_factor).to(x.dtype), experts

    def scoring(self):
        from components.engine.kernels.routing import GroupedSigmoid

        p = self.p
        return GroupedSigmoid(self.gate.e_score_correction_bias, p.n_group, p.topk_group, p.routed_scaling_factor)

    def combine(self, x, d, out):
        routed = super().combine(x, d, out)
        return routed if self.shared_experts is None else routed + self.shared_experts(x)


class DeepseekBlock(MlpBlock):
    def __init__(self, cfg, layer, ep, rotary):
        super().__init__(cfg, layer, rotary, bias=cfg.qkv_bias)
        sparse = cfg.sparse_layers[layer]
        self.mlp = DeepseekMoE(cfg, layer, ep) if sparse else GatedMLP(cfg.hidden_size, cfg.dense_intermediate_size)

    def attention(self, cfg, layer, rotary, bias):
        return LatentAttention(cfg, layer, rotary)


def grouped_moe(c: dict[str, Any], family: str) -> tuple[dict[str, Any], GroupedRouting]:
    """The ModelConfig fields of DeepSeek's MoE layout as config.json spells them (GLM-4.5's
    too): routed and shared experts, the first `first_k_dense_replace` layers dense; and its
    routing. The MTP layers are skipped, with a log line."""
    experts, layers = int(c["n_routed_experts"]), int(c["num_hidden_layers"])
    n_group, topk_group = int(c.get("n_group") or 1), int(c.get("topk_group") or 1)
    if experts % n_group or not 1 <= topk_group <= n_group:
        why = f"n_routed_experts={experts} in n_group groups, topk_group={topk_group} of them"
        _refuse("n_group", n_group, why)
    if n_group > 1 and experts // n_group < 2:
        _refuse("n_group", n_group, "a group's score is its two best experts: at least 2 experts a group")
    mtp = int(c.get("num_nextn_predict_layers") or 0)
    if mtp:
        log.info("%s: %d MTP layer(s) (layer index %d on) skipped: no speculative decoding", family, mtp, layers)
    first_dense = int(c.get("first_k_dense_replace") or 0)
    fields = dict(
        num_experts=experts,
        moe_intermediate_size=int(c["moe_intermediate_size"]),
        norm_topk_prob=bool(c.get("norm_topk_prob", True)),
        shared_expert_intermediate_size=int(c["moe_intermediate_size"]) * int(c.get("n_shared_experts") or 0),
        dense_intermediate_size=int(c["intermediate_size"]),
        sparse_layers=tuple(i >= first_dense for i in range(layers)),
    )
    return fields, GroupedRouting(n_group, topk_group, float(c.get("routed_scaling_factor", 1.0)))


# Fields whose value changes the math, and the values this file implements.
_ONLY = {
    "hidden_act": ("silu",),
    "moe_layer_freq": (1,),
    "topk_method": ("noaux_tc",),
    "scoring_func": ("sigmoid",),
    "partial_rotary_factor": (1, 1.0),
}


class DeepseekV3:
    name = "deepseek_v3"
    architectures = ("DeepseekV3ForCausalLM",)

    def config(self, c):
        for field, values in _ONLY.items():
            if c.get(field) is not None and c[field] not in values:
                _refuse(field, c[field], f"only {', '.join(map(repr, values))}")
        common = common_fields(c, rope_types=("default", "yarn"))
        heads = common["num_heads"]
        if common["num_kv_heads"] != heads:
            _refuse("num_key_value_heads", common["num_kv_heads"], f"MLA needs it equal to num_attention_heads={heads}")
        rope = rope_parameters(c)
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            _refuse("rope_parameters.partial_rotary_factor", rope["partial_rotary_factor"], "only 1.0")
        nope, rot = int(c["qk_nope_head_dim"]), int(c["qk_rope_head_dim"])
        yarn, mscale2 = _yarn(rope, common["max_position_embeddings"]) if rope["rope_type"] == "yarn" else (None, 1.0)
        moe, routing = grouped_moe(c, self.name)
        params = DeepseekParams(
            q_lora_rank=int(c.get("q_lora_rank") or 0),
            kv_lora_rank=int(c["kv_lora_rank"]),
            qk_nope_head_dim=nope,
            qk_rope_head_dim=rot,
            v_head_dim=int(c["v_head_dim"]),
            attention_bias=bool(c.get("attention_bias", False)),
            rope_interleave=bool(c.get("rope_interleave", True)),
            yarn=yarn,
            softmax_scale=(nope + rot) ** -0.5 * mscale2,
            routing=routing,
        )
        return ModelConfig(
            architecture=self.name,
            **{**common, "head_dim": nope + rot},
            **moe,
            qkv_bias=False,
            params=params,
        )

    def rotary(self, cfg, max_len):
        p: DeepseekParams = cfg.params
        if p.yarn is None:
            return Rotary(p.qk_rope_head_dim, cfg.rope_theta, max_len)
        inv_freq = yarn_inv_freq(p.qk_rope_head_dim, cfg.rope_theta, p.yarn)
        return Rotary(p.qk_rope_head_dim, cfg.rope_theta, max_len, inv_freq, p.yarn.attention_factor)

    def block(self, cfg, layer, ep, rotary):
        return DeepseekBlock(cfg, layer, ep, rotary)

    def expert_tensors(self, cfg, layer, expert):
        return swiglu_names(f"{layer_prefix(layer)}.mlp.experts.{expert}")

    def tensors(self, cfg):
        p: DeepseekParams = cfg.params
        H, nh = cfg.hidden_size, cfg.num_heads
        out = embedding_and_norm_tensors(cfg)
        q_dim = nh * (p.qk_nope_head_dim + p.qk_rope_head_dim)
        for i in range(cfg.num_layers):
            a = f"{layer_prefix(i)}.self_attn"
            if p.q_lora_rank:
                out[f"{a}.q_a_proj.weight"] = (p.q_lora_rank, H)
                out[f"{a}.q_a_layernorm.weight"] = (p.q_lora_rank,)
                out[f"{a}.q_b_proj.weight"] = (q_dim, p.q_lora_rank)
            else:
                out[f"{a}.q_proj.weight"] = (q_dim, H)
            out[f"{a}.kv_a_proj_with_mqa.weight"] = (p.kv_lora_rank + p.qk_rope_head_dim, H)
            out[f"{a}.kv_a_layernorm.weight"] = (p.kv_lora_rank,)
            out[f"{a}.kv_b_proj.weight"] = (nh * (p.qk_nope_head_dim + p.v_head_dim), p.kv_lora_rank)
            out[f"{a}.o_proj.weight"] = (H, nh * p.v_head_dim)
            if p.attention_bias:
                if p.q_lora_rank:
                    out[f"{a}.q_a_proj.bias"] = (p.q_lora_rank,)
                out[f"{a}.kv_a_proj_with_mqa.bias"] = (p.kv_lora_rank + p.qk_rope_head_dim,)
                out[f"{a}.o_proj.bias"] = (H,)
            out.update(self.mlp_tensors(cfg, i))
        return out

    def mlp_tensors(self, cfg, layer: int) -> dict[str, tuple[int, ...]]:
        """Layer `layer`'s feed-forward: a dense MLP, or the router, routed and shared experts."""
        H, m = cfg.hidden_size, f"{layer_prefix(layer)}.mlp"
        if not cfg.sparse_layers[layer]:
            return swiglu_shapes(m, H, cfg.dense_intermediate_size)
        out = {f"{m}.gate.weight": (cfg.num_experts, H), f"{m}.gate.e_score_correction_bias": (cfg.num_experts,)}
        out.update(routed_expert_shapes(cfg, self, layer))
        if cfg.shared_expert_intermediate_size:
            out.update(swiglu_shapes(f"{m}.shared_experts", H, cfg.shared_expert_intermediate_size))
        return out

    def kv_layout(self, cfg):
        p: DeepseekParams = cfg.params
        return KVLayout(1, p.kv_lora_rank + p.qk_rope_head_dim, 0)


def expanded_kv_layout(cfg: ModelConfig) -> KVLayout:
    """The cache MLA avoids: every head's keys and values up-projected, as GQA would keep them."""
    p: DeepseekParams = cfg.params
    return KVLayout(cfg.num_heads, p.qk_nope_head_dim + p.qk_rope_head_dim, p.v_head_dim)


FAMILY = DeepseekV3()
