"""Building blocks shared by the model files: norm, rotary embedding, attention over a KV cache."""

from __future__ import annotations

import itertools
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from components.engine.models.moe import SparseMoE


def with_pending(ids: torch.Tensor, src: torch.Tensor, drawn: torch.Tensor) -> torch.Tensor:
    """`ids`, each row with a `src` >= 0 taking `drawn[src]` instead: the token the step before
    drew for it, not yet read back when this step was queued (StepRows.src)."""
    return torch.where(src >= 0, drawn[src.clamp(min=0)], ids)


_split = threading.local()


@contextmanager
def rows_split_at(n: int, piece: int = 0):
    """Inside: `split_rows` computes rows [:n] of a batch apart from the rest, and the rest in
    calls of `piece` rows each (all of it in one call without a piece): a mixed graph's capture,
    cuda_graphs.DecodeGraphs."""
    _split.n, _split.piece = n, piece
    try:
        yield
    finally:
        _split.n = _split.piece = 0


def split_rows(fn, x: torch.Tensor) -> torch.Tensor:
    """fn(x) for an fn that maps rows to rows (a projection): under `rows_split_at(n, piece)`,
    rows [:n] in a call of their own and the rest in calls of `piece` rows. cuBLAS picks its
    kernel, and so a row's rounding, by the row count: the decodes of a mixed step then meet the
    kernels of a decode-only step of max_seqs rows, and a prompt token those of one piece,
    whatever the step holds and whichever mixed graph (a whole number of pieces) it runs in."""
    n, piece = getattr(_split, "n", 0), getattr(_split, "piece", 0)
    if not n or x.shape[0] <= n:
        return fn(x)
    rest = x[n:]
    parts = rest.split(piece) if piece else (rest,)
    return torch.cat((fn(x[:n]), *(fn(r) for r in parts)))


def prompt_rows_from() -> int | None:
    """Under `rows_split_at(n, ...)` (a mixed graph's capture): n, where the prompt rows begin."""
    return getattr(_split, "n", 0) or None


class SplitLinear(nn.Linear):
    """nn.Linear under `split_rows` (DecodeGraphs turns a model's nn.Linear into these)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return split_rows(super().forward, x)


class StepRows(NamedTuple):
    """One step's rows as the scheduler picks them, on the host. Sequence i contributes
    `q_lens[i]` tokens; the decode graphs take these lists as they are (one copy into their
    static inputs), the eager forward takes them on the device (`on`)."""

    ids: list[int]  # [T]
    positions: list[int]  # [T]
    token_slots: list[int]  # [T] KV slot of each token's sequence
    slots: list[int]  # [B] KV slot of each sequence
    ctx_lens: list[int]  # [B] context length once this step has written its tokens
    last_index: list[int]  # [B] index in T of each sequence's last token
    q_lens: list[int]  # [B]
    # [T] -1, or the row of the step still in flight whose drawn token is this row's (its id is
    # a placeholder): the step reads it on the device, so it can be queued before that is read.
    src: list[int] | None = None

    @property
    def decode_only(self) -> bool:
        return all(n == 1 for n in self.q_lens)

    @property
    def reads_pending(self) -> bool:
        return self.src is not None and any(s >= 0 for s in self.src)

    def on(self, device, drawn: torch.Tensor | None = None) -> ForwardBatch:
        """On `device`; `drawn`: the draws of the step in flight, where `src` rows read."""

        def t(v):
            return torch.tensor(v, dtype=torch.int64, device=device)

        ids = t(self.ids)
        if self.reads_pending:
            ids = with_pending(ids, t(self.src), drawn)
        return ForwardBatch(
            input_ids=ids,
            positions=t(self.positions),
            token_slots=t(self.token_slots),
            slots=t(self.slots),
            ctx_lens=t(self.ctx_lens),
            last_index=t(self.last_index),
            q_lens=self.q_lens,
            ctx_lens_list=self.ctx_lens,
            slots_list=self.slots,
        )


@dataclass
class ForwardBatch:
    """One engine step: the new tokens of every scheduled sequence, flattened.

    Sequence i contributes `q_lens[i]` tokens (a prefill chunk or one decode token) and has
    `ctx_lens[i]` tokens in its KV cache once this step has written them."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    token_slots: torch.Tensor  # [T] KV slot of each token's sequence
    slots: torch.Tensor  # [B] KV slot of each sequence
    ctx_lens: torch.Tensor  # [B]
    last_index: torch.Tensor  # [B] index in T of each sequence's last token
    q_lens: list[int]
    ctx_lens_list: list[int]
    slots_list: list[int]  # `slots` on the host: prefill slices by it without a device sync

    @property
    def decode_only(self) -> bool:
        return all(n == 1 for n in self.q_lens)


