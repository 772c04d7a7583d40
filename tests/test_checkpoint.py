import json
import math
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from components.engine.models.checkpoint import Checkpoint, CheckpointError
from components.engine.models.config import ConfigError, ModelConfig
from components.engine.models.deepseek_v3 import expanded_kv_layout
from components.engine.models.registry import config_from_dict, expected_tensors, family
from harness.reference import make_checkpoint

TINY = dict(
    vocab_size=64,
    hidden_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def _save(model, d, **kw):
    model.save_pretrained(d, **kw)
    return model.state_dict()


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(**TINY, intermediate_size=24, num_local_experts=4)
    d = tmp_path_factory.mktemp("mixtral")
    return d, _save(transformers.MixtralForCausalLM(cfg), d)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    torch.manual_seed(1)
    cfg = transformers.Qwen2MoeConfig(
        **TINY,
        intermediate_size=48,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=40,
        num_experts=4,
        num_experts_per_tok=2,
        mlp_only_layers=[1],
    )
    d = tmp_path_factory.mktemp("qwen")
    return d, _save(transformers.Qwen2MoeForCausalLM(cfg), d)


def reference(sd, cfg: ModelConfig, name: str) -> torch.Tensor:
    """The in-memory transformers tensor behind a checkpoint name (experts are fused in memory)."""
    if name in sd:
        return sd[name]
    for i in range(cfg.num_layers):
        if name == family(cfg).router_name(cfg, i):
            return sd[f"model.layers.{i}.mlp.gate.weight"]
        for e in range(cfg.num_experts):
            names = family(cfg).expert_tensors(cfg, i, e) if cfg.sparse_layers[i] else ()
            if name in names:
                I = cfg.moe_intermediate_size
                gate_up = sd[f"model.layers.{i}.mlp.experts.gate_up_proj"][e]
                down = sd[f"model.layers.{i}.mlp.experts.down_proj"][e]
                return (gate_up[:I], gate_up[I:], down)[names.index(name)]
    raise KeyError(name)


def assert_matches(ckpt: Checkpoint, sd, dtype=None):
    names = expected_tensors(ckpt.config)
    for name, shape in names.items():
        got = ckpt.get(name, dtype=dtype)
        want = reference(sd, ckpt.config, name)
        assert tuple(got.shape) == shape
        assert got.dtype == (dtype or want.dtype)
        assert torch.equal(got, want.to(got.dtype)), name


def test_mixtral_opens_and_matches(mixtral):
    d, sd = mixtral
    ckpt = Checkpoint.open(d)
    c = ckpt.config
    assert ckpt.path == d and c.architecture == "mixtral"
    assert (c.num_experts, c.top_k, c.moe_intermediate_size, c.head_dim) == (4, 2, 24, 8)
    assert c.norm_topk_prob and not c.qkv_bias and c.sparse_layers == (True,) * 3
    assert c.dense_intermediate_size == 0 and c.shared_expert_intermediate_size == 0
    assert (c.eos_token_ids, c.bos_token_id, c.dtype) == ((2,), 1, "float32")
    assert family(c).expert_tensors(c, 2, 3) == tuple(
        f"model.layers.2.block_sparse_moe.experts.3.{w}.weight" for w in ("w1", "w3", "w2")
    )
    assert_matches(ckpt, sd)


def test_qwen_opens_and_matches(qwen):
    d, sd = qwen
    ckpt = Checkpoint.open(d)
    c = ckpt.config
    assert c.architecture == "qwen2_moe" and c.qkv_bias and not c.norm_topk_prob
    assert c.sparse_layers == (True, False, True)
    assert (c.shared_expert_intermediate_size, c.dense_intermediate_size) == (40, 48)
    assert family(c).dense_mlp_names(c, 1) == tuple(
        f"model.layers.1.mlp.{p}_proj.weight" for p in ("gate", "up", "down")
    )
    assert family(c).shared_expert_names(c, 2)[3] == "model.layers.2.mlp.shared_expert_gate.weight"
    assert expected_tensors(c)["model.layers.0.mlp.shared_expert_gate.weight"] == (1, 32)
    assert "model.layers.1.mlp.gate.weight" not in expected_tensors(c)
    assert_matches(ckpt, sd)
    assert ckpt.get("model.norm.weight", dtype=torch.float64).dtype == torch.float64


@pytest.mark.filterwarnings("ignore:Initializing zero-element")
def test_sharded_and_bf16(tmp_path):
    torch.manual_seed(2)
    cfg = transformers.Qwen2MoeConfig(
        **TINY,
        intermediate_size=48,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=0,
        num_experts=4,
        num_experts_per_tok=2,
        tie_word_embeddings=True,
    )
    model = transformers.Qwen2MoeForCausalLM(cfg).to(torch.bfloat16)
    sd = _save(model, tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 2
    ckpt = Checkpoint.open(tmp_path)
    c = ckpt.config
    assert c.dtype == "bfloat16" and c.tie_word_embeddings and c.shared_expert_intermediate_size == 0
    assert "lm_head.weight" not in expected_tensors(c)
    assert family(c).shared_expert_names(c, 0) is None
    assert_matches(ckpt, sd)
    assert_matches(ckpt, sd, dtype=torch.float32)


def test_sparse_layer_rule():
    base = {
        "architectures": ["Qwen2MoeForCausalLM"],
        "vocab_size": 8,
        "hidden_size": 8,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 16,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 4,
        "intermediate_size": 16,
        "num_hidden_layers": 6,
    }
    rule = lambda **kw: config_from_dict({**base, **kw}).sparse_layers
    assert rule(decoder_sparse_step=2, mlp_only_layers=[3]) == (False, True, False, False, False, True)
    assert rule(decoder_sparse_step=1, mlp_only_layers=[1]) == (True, False, True, True, True, True)
    assert rule(num_experts=0) == (False,) * 6
    c = config_from_dict({**base, "head_dim": None, "torch_dtype": "bfloat16", "eos_token_id": 5})
    assert (c.head_dim, c.dtype, c.eos_token_ids, c.rope_theta) == (4, "bfloat16", (5,), 10000.0)
    assert (
        c.identity()
        == config_from_dict({**base, "head_dim": None, "torch_dtype": "bfloat16", "eos_token_id": 5}).identity()
    )
    assert c.identity() != config_from_dict(base).identity()
    with pytest.raises(ConfigError, match="rope_type 'yarn'"):
        config_from_dict({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ConfigError, match="sliding window"):
        config_from_dict({**base, "sliding_window": 4096, "use_sliding_window": True})
    config_from_dict({**base, "sliding_window": 4096, "use_sliding_window": False})


@pytest.fixture(scope="module", params=["qwen3_moe", "olmoe"])
def qk_norm(request, tmp_path_factory):
    """A tiny checkpoint of a family with q/k norms (harness.reference's), and its in-memory state."""
    d = make_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    return d, transformers.AutoModelForCausalLM.from_pretrained(d).state_dict()


def test_qk_norm_families_open_and_match(qk_norm):
    d, sd = qk_norm
    ckpt = Checkpoint.open(d)
    c, names = ckpt.config, expected_tensors(ckpt.config)
    assert not c.qkv_bias and c.shared_expert_intermediate_size == 0
    assert "model.layers.0.mlp.shared_expert_gate.weight" not in names
    if c.architecture == "qwen3_moe":  # per-head norms, a head_dim of its own, a dense layer
        assert (c.head_dim, c.norm_topk_prob, c.sparse_layers, c.clip_qkv) == (16, True, (True, False, True), None)
        assert (
            names["model.layers.1.self_attn.q_norm.weight"] == names["model.layers.1.self_attn.k_norm.weight"] == (16,)
        )
        assert names["model.layers.0.self_attn.q_proj.weight"] == (64, 32)
    else:  # norms over the whole projections, every layer sparse, weights not renormalised
        assert c.architecture == "olmoe" and (c.head_dim, c.moe_intermediate_size) == (8, 24)
        assert (c.norm_topk_prob, c.sparse_layers, c.clip_qkv) == (False, (True,) * 3, 1.5)
        assert names["model.layers.2.self_attn.q_norm.weight"] == (32,)
        assert names["model.layers.2.self_attn.k_norm.weight"] == (16,)
    assert_matches(ckpt, sd)


REFUSED = [
    ("mixtral", {"hidden_act": "gelu"}, "hidden_act='gelu' is unsupported (only 'silu')"),
    ("qwen2_moe", {"hidden_act": "gelu"}, "hidden_act='gelu' is unsupported (only 'silu')"),
    ("qwen3_moe", {"attention_bias": True}, "attention_bias=True is unsupported (only False)"),
    ("qwen3_moe", {"hidden_act": "gelu"}, "hidden_act='gelu' is unsupported (only 'silu')"),
    ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 4096}, "sliding window"),
    ("qwen3_moe", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn'"),
    ("olmoe", {"sliding_window": 4096}, "sliding window"),  # OLMoE has no use_sliding_window flag
    ("olmoe", {"attention_bias": True}, "attention_bias=True is unsupported"),
    ("olmoe", {"head_dim": 16}, "head_dim=16 is unsupported (only hidden_size / num_attention_heads)"),
    ("glm4_moe", {"hidden_act": "gelu"}, "hidden_act='gelu' is unsupported (only 'silu')"),
    ("glm4_moe", {"rope_parameters": {"rope_theta": 1e4, "rope_type": "linear", "factor": 2.0}}, "rope_type 'linear'"),
    # 16 * 0.4375: 7 rotated dims, which rotate-half cannot pair.
    (
        "glm4_moe",
        {"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.4375}},
        "partial_rotary_factor=0.4375",
    ),
    ("glm4_moe", {"n_group": 3}, "unsupported n_group=3 (n_routed_experts=8 in n_group groups"),
]


@pytest.mark.parametrize("arch,change,message", REFUSED)
def test_a_field_the_family_does_not_implement_is_refused_naming_it(tmp_path, arch, change, message):
    d = make_checkpoint(arch, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, **change}))
    assert message in _err(d)


@pytest.fixture
def bad(tmp_path, mixtral):
    d = tmp_path / "ckpt"
    shutil.copytree(mixtral[0], d)
    return d


def _err(d) -> str:
    with pytest.raises(CheckpointError) as e:
        Checkpoint.open(d)
    return str(e.value)


def test_not_a_directory(tmp_path):
    assert _err(tmp_path / "nope") == f"{tmp_path}/nope: no such directory"
    (tmp_path / "f").write_text("x")
    assert _err(tmp_path / "f") == f"{tmp_path}/f: not a directory"


def test_missing_config(bad):
    (bad / "config.json").unlink()
    assert _err(bad) == f"{bad}: missing config.json"


def test_invalid_json(bad):
    (bad / "config.json").write_text("{not json")
    assert _err(bad).startswith(f"{bad}/config.json: invalid JSON")


def test_unknown_architecture(bad):
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "architectures": ["LlamaForCausalLM"]}))
    assert _err(bad) == (
        f"{bad}/config.json: unknown architecture 'LlamaForCausalLM' "
        "(supported: MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM, OlmoeForCausalLM, "
        "DeepseekV3ForCausalLM, Glm4MoeForCausalLM)"
    )


