"""A Mixtral-shaped checkpoint of several GB with random bf16 weights, for GPU benchmarks.

It reuses the built-in model's tokenizer and chat template (so Dynamo serves it as is) and writes
one safetensors shard per layer, generating weights on the GPU when there is one."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from components.engine.models.builtin import builtin_model_dir


def write(dest: Path, layers: int, hidden: int, intermediate: int, experts: int, heads: int, kv_heads: int) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    src = builtin_model_dir()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(src / name, dest / name)
    base = json.loads((src / "config.json").read_text())
    vocab = base["vocab_size"]
    cfg = {
        **base,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_local_experts": experts,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
        "dtype": "bfloat16",
        "max_position_embeddings": 4096,
    }
    (dest / "config.json").write_text(json.dumps(cfg, indent=2))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape, std=0.02):
        return (torch.randn(*shape, generator=g, device=dev) * std).to(torch.bfloat16).cpu()

    hd = hidden // heads
    weight_map = {}

    def shard(name: str, tensors: dict) -> None:
        save_file(tensors, str(dest / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in tensors})

    shard(
        "model-embed.safetensors",
        {
            "model.embed_tokens.weight": rnd(vocab, hidden),
            "lm_head.weight": rnd(vocab, hidden),
            "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        },
    )
    for i in range(layers):
        p = f"model.layers.{i}."
        t = {
            p + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            p + "self_attn.q_proj.weight": rnd(heads * hd, hidden),
            p + "self_attn.k_proj.weight": rnd(kv_heads * hd, hidden),
            p + "self_attn.v_proj.weight": rnd(kv_heads * hd, hidden),
            p + "self_attn.o_proj.weight": rnd(hidden, heads * hd),
            p + "block_sparse_moe.gate.weight": rnd(experts, hidden),
        }
        for e in range(experts):
            q = f"{p}block_sparse_moe.experts.{e}."
            t |= {
                q + "w1.weight": rnd(intermediate, hidden),
                q + "w3.weight": rnd(intermediate, hidden),
                q + "w2.weight": rnd(hidden, intermediate),
            }
        shard(f"model-layer{i}.safetensors", t)
    (dest / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dest


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("dest", type=Path)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=14336)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    a = p.parse_args()
    out = write(a.dest, a.layers, a.hidden, a.intermediate, a.experts, a.heads, a.kv_heads)
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    print(f"wrote {out}: {size / 2**30:.1f} GiB")


if __name__ == "__main__":
    main()
