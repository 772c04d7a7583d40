"""The decoder-only MoE transformer shared by the architectures; each family (registry.py) gives
its decoder blocks and position embedding. Module names follow the Hugging Face checkpoints, so
the parameters load by name (`named_parameters()` == checkpoint names) and the same list drives
peer weight pulls."""

from __future__ import annotations

import torch
from torch import nn

from components.engine.models.checkpoint import Checkpoint
from components.engine.models.config import ModelConfig
from components.engine.models.layers import ForwardBatch, KVCache, RMSNorm
from components.engine.models.moe import ExpertParallel, SparseMoE
from components.engine.models.registry import family
from components.protocol.placement import Placement


class _Body(nn.Module):
    def __init__(self, cfg: ModelConfig, ep: ExpertParallel, max_len: int):
        super().__init__()
        fam = family(cfg)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        rotary = fam.rotary(cfg, max_len)
        self.layers = nn.ModuleList(fam.block(cfg, i, ep, rotary) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MoETransformer(nn.Module):
    def __init__(self, cfg: ModelConfig, ep: ExpertParallel, max_len: int):
        super().__init__()
        self.cfg, self.ep = cfg, ep
        self.model = _Body(cfg, ep, max_len)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def moe_layers(self) -> list[tuple[int, SparseMoE]]:
        """(row, layer) of each MoE layer: its row of the expert map and of placements (their
        order among the MoE layers; the layer's own index in the model is `moe.layer`)."""
        return [(b.moe.row, b.moe) for b in self.model.layers if b.moe is not None]

    def forward(self, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        """Logits (fp32) of each sequence's last token: [B, vocab]."""
        x = self.model.embed_tokens(batch.input_ids)
        for block in self.model.layers:
            x = block(x, batch, kv)
        x = self.model.norm(x[batch.last_index])
        return self.lm_head(x).float()

    def dummy_step(self) -> None:
        """Take part in every MoE collective with no tokens of our own (an idle rank)."""
        x = torch.zeros(0, self.cfg.hidden_size, dtype=self.lm_head.weight.dtype, device=self.lm_head.weight.device)
        for _, moe in self.moe_layers:
            moe(x)

    def load_dense(self, ckpt: Checkpoint) -> None:
        with torch.no_grad():
            for name, p in self.named_parameters():
                p.copy_(ckpt.get(name, dtype=p.dtype, device=p.device))

    def load_experts(self, ckpt: Checkpoint, placement: Placement, rank: int, since: Placement | None = None) -> None:
        """Fill this rank's slots with the experts the placement puts there; with `since`, only
        the slots whose expert differs from it."""
        tensor_names = family(self.cfg).expert_tensors
        with torch.no_grad():
            for row, moe in self.moe_layers:
                before = since.experts_on(rank, row) if since else None
                for slot, expert in enumerate(placement.experts_on(rank, row)):
                    if expert >= 0 and (before is None or before[slot] != expert):
                        names = tensor_names(self.cfg, moe.layer, expert)
                        parts = (ckpt.get(n, dtype=moe.w_gate.dtype, device=moe.w_gate.device) for n in names)
                        moe.load_slot(slot, *parts)


def build_model(cfg: ModelConfig, ep: ExpertParallel, max_len: int, dtype, device) -> MoETransformer:
    # Built in its dtype rather than converted after: each float32 expert buffer, freed by the
    # conversion, left a segment that torch's allocator carved later small tensors from, which
    # pinned it (1.8 GB of a 5.4 GiB model's rank, kept in every snapshot image too).
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = MoETransformer(cfg, ep, max_len)
    finally:
        torch.set_default_dtype(default)
    return model.to(dtype=dtype).eval()  # the rotary tables, computed in float32
