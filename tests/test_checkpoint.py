import json
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from components.engine.models.checkpoint import Checkpoint, CheckpointError
from components.engine.models.config import ConfigError, ModelConfig
from components.engine.models.registry import config_from_dict, expected_tensors, family

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
        "(supported: MixtralForCausalLM, Qwen2MoeForCausalLM, DeepseekV3ForCausalLM)"
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