def test_missing_and_misshapen_tensor(bad):
    f = bad / "model.safetensors"
    sd = load_file(f)
    name = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    save_file({k: v for k, v in sd.items() if k != name}, f)
    assert _err(bad) == f"{f}: missing tensor {name}"
    q = "model.layers.0.self_attn.q_proj.weight"
    save_file({**sd, q: torch.zeros(32, 16)}, f)
    assert _err(bad) == f"{f}: tensor {q} has shape [32, 16], expected [32, 32]"


def test_extra_tensors_ignored(bad):
    f = bad / "model.safetensors"
    sd = load_file(f)
    save_file({**sd, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)}, f)
    assert Checkpoint.open(bad).config.num_layers == 3


def test_corrupt_header(bad):
    f = bad / "model.safetensors"
    f.write_bytes(b"\xff" * 64)
    assert _err(bad).startswith(f"{f}: corrupt safetensors header")


def test_no_weights(bad):
    (bad / "model.safetensors").unlink()
    assert "no weights" in _err(bad)


def test_index_missing_shard(tmp_path, mixtral):
    model = transformers.MixtralForCausalLM.from_pretrained(mixtral[0])
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    index = tmp_path / "model.safetensors.index.json"
    shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    assert len(shards) >= 2
    Checkpoint.open(tmp_path)
    (tmp_path / shards[-1]).unlink()
    assert _err(tmp_path) == f"{index}: refers to missing file {shards[-1]}"