class KVCache:
    """Per-layer K and V for `max_seqs` sequences of up to `max_len` tokens, allocated once, as the
    family's layout (family.KVLayout) says."""

    def __init__(self, num_layers, max_seqs, max_len, layout, dtype, device):
        def zeros(dim):
            return torch.zeros((max_seqs, max_len, layout.heads, dim), dtype=dtype, device=device)

        self.k = [zeros(layout.k_dim) for _ in range(num_layers)]
        self.v = [zeros(layout.v_dim) for _ in range(num_layers)]
        self.max_seqs, self.max_len = max_seqs, max_len


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:  # one kernel where torch launches eight
            from components.engine.kernels.norm import rms_norm

            return rms_norm(x, self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, norm(h)) for h = x + residual: one kernel on CUDA (the add fused into the norm)."""
        if x.is_cuda:
            from components.engine.kernels.norm import add_rms_norm

            return add_rms_norm(x, residual, self.weight, self.eps)
        h = x + residual
        return h, self(h)


class Rotary(nn.Module):
    """HF-style rotary embedding (rotate_half over split halves), table computed in fp32. Its
    tables are `dim` wide: a wider x is rotated in its first `dim` dims and passes the
    rest (partial rotary, as transformers' apply_rotary_pos_emb reads the width off the tables)."""

    def __init__(self, dim: int, theta: float, max_len: int, inv_freq: torch.Tensor | None = None, scale: float = 1.0):
        """`dim`: the rotated dims of a head; `inv_freq`: frequencies of a scaled RoPE (yarn) in place
        of theta's; `scale` multiplies the tables (yarn's attention factor)."""
        super().__init__()
        # Computed on the host, then moved to the default device: on a GPU the first launch of
        # each of these ops, which serving never runs again, would load its kernel module, and
        # the driver keeps about 100 MB of host memory for them, carried by every snapshot image.
        dev, cpu = torch.get_default_device(), torch.device("cpu")
        if inv_freq is None:
            inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=cpu).float() / dim))
        inv_freq = inv_freq.to(cpu)  # a family's own (yarn) may come from the default device
        freqs = torch.outer(torch.arange(max_len, dtype=torch.float32, device=cpu), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", (emb.cos() * scale).to(dev), persistent=False)
        self.register_buffer("sin", (emb.sin() * scale).to(dev), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        dim = self.cos.shape[-1]
        if x.shape[-1] > dim:
            return torch.cat((self(x[..., :dim], positions), x[..., dim:]), dim=-1)
        cos = self.cos[positions].unsqueeze(1).to(x.dtype)
        sin = self.sin[positions].unsqueeze(1).to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def gathered_decode(q, kc, vc, slots: torch.Tensor, ctx_lens: torch.Tensor, kv_len: int) -> torch.Tensor:
    """Decode attention of q [B, nh, hd] over the first kv_len positions of each row's cache slot,
    copied out, with a length mask: the torch form decode_attention.py's kernel is checked and
    timed against. Not the CPU path: its rounding depends on kv_len and on the row count."""
    keys = kc[slots, :kv_len].transpose(1, 2)
    vals = vc[slots, :kv_len].transpose(1, 2)
    mask = (torch.arange(kv_len, device=q.device) < ctx_lens.unsqueeze(1))[:, None, None, :]
    out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, vals, attn_mask=mask, enable_gqa=True)
    return out.squeeze(2)


class Attention(nn.Module):
    def __init__(self, hidden, num_heads, num_kv_heads, head_dim, bias: bool, rotary: Rotary, layer: int):
        super().__init__()
        self.nh, self.nkv, self.hd, self.layer = num_heads, num_kv_heads, head_dim, layer
        self.q_proj = nn.Linear(hidden, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden, bias=False)
        self.rotary = rotary

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, nh, hd], k and v [T, nkv, hd] of x, before the rotary embedding: where a family's
        attention differs ahead of the cache (q/k norms, clipping), its subclass says so here."""
        T = x.shape[0]
        q = self.q_proj(x).view(T, self.nh, self.hd)
        k = self.k_proj(x).view(T, self.nkv, self.hd)
        return q, k, self.v_proj(x).view(T, self.nkv, self.hd)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.project(x)
        kc, vc = kv.k[self.layer], kv.v[self.layer]
        if x.is_cuda:  # one kernel: rotary of q and k, k and v into the cache (torch: ~16)
            from components.engine.kernels.rotary import rotary_cache_write

            rot = self.rotary
            q = rotary_cache_write(q, k, v, rot.cos, rot.sin, batch.positions, batch.token_slots, kc, vc)
        else:
            q = self.rotary(q, batch.positions)
            kc[batch.token_slots, batch.positions] = self.rotary(k, batch.positions)
            vc[batch.token_slots, batch.positions] = v
        if batch.decode_only and q.is_cuda:  # reads each row's cache in place up to its own context
            from components.engine.kernels.decode_attention import decode_attention

            out = decode_attention(q, kc, vc, batch.slots, batch.ctx_lens, alone=prompt_rows_from())
        else:
            # A sequence at a time over its own context, decodes too: on the CPU, SDPA's rounding
            # of a row over keys padded to the step's longest context (gathered_decode) depends
            # on that length and, in fp32, on the row count, so on the other rows of the step
            # (bf16 completions changed with the load: tests/test_mixed_steps.py).
            starts = itertools.accumulate(batch.q_lens[:-1], initial=0)
            out = torch.cat([self._prefill(q, kc, vc, batch, i, s) for i, s in enumerate(starts)])
        return self.o_proj(out.reshape(T, self.nh * self.hd))

    def _prefill(self, q, kc, vc, batch: ForwardBatch, i: int, start: int) -> torch.Tensor:
        """Sequence i, whose tokens start at `start` in the batch (they are laid out in order)."""
        n, ctx, slot = batch.q_lens[i], batch.ctx_lens_list[i], batch.slots_list[i]
        qi = q[start : start + n].transpose(0, 1).unsqueeze(0)
        keys = kc[slot, :ctx].transpose(0, 1).unsqueeze(0)
        vals = vc[slot, :ctx].transpose(0, 1).unsqueeze(0)
        # Query j sits at absolute position ctx - n + j and sees keys up to that position (a
        # decode's one query sees them all: no mask to build, half the cost of a CPU decode).
        mask = None
        if n > 1:
            qpos = torch.arange(ctx - n, ctx, device=q.device).unsqueeze(1)
            mask = torch.arange(ctx, device=q.device).unsqueeze(0) <= qpos
        out = F.scaled_dot_product_attention(qi, keys, vals, attn_mask=mask, enable_gqa=True)
        return out.squeeze(0).transpose(0, 1)


class GatedMLP(nn.Module):
    """SwiGLU MLP, the dense and shared-expert form (HF names gate_proj/up_proj/down_proj)."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderBlock(nn.Module):
    """Pre-norm block. `attend` is everything up to the feed-forward input, so a decode graph can
    stop in front of an expert-parallel feed-forward (whose collective is host-driven)."""

    def __init__(self, cfg, layer: int, rotary: Rotary, bias: bool):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = self.attention(cfg, layer, rotary, bias)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def attention(self, cfg, layer: int, rotary: Rotary, bias: bool) -> nn.Module:
        """The block's `self_attn`; a family whose attention differs returns its own (a subclass,
        or MLA)."""
        return Attention(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, bias, rotary, layer)

    ffn: nn.Module  # the feed-forward: an EP MoE or a dense MLP
    moe: nn.Module | None  # the ffn when it is expert-parallel

    def attend(
        self, x: torch.Tensor, batch: ForwardBatch, kv: KVCache, normed: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, post_attention_layernorm(h)) for h = x + attention. `normed` is input_layernorm(x)
        where the caller has it already (a decode graph norms x in the kernel that adds it up)."""
        if normed is None:
            normed = self.input_layernorm(x)
        return self.post_attention_layernorm.add_and_norm(x, self.self_attn(normed, batch, kv))

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        h, n = self.attend(x, batch, kv)
        return h + self.ffn(n)


class MlpBlock(DecoderBlock):
    """A block whose feed-forward is its `mlp`: an expert-parallel MoE, or a dense MLP."""

    mlp: nn.Module

    @property
    def ffn(self):
        return self.mlp

    @property
    def moe(self):
        return self.mlp if isinstance(self.mlp, SparseMoE) else None
