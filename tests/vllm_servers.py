"""vllm-mlx server subprocesses for the tests: ours (``mlxcache serve --engine vllm-mlx``) and
vllm-mlx as shipped, in the vllm-mlx venv (``.venv-vllm``, built by ``scripts/vllm_venv.sh``;
``$MLXCACHE_VLLM_PYTHON`` names another one)."""

from __future__ import annotations

import json
import os
import subprocess
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

from helpers import LoggedServer, read_stream, wait_until_healthy
from redis_server import free_port

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = os.environ.get("MLXCACHE_VLLM_PYTHON", str(ROOT / ".venv-vllm" / "bin" / "python"))
# vllm-mlx caches prompts of at least 128 tokens (its min_prefix_tokens): this one has ~330
TEXT = " ".join(f"item {i} is a cat, a dog or a bird by the sea." for i in range(30))
CHAT = [{"role": "user", "content": TEXT}]
BLOCK = "16"  # small blocks: the tiny prompts span many
NAME = "tiny"  # the served model name (vllm-mlx requires "model" in every request)


class Server(LoggedServer):
    """A vllm-mlx server subprocess on a free loopback port; its log goes to a file."""

    def __init__(self, args: list[str], log_path: Path, home: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        home.mkdir(parents=True, exist_ok=True)  # vllm-mlx's own disk cache lives under ~
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HOME=str(home))
        ours = args[2:4] == ["mlxcache", "serve"]
        args = [*args, *([] if ours else ["--host", "127.0.0.1"]), "--port", str(self.port)]
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen(args, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        wait_until_healthy(self, "vllm-mlx server", 180)
        if ours:  # the default address
            assert f"mlxcache serve: vllm-mlx will listen on {self.url}\n" in self.log()
            assert f"Uvicorn running on {self.url}" in self.log()

    def get(self, path: str) -> dict:
        with urllib.request.urlopen(self.url + path, timeout=30) as r:
            return json.load(r)

    def chat(
        self,
        messages=CHAT,
        max_tokens: int = 8,
        salt: str | None = None,
        header: str | None = None,
        stream: bool = False,
    ) -> tuple[str, int, int | None]:
        """(text, prompt_tokens, cached_tokens or None) of one greedy chat completion; ``salt``
        goes in the body's ``cache_salt``, ``header`` in ``X-Cache-Salt``; ``stream``: over
        server-sent events, the usage from the final chunk."""
        body = {"model": NAME, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0}
        body.update({} if salt is None else {"cache_salt": salt})
        headers = {} if header is None else {"X-Cache-Salt": header}
        if stream:
            text, usage = self._streamed(body, headers)
        else:
            out = self.post("/v1/chat/completions", body, headers)
            text, usage = out["choices"][0]["message"]["content"], out["usage"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        return text, usage["prompt_tokens"], cached

    def _streamed(self, body: dict, headers: dict) -> tuple[str, dict]:
        """The text and the final usage of a streamed chat completion."""
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        req = urllib.request.Request(
            self.url + "/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", **headers},
        )
        with urllib.request.urlopen(req, timeout=180) as r:
            text, usage = read_stream(r)
        assert usage is not None, "no usage chunk in the stream"
        return text, usage


def server_args(python: str, model: str, cache: str | None, reference: bool) -> list[str]:
    if reference:  # vllm-mlx as shipped, its prefix cache off
        args = [python, "-m", "vllm_mlx.cli", "serve", model, "--disable-prefix-cache"]
    else:
        args = [
            python,
            "-m",
            "mlxcache",
            "serve",
            "--engine",
            "vllm-mlx",
            "--model",
            model,
        ]
        args += ["--cache-block-size", BLOCK] + (["--cache", cache] if cache else [])
    return [*args, "--served-model-name", NAME]


def require_vllm_python() -> str:
    """The vllm-mlx venv's python; a clear failure (never a skip) when it is missing."""
    if not os.access(VLLM_PYTHON, os.X_OK):
        raise RuntimeError(f"no vllm-mlx venv at {VLLM_PYTHON}: run scripts/vllm_venv.sh first")
    return VLLM_PYTHON


def starter(python: str, model: str, folder: Path, *always: str) -> Iterator[Callable[..., Server]]:
    """A fixture body: yields ``start(cache, *extra, reference=False)``, which starts a server
    on ``model`` (with ``always`` before ``extra``), logs in ``folder``; all killed at the end."""
    started: list[Server] = []

    def start(cache: str | None, *extra: str, reference: bool = False) -> Server:
        n = len(started)
        args = [*server_args(python, model, cache, reference), *always, *extra]
        s = Server(args, folder / f"server{n}.log", folder / f"home{n}")
        started.append(s)
        return s

    yield start
    for s in started:
        s.kill()
