"""Model configuration normalised from a Hugging Face config.json (Mixtral, Qwen2-MoE)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import msgspec

ARCHITECTURES = {"MixtralForCausalLM": "mixtral", "Qwen2MoeForCausalLM": "qwen2_moe"}
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

    @classmethod
    def from_hf(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
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
        try:
            return cls.from_dict(raw)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"{path}: malformed config ({type(e).__name__}: {e})") from None

    @classmethod
    def from_dict(cls, c: dict[str, Any]) -> ModelConfig:
        """Errors here carry no file name; from_hf adds it."""
        archs = c.get("architectures") or []
        known = [ARCHITECTURES[a] for a in archs if a in ARCHITECTURES]
        if not known:
            shown = archs[0] if len(archs) == 1 else (archs or c.get("model_type"))
            raise ConfigError(f"unknown architecture {shown!r} (supported: {', '.join(ARCHITECTURES)})")
        arch = known[0]

        rope = c.get("rope_parameters") or {}
        scaling = c.get("rope_scaling") or {}
        for params in (rope, scaling):
            kind = params.get("rope_type", params.get("type", "default"))
            if kind not in ("default", None):
                raise ConfigError(f"unsupported rope_type {kind!r} (only default RoPE)")
        theta = rope.get("rope_theta", c.get("rope_theta"))
        if theta is None:
            raise ConfigError("missing rope_theta")

        # Mixtral has no use_sliding_window flag: a set sliding_window is in force.
        window = c.get("sliding_window")
        if window and c.get("use_sliding_window", arch == "mixtral"):
            raise ConfigError(f"sliding window attention (sliding_window={window}) is unsupported")

        hidden, heads = int(c["hidden_size"]), int(c["num_attention_heads"])
        layers = int(c["num_hidden_layers"])
        head_dim = c.get("head_dim")
        head_dim = int(head_dim) if head_dim is not None else hidden // heads

        if arch == "mixtral":
            experts, moe_inter = int(c["num_local_experts"]), int(c["intermediate_size"])
            norm_topk, shared, dense = True, 0, 0
            sparse = (True,) * layers
            qkv_bias = False
        else:
            experts, moe_inter = int(c["num_experts"]), int(c["moe_intermediate_size"])
            norm_topk = bool(c.get("norm_topk_prob", False))
            shared = int(c.get("shared_expert_intermediate_size") or 0)
            dense = int(c["intermediate_size"])
            mlp_only, step = set(c.get("mlp_only_layers") or ()), int(c.get("decoder_sparse_step", 1))
            sparse = tuple(i not in mlp_only and experts > 0 and (i + 1) % step == 0 for i in range(layers))
            qkv_bias = bool(c.get("qkv_bias", True))

        eos = c.get("eos_token_id")
        eos = () if eos is None else tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
        dtype_raw = str(c.get("dtype") or c.get("torch_dtype") or "float32")
        if dtype_raw not in _DTYPES:
            raise ConfigError(f"unsupported dtype {dtype_raw!r}")
        bos = c.get("bos_token_id")

        return cls(
            architecture=arch,
            vocab_size=int(c["vocab_size"]),
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(c.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rms_norm_eps=float(c["rms_norm_eps"]),
            rope_theta=float(theta),
            max_position_embeddings=int(c["max_position_embeddings"]),
            num_experts=experts,
            top_k=int(c["num_experts_per_tok"]),
            moe_intermediate_size=moe_inter,
            norm_topk_prob=norm_topk,
            shared_expert_intermediate_size=shared,
            dense_intermediate_size=dense,
            sparse_layers=sparse,
            qkv_bias=qkv_bias,
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            eos_token_ids=eos,
            bos_token_id=None if bos is None else int(bos),
            dtype=_DTYPES[dtype_raw],
        )

    def identity(self) -> str:
        # msgspec encodes struct fields in declaration order, so the hash is stable.
        return hashlib.sha256(msgspec.json.encode(self)).hexdigest()
