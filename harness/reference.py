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
    if arch.startswith("deepseek_v3"):
        model = _deepseek_v3(arch, common)
    elif arch == "mixtral":
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
    elif arch.startswith("glm4_moe"):
        model = _glm4_moe(arch, common)
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


# DeepSeek-V3's MoE layout, as its tiny test models and GLM-4.5's have it: a dense first layer,
# a shared expert, scaled routing weights; grouped routing where `grouped`.
def _deepseek_moe(grouped: bool) -> dict:
    return dict(
        intermediate_size=48,
        moe_intermediate_size=16,
        n_routed_experts=8,
        n_shared_experts=1,
        n_group=4 if grouped else 1,
        topk_group=2 if grouped else 1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
    )


def _perturbed(model):
    """`model` with what transformers starts at zero or one drawn at random: projection biases,
    q/k norm weights, the selection biases (which change the choice, not the weights)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_proj.bias"):
                p.normal_(0, 0.02)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                p.normal_(1, 0.2)
        for layer in model.model.layers[model.config.first_k_dense_replace :]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.05)
    return model


def _deepseek_v3(arch: str, common: dict):
    """The "deepseek_v3" test model: q LoRA, attention bias, yarn, interleaved rope, grouped
    routing; "deepseek_v3_q_proj": no q LoRA, default rope, one group."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    lora = arch == "deepseek_v3"
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "mscale": 1.0}
    cfg = DeepseekV3Config(
        **{**common, "num_key_value_heads": common["num_attention_heads"]},
        **_deepseek_moe(grouped=lora),
        kv_lora_rank=16,
        q_lora_rank=24 if lora else None,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=12,
        attention_bias=lora,
        rope_interleave=lora,
        rope_parameters={"rope_theta": 10000.0, **({**yarn, "mscale_all_dim": 1.0} if lora else {})},
    )
    return _perturbed(DeepseekV3ForCausalLM(cfg))


def _glm4_moe(arch: str, common: dict):
    """The "glm4_moe" test model: q/k norms, grouped routing; "glm4_moe_no_qk_norm": neither. Both
    with half of each head rotated, q/k/v bias and heads wider than hidden_size / heads."""
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    qk_norm = arch == "glm4_moe"
    cfg = Glm4MoeConfig(
        **common,
        **_deepseek_moe(grouped=qk_norm),
        head_dim=16,
        attention_bias=True,
        use_qk_norm=qk_norm,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default", "partial_rotary_factor": 0.5},
    )
    return _perturbed(Glm4MoeForCausalLM(cfg))


FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


def quantize_fp8(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """`w` [rows, cols] as DeepSeek publishes it: e4m3 values and, per [block] tile (the last ones
    partial), `weight_scale_inv`, the factor that gives the weight back (w ~ fp8 * scale)."""
    rows, cols = w.shape
    br, bc = block
    pad = torch.zeros(-(-rows // br) * br, -(-cols // bc) * bc, dtype=torch.float32, device=w.device)
    pad[:rows, :cols] = w.float()
    tiles = pad.view(pad.shape[0] // br, br, pad.shape[1] // bc, bc)
    scale = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
    q = (tiles / scale[:, None, :, None]).view_as(pad)[:rows, :cols].to(torch.float8_e4m3fn)
    return q.contiguous(), scale


def is_fp8_weight(name: str, t: torch.Tensor) -> bool:
    """What DeepSeek's FP8 checkpoints quantise: every projection but the embeddings, lm_head
    and the routers."""
    return t.dim() == 2 and not name.endswith(("embed_tokens.weight", "lm_head.weight", "mlp.gate.weight"))


def fp8_checkpoint(src: Path, fp8_dir: Path, dequantised_dir: Path, block=(16, 16)) -> None:
    """`src` (one safetensors file) block-quantised to FP8 in `fp8_dir` (config.json with its
    quantization_config), and the same weights dequantised, in fp32, in `dequantised_dir`."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    state = load_file(src / "model.safetensors")
    fp8, plain = {}, {}
    for name, t in state.items():
        if is_fp8_weight(name, t):
            q, scale = quantize_fp8(t, block)
            fp8[name], fp8[f"{name}_scale_inv"] = q, scale
            full = scale.repeat_interleave(block[0], 0)[: t.shape[0]].repeat_interleave(block[1], 1)[:, : t.shape[1]]
            plain[name] = q.float() * full
        else:
            fp8[name], plain[name] = t, t
    for d, tensors in ((fp8_dir, fp8), (dequantised_dir, plain)):
        shutil.copytree(src, d)
        save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}
    (fp8_dir / "config.json").write_text(json.dumps({**cfg, "quantization_config": quant}, indent=2))


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
