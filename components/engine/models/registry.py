"""The architecture families this engine serves, keyed by config.json's `architectures`: adding a
family is its file in this folder and one line here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from components.engine.models import deepseek_v3, glm4_moe, mixtral, olmoe, qwen2_moe, qwen3_moe
from components.engine.models.config import ConfigError, ModelConfig, read_json
from components.engine.models.family import ModelFamily

FAMILIES: tuple[ModelFamily, ...] = (
    mixtral.FAMILY,
    qwen2_moe.FAMILY,
    qwen3_moe.FAMILY,
    olmoe.FAMILY,
    deepseek_v3.FAMILY,
    glm4_moe.FAMILY,
)

BY_ARCHITECTURE: dict[str, ModelFamily] = {a: f for f in FAMILIES for a in f.architectures}
_BY_NAME: dict[str, ModelFamily] = {f.name: f for f in FAMILIES}


def family(cfg: ModelConfig) -> ModelFamily:
    return _BY_NAME[cfg.architecture]


def config_from_dict(c: dict[str, Any]) -> ModelConfig:
    """Errors here carry no file name; read_config adds it."""
    archs = c.get("architectures") or []
    known = [BY_ARCHITECTURE[a] for a in archs if a in BY_ARCHITECTURE]
    if not known:
        shown = archs[0] if len(archs) == 1 else (archs or c.get("model_type"))
        raise ConfigError(f"unknown architecture {shown!r} (supported: {', '.join(BY_ARCHITECTURE)})")
    return known[0].config(c)


def read_config(path: str | Path) -> ModelConfig:
    path = Path(path)
    raw = read_json(path)
    try:
        return config_from_dict(raw)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"{path}: malformed config ({type(e).__name__}: {e})") from None


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    return family(cfg).tensors(cfg)
