"""Model configuration normalised from a Hugging Face config.json: the fields every family shares,
read here; each family (registry.FAMILIES) reads its own and builds the ModelConfig."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import msgspec

_DTYPES = {
    "float32": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16",
    "torch.float32": "float32",
    "torch.bfloat16": "bfloat16",
    "torch.float16": "float16",
    "float": "float32",
    "half": "float16",
}


class ConfigError(ValueError):
    """A config.json this engine cannot serve; the message names the file."""


class ModelConfig(msgspec.Struct, frozen=True):
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    shared_expert_intermediate_size: int
    dense_intermediate_size: int
    sparse_layers: tuple[bool, ...]
    qkv_bias: bool
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    dtype: str
    clip_qkv: float | None = None  # q, k and v clamped to +-clip_qkv after their projections (OLMoE)
    # FP8 checkpoints (quantization_config): the [rows, cols] block of each weight's scale.
    weight_block: tuple[int, int] | None = None
    # What only the family's own file reads: a frozen msgspec Struct it defines (MLA's dims, its
    # routing), None for families that need nothing beyond the fields above.
    params: Any = None

    @property
    def num_moe_layers(self) -> int:
        """The rows of the expert map and of a placement: one per sparse layer, in layer order."""
        return sum(self.sparse_layers)

    def identity(self) -> str:
        # msgspec encodes struct fields in declaration order, so the hash is stable.
        return hashlib.sha256(msgspec.json.encode(self)).hexdigest()


def read_json(path: Path) -> dict[str, Any]:
    """config.json as a dict, its eos from generation_config.json beside it where it has none."""
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: invalid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: invalid JSON (top level is not an object)")
    # eos often lives only in generation_config.json next to config.json.
    if raw.get("eos_token_id") is None:
        gen = path.parent / "generation_config.json"
        try:
            raw = {**raw, "eos_token_id": json.loads(gen.read_text()).get("eos_token_id")}
        except (OSError, ValueError, AttributeError):
            pass
    return raw


def rope_parameters(c: dict[str, Any]) -> dict[str, Any]:
    """RoPE's settings, as config.json spells them either way (`rope_parameters`, or the older
    `rope_scaling` beside a top-level `rope_theta`), with `rope_type` always set."""
    scaling, rope = c.get("rope_scaling") or {}, c.get("rope_parameters") or {}
    kinds = [p.get("rope_type", p.get("type")) for p in (rope, scaling)]
    return {**scaling, **rope, "rope_type": next((k for k in kinds if k not in (None, "default")), "default")}


def quantization_block(c: dict[str, Any]) -> tuple[int, int] | None:
    """The weight block of an FP8 block-quantised checkpoint (DeepSeek's published layout: e4m3
    weights, a `weight_scale_inv` per block), None for an unquantised one; any other scheme is
    refused naming it."""
    q = c.get("quantization_config")
    if not q:
        return None
    method, fmt, block = q.get("quant_method"), q.get("fmt", "e4m3"), q.get("weight_block_size")
    if method != "fp8" or fmt != "e4m3" or not block or len(block) != 2:
        raise ConfigError(
            f"unsupported quantization_config (quant_method={method!r}, fmt={fmt!r}, weight_block_size={block!r}): "
            "only fp8 e4m3 with a 2-d weight_block_size"
        )
    if q.get("activation_scheme", "dynamic") != "dynamic":
        raise ConfigError(f"unsupported quantization_config.activation_scheme {q['activation_scheme']!r}")
    return int(block[0]), int(block[1])


def common_fields(c: dict[str, Any], rope_types: tuple[str, ...] = ("default",)) -> dict[str, Any]:
    """The ModelConfig fields every family reads the same way; RoPE of `rope_types` only (a
    family that takes another reads its settings itself: rope_parameters)."""
    rope = c.get("rope_parameters") or {}
    kind = rope_parameters(c)["rope_type"]
    if kind not in rope_types:
        raise ConfigError(f"unsupported rope_type {kind!r} (only {', '.join(rope_types)})")
    theta = rope.get("rope_theta", c.get("rope_theta"))
    if theta is None:
        raise ConfigError("missing rope_theta")
    hidden, heads = int(c["hidden_size"]), int(c["num_attention_heads"])
    head_dim = c.get("head_dim")
    eos = c.get("eos_token_id")
    eos = () if eos is None else tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
    dtype_raw = str(c.get("dtype") or c.get("torch_dtype") or "float32")
    if dtype_raw not in _DTYPES:
        raise ConfigError(f"unsupported dtype {dtype_raw!r}")
    bos = c.get("bos_token_id")
    return dict(
        vocab_size=int(c["vocab_size"]),
        hidden_size=hidden,
        num_layers=int(c["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(c.get("num_key_value_heads") or heads),
        head_dim=int(head_dim) if head_dim is not None else hidden // heads,
        rms_norm_eps=float(c["rms_norm_eps"]),
        rope_theta=float(theta),
        max_position_embeddings=int(c["max_position_embeddings"]),
        top_k=int(c["num_experts_per_tok"]),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        eos_token_ids=eos,
        bos_token_id=None if bos is None else int(bos),
        dtype=_DTYPES[dtype_raw],
        weight_block=quantization_block(c),
    )


def refuse_sliding_window(c: dict[str, Any], on_by_default: bool) -> None:
    window = c.get("sliding_window")
    if window and c.get("use_sliding_window", on_by_default):
        raise ConfigError(f"sliding window attention (sliding_window={window}) is unsupported")


def refuse_unless(c: dict[str, Any], **implemented: Any) -> None:
    """Raise naming the first field set to a value other than the one the family implements
    (absent or null reads as that value)."""
    for field, ok in implemented.items():
        value = c.get(field)
        if value is not None and value != ok:
            raise ConfigError(f"{field}={value!r} is unsupported (only {ok!r})")
