"""Mixtral: attention without bias, every layer a top-k sparse MoE (`block_sparse_moe`)."""

from components.engine.layers import DecoderBlock
from components.engine.moe import SparseMoE


class MixtralBlock(DecoderBlock):
    def __init__(self, cfg, layer, ep, rotary):
        super().__init__(cfg, layer, rotary, bias=False)
        self.block_sparse_moe = SparseMoE(cfg, layer, ep)

    @property
    def ffn(self):
        return self.block_sparse_moe

    moe = ffn
