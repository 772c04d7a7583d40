import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from components.engine.models import builtin
from components.engine.models.builtin import BUILTIN_MODEL_NAME, builtin_model_dir, write_builtin_model
from components.engine.models.checkpoint import Checkpoint

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_builtin_model(tmp_path_factory.mktemp("builtin"))


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_deterministic(model_dir, tmp_path):
    again = _files(write_builtin_model(tmp_path / "again"))
    assert set(again) == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    assert again == _files(model_dir)


def test_checkpoint_and_config(model_dir):
    ckpt = Checkpoint.open(model_dir)
    c = ckpt.config
    assert BUILTIN_MODEL_NAME == "elastic-ep/tiny-moe"
    assert (c.architecture, c.hidden_size, c.num_layers, c.num_experts, c.top_k) == ("mixtral", 128, 4, 8, 2)
    assert (c.moe_intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim) == (256, 4, 2, 32)
    assert (c.max_position_embeddings, c.dtype, c.vocab_size) == (4096, "float32", 512)
    assert c.eos_token_ids == (1, 3) and c.bos_token_id == 0
    assert torch.equal(ckpt.get("model.norm.weight"), torch.ones(128))
    w = ckpt.get("model.layers.0.block_sparse_moe.experts.0.w1.weight")
    assert w.dtype == torch.float32 and 0.018 < w.std().item() < 0.022


def test_tokenizer(model_dir):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert tok.get_vocab_size() == 512
    assert [tok.token_to_id(t) for t in builtin.SPECIAL_TOKENS] == [0, 1, 2, 3]
    text = "Hello, world! Héllo 😀\n\ttabs  and spaces <|im_start|>user<|im_end|>"
    enc = tok.encode(text)
    assert tok.decode(enc.ids, skip_special_tokens=False) == text
    assert 2 in enc.ids and 3 in enc.ids
    # BPE merges learned from the embedded corpus shorten common English.
    assert len(tok.encode("The quick brown fox").ids) < len("The quick brown fox")
    cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert (cfg["bos_token"], cfg["eos_token"]) == ("<s>", "</s>")


def test_transformers_loads(model_dir):
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    text = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tok.decode(tok(text)["input_ids"]) == text
    model, info = transformers.AutoModelForCausalLM.from_pretrained(model_dir, output_loading_info=True)
    assert not any(info.values()), info
    ckpt = Checkpoint.open(model_dir)
    assert torch.equal(model.state_dict()["lm_head.weight"], ckpt.get("lm_head.weight"))


def test_cache_race(tmp_path, model_dir):
    env = {**os.environ, "ELASTIC_EP_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT)}
    code = "from components.engine.models.builtin import builtin_model_dir; print(builtin_model_dir())"
    procs = [
        subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True) for _ in range(2)
    ]
    outs = {p.communicate(timeout=60)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    assert len(outs) == 1
    final = Path(outs.pop())
    assert final.parent == tmp_path / "cache" and final.name.startswith("builtin-")
    assert [p.name for p in final.parent.iterdir()] == [final.name]  # no temp dirs left behind
    assert _files(final) == _files(model_dir)


def test_cache_reuses_existing(tmp_path, monkeypatch):
    monkeypatch.setenv("ELASTIC_EP_CACHE", str(tmp_path))
    first = builtin_model_dir()
    marker = first / "marker"
    marker.write_text("x")
    assert builtin_model_dir() == first and marker.exists()


def test_cache_loses_race(tmp_path, monkeypatch):
    """Another process renames its complete copy into place while this one is writing."""
    monkeypatch.setenv("ELASTIC_EP_CACHE", str(tmp_path))
    real = builtin.write_builtin_model

    def racing_write(dest):
        winner = real(tmp_path / "winner")
        os.rename(winner, tmp_path / dest.name.split(".")[1])  # tmp is .<final>.<random>
        return real(dest)

    monkeypatch.setattr(builtin, "write_builtin_model", racing_write)
    final = builtin_model_dir()
    assert [p.name for p in tmp_path.iterdir()] == [final.name]
    Checkpoint.open(final)
