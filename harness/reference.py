"""Tiny random checkpoints of every family and the `transformers` reference they are judged by."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import torch

PROMPTS = [[5, 6, 7, 8, 9], [1, 2, 3], [100, 17, 3, 4, 5, 6, 7, 8, 9, 10, 11], [42], [7, 7, 7, 7, 90, 91]]


def make_checkpoint(arch: str, path: Path, dtype=torch.float32, seed: int = 0, tokenizer: bool = False) -> Path:
    """`tokenizer`: with the built-in model's tokenizer files and vocabulary, so a graph can serve it."""
    import transformers as tf

    from components.engine.models.builtin import builtin_model_dir

    torch.manual_seed(seed)
    common = dict(
        vocab_size=json.loads((builtin_model_dir() / "config.json").read_text())["vocab_size"] if tokenizer else 128,
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts_per_tok=2,
        max_position_embeddings=512,
    )
    if arch == "mixtral":
        model = tf.MixtralForCausalLM(tf.MixtralConfig(intermediate_size=48, num_local_experts=8, **common))
    elif arch in ("qwen2_moe", "qwen3_moe"):
        qwen = dict(intermediate_size=48, moe_intermediate_size=24, num_experts=8, mlp_only_layers=[1], **common)
        # Qwen2-MoE: a shared expert and a dense layer, so every code path runs. Qwen3-MoE: a dense
        # layer, renormalised top-k weights, and heads wider than hidden_size / heads.
        model = (
            tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(shared_expert_intermediate_size=40, **qwen))
            if arch == "qwen2_moe"
            else tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(norm_topk_prob=True, head_dim=16, **qwen))
        )
    elif arch == "olmoe":
        # clip_qkv low enough to clamp some of the normed q and k entries.
        model = tf.OlmoeForCausalLM(tf.OlmoeConfig(intermediate_size=24, num_experts=8, clip_qkv=1.5, **common))
    else:
        raise ValueError(f"no tiny checkpoint for {arch!r}")
    model.to(dtype).save_pretrained(path)
    if tokenizer:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(builtin_model_dir() / name, path / name)
    return path


def reference(path: Path, prompts, max_new_tokens: int):
    """Greedy tokens and the logits of every generated position, from transformers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokens, logits = [], []
    for p in prompts:
        ids = torch.tensor([p])
        out = model.generate(
            ids,
            # Given, not inferred: generate masks a prompt's pad_token_id (OLMoE's is 1) otherwise.
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
        tokens.append(out.sequences[0, len(p) :].tolist())
        logits.append(torch.stack([l[0] for l in out.logits]))
    return tokens, logits


def single_rank(path, device="cpu", max_len=256, **kw):
    """A one-rank engine with every expert local, loaded from the checkpoint at `path`."""
    from components.engine.rank import EngineRank, RankConfig

    eng = EngineRank(RankConfig(max_len=max_len, device=device, **kw), str(path))
    placement = eng.default_placement([0])
    eng.configure(0, [0], placement)
    eng.load_experts(placement)
    return eng


def submit_all(eng, prompts, max_tokens: int, **kw):
    """Submit every prompt at once; returns wait(timeout_s) -> (tokens, finish reasons) per prompt.
    Submitting to a paused engine puts every prompt into its first step after the resume."""
    from components.engine.request import GenerateRequest

    outs, ends, done = {}, {}, threading.Event()

    def emit(o):
        outs.setdefault(o.request_id, []).extend(o.token_ids)
        if o.finish_reason:
            ends[o.request_id] = o.finish_reason
            if len(ends) == len(prompts):
                done.set()

    for i, p in enumerate(prompts):
        eng.submit(GenerateRequest(str(i), p, max_tokens=max_tokens, **kw), emit)

    def wait(timeout_s: float) -> tuple[list[list[int]], list[str]]:
        assert done.wait(timeout_s), f"only {len(ends)} of {len(prompts)} requests finished"
        return [outs[str(i)] for i in range(len(prompts))], [ends[str(i)] for i in range(len(prompts))]

    return wait


def generate(eng, prompts, max_tokens: int, **kw) -> tuple[list[list[int]], list[str]]:
    """Submit every prompt at once to a started engine; (tokens, finish reasons) per prompt."""
    return submit_all(eng, prompts, max_tokens, **kw)(120)
