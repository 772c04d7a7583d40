"""The model-family seam: what the rank needs of an architecture family, and of a model built
from one.

A family is one file in this folder (mixtral.py, qwen2_moe.py, ...) holding its decoder block and
a `ModelFamily` object, and one line in registry.FAMILIES. The rank never branches on the
architecture: it reads the config through the family (refusing what the file does not implement),
checks the checkpoint against the family's tensor list, sizes the KV cache by its layout, loads
routed experts by the names the family gives them, and steps the model the transformer builds
from the family's blocks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn

    from components.engine.models.config import ModelConfig
    from components.engine.models.layers import ForwardBatch, KVCache


class KVLayout(NamedTuple):
    """What one token of one layer keeps in the KV cache: `heads` rows of `k_dim` keys and
    `v_dim` values."""

    heads: int
    k_dim: int
    v_dim: int

    def bytes_per_token(self, num_layers: int, itemsize: int) -> int:
        return num_layers * self.heads * (self.k_dim + self.v_dim) * itemsize


class ModelFamily(Protocol):
    name: str  # ModelConfig.architecture
    architectures: tuple[str, ...]  # the config.json `architectures` entries it serves

    def config(self, c: dict[str, Any]) -> ModelConfig:
        """The normalised config of a config.json dict; a field this family does not implement,
        set to a value that changes the math, raises ConfigError naming it."""

    def rotary(self, cfg: ModelConfig, max_len: int) -> nn.Module:
        """The position embedding every block of a model shares."""

    def block(self, cfg: ModelConfig, layer: int, ep, rotary: nn.Module) -> nn.Module:
        """Decoder block `layer` (a layers.DecoderBlock: `attend`, `ffn`, `moe`)."""

    def tensors(self, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        """Every tensor the checkpoint must hold, by name, with its shape."""

    def expert_tensors(self, cfg: ModelConfig, layer: int, expert: int) -> tuple[str, str, str]:
        """(gate, up, down) weight names of one routed expert."""

    def kv_layout(self, cfg: ModelConfig) -> KVLayout: ...


class EngineModel(Protocol):
    """A built model as the rank steps it (transformer.MoETransformer)."""

    cfg: ModelConfig
    ep: Any  # moe.ExpertParallel

    def __call__(self, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        """Logits (fp32) of each sequence's last token: [B, vocab]."""

    @property
    def moe_layers(self) -> list[tuple[int, nn.Module]]:
        """(placement row, MoE layer) of each sparse layer (moe.layer: its index in the model)."""

    def dummy_step(self) -> None: ...

    def load_dense(self, ckpt) -> None: ...

    def load_experts(self, ckpt, placement, rank: int, since=None) -> None: ...
