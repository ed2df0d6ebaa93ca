"""The tiny local mlx-lm model: mlx-lm loads it offline, it is deterministic, it chats."""

from __future__ import annotations

import os
import subprocess
import sys
from itertools import islice
from pathlib import Path

import mlx.core as mx
import mlx_lm
from mlx_lm.generate import generate_step

from mlxcache.tiny_models import build_tiny_lm


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_same_arguments_same_bytes(tmp_path):
    a = build_tiny_lm(tmp_path / "a")
    b = build_tiny_lm(tmp_path / "b")
    assert _files(a) == _files(b)
    c = build_tiny_lm(tmp_path / "c", seed=1)
    assert _files(c)["model.safetensors"] != _files(a)["model.safetensors"]
    assert _files(c)["tokenizer.json"] == _files(a)["tokenizer.json"]


def test_mlx_lm_loads_it_offline_and_generates(tmp_path):
    path = build_tiny_lm(tmp_path / "lm", num_layers=3, hidden_size=96, vocab_size=400)
    code = (
        "import sys, mlx_lm\n"
        "model, tok = mlx_lm.load(sys.argv[1])\n"
        "ids = tok.apply_chat_template([{'role': 'user', 'content': 'Hello there'}],"
        " add_generation_prompt=True)\n"
        "print(len(model.layers), len(ids))\n"
        "print(mlx_lm.generate(model, tok, ids, max_tokens=12))\n"
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HOME=str(tmp_path))
    out = subprocess.run(
        [sys.executable, "-c", code, str(path)], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    first, text = out.stdout.split("\n", 1)
    assert first.split()[0] == "3"
    assert int(first.split()[1]) > 4
    assert text.strip() and text.isascii()


def test_chat_template_and_generation(tmp_path):
    model, tok = mlx_lm.load(str(build_tiny_lm(tmp_path / "lm")))
    assert tok.has_chat_template
    messages = [{"role": "user", "content": "Tell me a story about a cat."}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True)
    assert tok.decode(ids) == "<|user|>\nTell me a story about a cat.</s>\n<|assistant|>\n"
    assert tok.eos_token_ids == {tok.convert_tokens_to_ids("</s>")}
    # Special tokens are never generated, so greedy output always runs to max_tokens.
    steps = generate_step(mx.array(ids), model)
    tokens = [int(token) for token, _ in islice(steps, 30)]
    assert len(tokens) == 30
    assert not set(tokens) & tok.eos_token_ids
    again = mlx_lm.generate(model, tok, ids, max_tokens=30)
    assert again == mlx_lm.generate(model, tok, ids, max_tokens=30)
    assert again.isascii() and "\ufffd" not in again
