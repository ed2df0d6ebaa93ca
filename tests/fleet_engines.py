"""The engines ``mlxcache serve`` runs, as tests/serve_fleet.py and tests/test_load_faults.py
see them: how to build a tiny local model, what a request looks like, which interpreter runs
the worker, and the answer the engine gives with no cache at all (what every cached answer must
equal).

mlx-lm's uncached answer is computed in this process (``mlx_lm.generate``); mlx-vlm's comes
from ``python -m mlx_vlm.server`` with its cache off and vllm-mlx's from vllm-mlx's own server
with its prefix cache off (in the vllm-mlx venv), each asked over HTTP like the workers.
"""

from __future__ import annotations

import json
import sys
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REQUEST_TIMEOUT = 120.0
Messages = list[dict[str, Any]]


@dataclass(frozen=True)
class Engine:
    """One ``mlxcache serve --engine``: its tiny model, flags, requests and uncached answers."""

    name: str
    build: Callable[[Path], str]  # a folder to build in -> the --model argument
    flags: tuple[str, ...]
    messages: Callable[[int], Messages]  # prompt i -> chat messages
    # model, [messages, ...], max_tokens, a scratch folder -> the uncached answers, in order
    answers: Callable[[str, Sequence[Messages], int, Path], list[str]]
    body: Callable[[str], dict[str, Any]] = field(default=lambda model: {})  # extra fields
    python: Callable[[], str] = field(default=lambda: sys.executable)  # runs the worker
    own_home: bool = False  # the worker gets a $HOME of its own (an engine caching under ~)
    # flags that bound its in-process hot tier to about one entry; () when it has none (the
    # tier may then serve every prompt while the store is down)
    hot: tuple[str, ...] = ()
    scale: float = 1.0  # the share of the load-and-fault suite's requests it runs
    heal_case: bool = False  # its Redis scenario also checks healing (a third worker)


def chat(url: str, messages: Messages, max_tokens: int, extra: dict[str, Any]) -> dict:
    """One greedy, non-streaming chat completion: the response's JSON."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0.0, **extra}
    req = urllib.request.Request(
        url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT) as r:
        return json.load(r)


def text_of(response: dict) -> str:
    return response["choices"][0]["message"]["content"]


# ---------------------------------------------------------------- mlx-lm

_LOADED: dict[str, Any] = {}


def _lm_answers(model: str, prompts: Sequence[Messages], max_tokens: int, _: Path) -> list[str]:
    from mlx_lm import generate, load

    if model not in _LOADED:
        _LOADED[model] = load(model)
    lm, tokenizer = _LOADED[model]
    out = []
    for messages in prompts:
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        out.append(generate(lm, tokenizer, prompt=prompt, max_tokens=max_tokens))
    return out


def _lm_model(folder: Path) -> str:
    from mlxcache.tiny_models import build_tiny_lm

    return str(build_tiny_lm(folder / "tiny-lm"))


TOPICS = ("a cat", "the sea", "a red kite", "the hills", "a lighthouse", "a fox", "rain", "bread")
SYSTEM = " ".join(["You are a storyteller who knows the hills and the sea."] * 16)


def lm_messages(i: int) -> Messages:
    """Prompt ``i``: a long system prompt every prompt shares, then a distinct user turn (about
    230 tokens in all on the tiny model: 120 KB of KV; over vllm-mlx's 128-token minimum)."""
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Tell story {i} about {TOPICS[i % len(TOPICS)]}, please."},
    ]


# ---------------------------------------------------------------- mlx-vlm


def _vlm_model(folder: Path) -> str:
    from mlxcache.tiny_models import build_tiny_vlm

    return str(build_tiny_vlm(folder / "tiny-vlm"))


def vlm_messages(i: int) -> Messages:
    """Prompt ``i``: one of three images (a base64 PNG) and a question naming ``i``."""
    from vlm_server import QUESTION, image

    content = [
        {"type": "image_url", "image_url": {"url": image("ABC"[i % 3])}},
        {"type": "text", "text": f"{QUESTION} Picture {i}."},
    ]
    return [{"role": "user", "content": content}]


def _vlm_answers(model: str, prompts: Sequence[Messages], max_tokens: int, tmp: Path) -> list[str]:
    from vlm_server import VlmServer

    plain = VlmServer(model, None, tmp / "mlx_vlm-uncached.log", plain=True)
    try:
        return [text_of(chat(plain.url, m, max_tokens, {"model": model})) for m in prompts]
    finally:
        plain.kill()


# ---------------------------------------------------------------- vllm-mlx


def _vllm_python() -> str:
    from vllm_servers import require_vllm_python

    return require_vllm_python()


def _vllm_answers(model: str, prompts: Sequence[Messages], max_tokens: int, tmp: Path) -> list[str]:
    from vllm_servers import NAME, Server, server_args

    args = [*server_args(_vllm_python(), model, None, True), "--continuous-batching"]
    ref = Server(args, tmp / "vllm-uncached.log", tmp / "vllm-uncached-home")
    try:
        return [text_of(chat(ref.url, m, max_tokens, {"model": NAME})) for m in prompts]
    finally:
        ref.kill()


VLLM_FLAGS = ("--engine", "vllm-mlx", "--cache-block-size", "16", "--continuous-batching",
              "--served-model-name", "tiny")  # fmt: skip

# One parametrized case each in tests/test_load_faults.py. The two newer engines run only its
# Redis scenario, with half the requests (CI time); mlx-lm runs every scenario.
ENGINES = {
    "mlx-lm": Engine(
        "mlx-lm",
        _lm_model,
        (),
        lm_messages,
        _lm_answers,
        hot=("--prompt-cache-bytes", "150000"),
        heal_case=True,
    ),  # fmt: skip
    "mlx-vlm": Engine(
        "mlx-vlm",
        _vlm_model,
        ("--engine", "mlx-vlm", "--cache-block-size", "16"),
        vlm_messages,
        _vlm_answers,
        body=lambda model: {"model": model},
        scale=0.5,
    ),
    "vllm-mlx": Engine(
        "vllm-mlx",
        _lm_model,
        VLLM_FLAGS,
        lm_messages,
        _vllm_answers,
        body=lambda model: {"model": "tiny"},
        python=_vllm_python,
        own_home=True,
        scale=0.5,
    ),
}
