"""A DeepSeek-V3-shaped checkpoint of several GB with random weights, for GPU benchmarks: the real
hidden size (7168), MLA dims (128 heads, q LoRA 1536, KV latent 512 + 64 rotary, 128 + 64 query
and 128 value head dims), expert shapes (2048 intermediate, top 8 of 8 groups' best 4) and dense
first layer (18432 intermediate), yarn as published, with fewer layers and experts so that it fits
one H200: the default, 1 dense and 3 MoE layers of 32 experts and a shared one, is 11.0 GB in
bf16 (5.5 GB in FP8). `--fp8` writes it as DeepSeek publishes FP8 (e4m3 weights, a weight_scale_inv per 128x128
block, quantization_config); the engine dequantises it at load. `--small` writes the same layout
at a size a CPU steps (hidden 256), for `bench.step --model DIR` without a GPU.

It reuses the built-in model's tokenizer (so Dynamo serves it as is), writes one safetensors shard
per layer, and generates weights on the GPU when there is one.

    python -m bench.deepseek_like /tmp/dsv3 [--fp8] [--small]
    python -m bench.step --model /tmp/dsv3 --dtype bfloat16 --batch 1,32,64
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from components.engine.models.builtin import builtin_model_dir
from harness.reference import is_fp8_weight, quantize_fp8

FULL = dict(hidden=7168, heads=128, q_lora=1536, kv_lora=512, nope=128, rope=64, v=128, moe=2048, dense=18432, groups=8)
SMALL = dict(hidden=256, heads=4, q_lora=96, kv_lora=64, nope=32, rope=16, v=32, moe=128, dense=512, groups=4)
FP8_BLOCK = (128, 128)


def write(dest: Path, layers: int, dense_layers: int, experts: int, shape: dict, fp8: bool = False) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    src = builtin_model_dir()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(src / name, dest / name)
    s = shape
    H, nh, vocab = s["hidden"], s["heads"], json.loads((src / "config.json").read_text())["vocab_size"]
    cfg = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": vocab,
        "hidden_size": H,
        "intermediate_size": s["dense"],
        "moe_intermediate_size": s["moe"],
        "num_hidden_layers": layers,
        "first_k_dense_replace": dense_layers,
        "num_attention_heads": nh,
        "num_key_value_heads": nh,
        "q_lora_rank": s["q_lora"],
        "kv_lora_rank": s["kv_lora"],
        "qk_nope_head_dim": s["nope"],
        "qk_rope_head_dim": s["rope"],
        "v_head_dim": s["v"],
        "n_routed_experts": experts,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "n_group": s["groups"],
        "topk_group": s["groups"] // 2,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000,
        "rope_scaling": {
            "type": "yarn",
            "factor": 40,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        "max_position_embeddings": 163840,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "torch_dtype": "bfloat16",
    }
    if fp8:
        cfg["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": list(FP8_BLOCK),
        }
    (dest / "config.json").write_text(json.dumps(cfg, indent=2))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape, std=0.02):
        return (torch.randn(*shape, generator=g, device=dev) * std).to(torch.bfloat16)

    def ones(n):
        return torch.ones(n, dtype=torch.bfloat16, device=dev)

    weight_map = {}

    def shard(name: str, tensors: dict) -> None:
        out = {}
        for k, t in tensors.items():
            if fp8 and is_fp8_weight(k, t):
                out[k], out[f"{k}_scale_inv"] = quantize_fp8(t, FP8_BLOCK)
            else:
                out[k] = t
        save_file({k: t.cpu() for k, t in out.items()}, str(dest / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in out})

    def swiglu(prefix: str, inter: int) -> dict:
        return {
            f"{prefix}.gate_proj.weight": rnd(inter, H),
            f"{prefix}.up_proj.weight": rnd(inter, H),
            f"{prefix}.down_proj.weight": rnd(H, inter),
        }

    shard(
        "model-embed.safetensors",
        {"model.embed_tokens.weight": rnd(vocab, H), "lm_head.weight": rnd(vocab, H), "model.norm.weight": ones(H)},
    )
    q_dim, lora, rope = nh * (s["nope"] + s["rope"]), s["kv_lora"], s["rope"]
    for i in range(layers):
        p, a = f"model.layers.{i}", f"model.layers.{i}.self_attn"
        t = {
            f"{p}.input_layernorm.weight": ones(H),
            f"{p}.post_attention_layernorm.weight": ones(H),
            f"{a}.q_a_proj.weight": rnd(s["q_lora"], H),
            f"{a}.q_a_layernorm.weight": ones(s["q_lora"]),
            f"{a}.q_b_proj.weight": rnd(q_dim, s["q_lora"]),
            f"{a}.kv_a_proj_with_mqa.weight": rnd(lora + rope, H),
            f"{a}.kv_a_layernorm.weight": ones(lora),
            f"{a}.kv_b_proj.weight": rnd(nh * (s["nope"] + s["v"]), lora),
            f"{a}.o_proj.weight": rnd(H, nh * s["v"]),
        }
        if i < dense_layers:
            t |= swiglu(f"{p}.mlp", s["dense"])
        else:
            t[f"{p}.mlp.gate.weight"] = rnd(experts, H)
            t[f"{p}.mlp.gate.e_score_correction_bias"] = rnd(experts, std=0.01)
            t |= swiglu(f"{p}.mlp.shared_experts", s["moe"])
            for e in range(experts):
                t |= swiglu(f"{p}.mlp.experts.{e}", s["moe"])
        shard(f"model-layer{i}.safetensors", t)
    (dest / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dest


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dest", type=Path)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dense-layers", type=int, default=1, help="first_k_dense_replace")
    p.add_argument("--experts", type=int, default=32, help="routed experts a MoE layer (a multiple of 8 groups)")
    p.add_argument("--fp8", action="store_true", help="e4m3 weights with 128x128 block scales, as DeepSeek publishes")
    p.add_argument("--small", action="store_true", help="hidden 256 and dims to match: a size a CPU steps")
    a = p.parse_args()
    t0 = time.perf_counter()
    out = write(a.dest, a.layers, a.dense_layers, a.experts, SMALL if a.small else FULL, a.fp8)
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    print(f"wrote {out}: {size / 1e9:.2f} GB in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
