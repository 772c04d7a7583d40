"""EchoWorker process: registers a model and streams the prompt tokens back."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from components.graph.component import LOG_FORMAT, component_config, load_context
from tests.graphs.echo import EchoWorker

log = logging.getLogger("tests.echo_worker")

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def make_tiny_model_dir(path: Path) -> Path:
    """A byte-level BPE tokenizer (round-trips any text) plus the files the frontend reads."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["hello world, the quick brown fox jumps over the lazy dog"], trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    vocab = tok.get_vocab_size()
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<s>",
                "eos_token": "</s>",
                "chat_template": CHAT_TEMPLATE,
                "model_max_length": 4096,
                "tokenizer_class": "PreTrainedTokenizerFast",
            }
        )
    )
    (path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "architectures": ["LlamaForCausalLM"],
                "vocab_size": vocab,
                "bos_token_id": 0,
                "eos_token_id": 1,
                "max_position_embeddings": 4096,
                "hidden_size": 8,
                "num_hidden_layers": 1,
                "num_attention_heads": 1,
            }
        )
    )
    return path


def resolve_model_dir(configured: str) -> tuple[str, str | None]:
    """(model dir, temp dir to remove on exit or None)."""
    if configured:
        return configured, None
    try:
        from components.engine.models.builtin import builtin_model_dir
    except ImportError:
        tmp = tempfile.mkdtemp(prefix="echo-model-")
        return str(make_tiny_model_dir(Path(tmp))), tmp
    return str(builtin_model_dir()), None


async def echo(request: dict[str, Any], context: Any = None) -> AsyncIterator[dict[str, Any]]:
    log.info("rank %s: request received", os.environ.get("ECHO_RANK", "0"))
    prompt = list(request.get("token_ids") or [])
    max_tokens = (request.get("stop_conditions") or {}).get("max_tokens") or len(prompt)
    out = prompt[:max_tokens]
    for tid in out[:-1]:
        yield {"token_ids": [tid]}
        if DELAY:
            await asyncio.sleep(DELAY)
    yield {
        "token_ids": out[-1:],
        "finish_reason": "length" if len(prompt) >= max_tokens else "stop",
        "completion_usage": {
            "prompt_tokens": len(prompt),
            "completion_tokens": len(out),
            "total_tokens": len(prompt) + len(out),
        },
    }


DELAY = 0.0


async def serve() -> None:
    global DELAY
    from dynamo.llm import ModelInput, ModelType, WorkerType, register_model

    from components.graph.runtime import make_runtime

    ctx, _ = load_context()
    cfg = component_config(EchoWorker.Config)
    DELAY = cfg.token_delay_s
    rank = os.environ.get("ECHO_RANK", "0")
    model_dir, tmp = resolve_model_dir(cfg.model_dir)
    loop = asyncio.get_running_loop()
    rt = make_runtime(loop, ctx)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, rt.shutdown)
    try:
        ep = rt.endpoint(f"{ctx.namespace}.echo.generate")
        await register_model(
            ModelInput.Tokens,
            ModelType.Chat | ModelType.Completions,
            ep,
            model_dir,
            cfg.model_name,
            worker_type=WorkerType.Aggregated,
        )
        log.info("rank %s serving model %r from %s", rank, cfg.model_name, model_dir)
        await ep.serve_endpoint(echo)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    log.info("rank %s stopped", rank)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    asyncio.run(serve())


if __name__ == "__main__":
    main()