# DeepSeek-V3's config.json as published (its auto_map and training-only fields left out).
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "ep_size": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "v_head_dim": 128,
    "vocab_size": 129280,
}
# Kimi-K2 and Moonlight: the same architecture, one expert group; Moonlight without q LoRA or yarn.
KIMI_K2 = {
    **DEEPSEEK_V3,
    "n_routed_experts": 384,
    "n_group": 1,
    "topk_group": 1,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "first_k_dense_replace": 1,
    "routed_scaling_factor": 2.827,
    "rope_theta": 50000.0,
    "max_position_embeddings": 131072,
    "rope_scaling": {**DEEPSEEK_V3["rope_scaling"], "factor": 32.0},
    "vocab_size": 163840,
}
MOONLIGHT = {
    **{k: v for k, v in DEEPSEEK_V3.items() if k not in ("quantization_config", "rope_scaling")},
    "hidden_size": 2048,
    "intermediate_size": 11264,
    "moe_intermediate_size": 1408,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "num_hidden_layers": 27,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "num_experts_per_tok": 6,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "q_lora_rank": None,
    "routed_scaling_factor": 2.446,
    "rope_theta": 50000.0,
    "max_position_embeddings": 8192,
    "vocab_size": 163840,
}


def test_deepseek_v3_kimi_k2_and_moonlight_configs_are_read_as_published():
    c = config_from_dict(DEEPSEEK_V3)
    p = c.params
    assert (c.num_experts, c.top_k, p.routing.n_group, p.routing.topk_group, p.q_lora_rank) == (256, 8, 8, 4, 1536)
    assert c.sparse_layers == (False,) * 3 + (True,) * 58 and c.weight_block == (128, 128)
    assert c.shared_expert_intermediate_size == 2048 and p.rope_interleave and p.yarn.factor == 40
    # yarn's mscale (0.1 ln 40 + 1) squared on the softmax scale; its attention factor is 1.
    assert p.softmax_scale == pytest.approx(192**-0.5 * (0.1 * math.log(40) + 1) ** 2)
    assert p.yarn.attention_factor == 1.0
    # The KV cache: one latent row of 512 + 64 a token and layer, against 128 heads of
    # 192-dim keys and 128-dim values expanded: 1152 B against 81920 B a layer in bf16 (71x).
    layout = family(c).kv_layout(c)
    assert layout.bytes_per_token(61, 2) == 61 * 1152 == 70272
    assert expanded_kv_layout(c).bytes_per_token(61, 2) == 61 * 128 * (192 + 128) * 2 == 4997120
    k2, moon = config_from_dict(KIMI_K2), config_from_dict(MOONLIGHT)
    assert (k2.num_experts, k2.params.routing.n_group, k2.params.routing.routed_scaling_factor) == (384, 1, 2.827)
    assert moon.params.q_lora_rank == 0 and moon.params.yarn is None and moon.weight_block is None
    assert moon.shared_expert_intermediate_size == 2 * 1408
    assert "model.layers.0.self_attn.q_proj.weight" in expected_tensors(moon)


@pytest.mark.parametrize(
    "change,message",
    [
        ({"hidden_act": "gelu"}, "unsupported hidden_act='gelu'"),
        ({"scoring_func": "softmax"}, "unsupported scoring_func='softmax'"),
        ({"topk_method": "group_limited_greedy"}, "unsupported topk_method='group_limited_greedy'"),
        ({"moe_layer_freq": 2}, "unsupported moe_layer_freq=2"),
        ({"num_key_value_heads": 8}, "unsupported num_key_value_heads=8"),
        ({"n_group": 3}, "unsupported n_group=3"),
        ({"partial_rotary_factor": 0.5}, "unsupported partial_rotary_factor=0.5"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "unsupported rope_type 'dynamic'"),
        ({"quantization_config": {"quant_method": "awq"}}, "unsupported quantization_config (quant_method='awq'"),
        (
            {"quantization_config": {**DEEPSEEK_V3["quantization_config"], "activation_scheme": "static"}},
            "unsupported quantization_config.activation_scheme 'static'",
        ),
    ],
)
def test_a_deepseek_field_this_engine_does_not_implement_is_refused_naming_it(change, message):
    with pytest.raises(ConfigError) as e:
        config_from_dict({**DEEPSEEK_V3, **change})
    assert str(e.value).startswith(message), str(e.value)


# GLM-4.5's config.json (zai-org/GLM-4.5): the fields the engine reads.
GLM_45 = {
    "architectures": ["Glm4MoeForCausalLM"],
    "attention_bias": True,
    "first_k_dense_replace": 3,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 5120,
    "intermediate_size": 12288,
    "max_position_embeddings": 131072,
    "moe_intermediate_size": 1536,
    "n_group": 1,
    "n_routed_experts": 160,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 96,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 92,
    "num_key_value_heads": 8,
    "num_nextn_predict_layers": 1,
    "partial_rotary_factor": 0.5,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000,
    "routed_scaling_factor": 2.5,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "torch_dtype": "bfloat16",
    "use_qk_norm": True,
    "vocab_size": 151552,
}


def test_glm_4_5_config_is_read_as_published_and_its_checkpoint_named_as_transformers_writes_it(tmp_path, caplog):
    with caplog.at_level("INFO"):
        c = config_from_dict(GLM_45)
    assert "glm4_moe: 1 MTP layer(s) (layer index 92 on) skipped" in caplog.text
    p = c.params
    assert (c.num_experts, c.top_k, p.routing.n_group, p.routing.routed_scaling_factor) == (160, 8, 1, 2.5)
    assert c.sparse_layers == (False,) * 3 + (True,) * 89 and c.qkv_bias and p.use_qk_norm
    assert (c.head_dim, p.rotary_dim, c.shared_expert_intermediate_size) == (128, 64, 1536)
    # A GQA cache of 8 heads of 128-dim keys and values: 4096 B a token and layer in bf16.
    assert family(c).kv_layout(c).bytes_per_token(92, 2) == 92 * 4096
    names = expected_tensors(c)
    assert names["model.layers.0.self_attn.q_proj.weight"] == (96 * 128, 5120)
    assert names["model.layers.0.self_attn.k_proj.bias"] == (8 * 128,)
    assert names["model.layers.3.self_attn.q_norm.weight"] == (128,)
    assert names["model.layers.3.mlp.gate.e_score_correction_bias"] == (160,)
    assert names["model.layers.91.mlp.shared_experts.down_proj.weight"] == (5120, 1536)
    assert "model.layers.2.mlp.gate_proj.weight" in names and "model.layers.92.mlp.gate.weight" not in names
    # The tiny checkpoints transformers writes open under the same names, with and without q/k norms.
    for arch, qk_norm in (("glm4_moe", True), ("glm4_moe_no_qk_norm", False)):
        with Checkpoint.open(make_checkpoint(arch, tmp_path / arch)) as ckpt:
            cp = ckpt.config.params
            assert (cp.rotary_dim, cp.use_qk_norm, cp.routing.n_group) == (8, qk_norm, 4 if qk_norm else 1)
            assert ("model.layers.1.self_attn.k_norm.weight" in ckpt) == qk_norm


def test_an_fp8_weight_without_its_scale_or_quantization_config_is_refused(tmp_path):
    from harness.reference import make_checkpoint

    d = make_checkpoint("deepseek_v3", tmp_path / "ds")
    sd = load_file(d / "model.safetensors")
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    sd[name] = sd[name].to(torch.float8_e4m3fn)
    save_file(sd, d / "model.safetensors")
    with Checkpoint.open(d) as ckpt:
        with pytest.raises(
            CheckpointError, match=f"tensor {name} is float8_e4m3fn but config.json has no quantization_config"
        ):
            ckpt.get(name)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "quantization_config": DEEPSEEK_V3["quantization_config"]}))
    with Checkpoint.open(d) as ckpt:
        with pytest.raises(CheckpointError, match=f"{name}_scale_inv is missing"):
            ckpt.get(name)
