"""A real ``mlxcache serve --engine mlx-vlm`` (or ``python -m mlx_vlm.server``) subprocess.

Tests talk to it with urllib as an OpenAI client would, sending images as base64 data URIs.
"""

from __future__ import annotations

import base64
import io
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request

from helpers import LoggedServer, wait_until_healthy
from PIL import Image, ImageDraw
from redis_server import free_port

QUESTION = "Describe this image. What colour is the square?"


def image(name: str) -> str:
    """A small PNG as a data URI: A, B and C differ in colour and shape."""
    colour = {"A": (255, 255, 255), "B": (0, 0, 128), "C": (0, 160, 0)}[name]
    im = Image.new("RGB", (112, 112), colour)
    draw = ImageDraw.Draw(im)
    if name == "A":
        draw.rectangle([20, 20, 70, 70], fill=(220, 0, 0))
    elif name == "B":
        draw.ellipse([30, 10, 100, 90], fill=(250, 250, 0))
    else:
        draw.line([0, 0, 111, 111], fill=(0, 0, 0), width=9)
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def user_turn(images=("A",), text: str = QUESTION) -> dict:
    """One user message: the images (data URIs), then the text."""
    content: list = [{"type": "image_url", "image_url": {"url": image(n)}} for n in images]
    content.append({"type": "text", "text": text})
    return {"role": "user", "content": content}


class VlmServer(LoggedServer):
    """The server in a subprocess on a free loopback port; its log goes to a file."""

    def __init__(
        self,
        model: str,
        cache: str | None,
        log_path,
        *extra: str,
        plain=False,
        apc=False,
        env: dict[str, str] | None = None,
    ) -> None:
        self.model = model
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", **(env or {}))
        env.pop("APC_ENABLED", None)
        if plain and apc:  # mlx-vlm's own APC, in its process only (no disk tier)
            env.update(APC_ENABLED="1", APC_DISK_ENABLED="0")
        if plain:  # mlx-vlm's own server, its cache off unless ``apc``
            args = [sys.executable, "-m", "mlx_vlm.server"]
        else:
            args = [sys.executable, "-m", "mlxcache", "serve", "--engine", "mlx-vlm"]
            args += ["--cache", cache] if cache is not None else []
        args += ["--model", model, "--port", str(self.port), *extra]
        args += ["--host", "127.0.0.1"] if plain else []  # ours: the default address
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen(args, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        wait_until_healthy(self, "the server", 180)
        if not plain:
            assert f"mlxcache serve: mlx-vlm will listen on {self.url}\n" in self.log()
            assert f"Uvicorn running on {self.url}" in self.log()
            # mlx-vlm's self-check fails a model with no make_cache although its APC works
            assert "APC self-check failed" not in self.log()
            assert "mlxcache APC: the prompt cache (" in self.log()

    def chat(
        self, images=("A",), text: str = QUESTION, max_tokens: int = 8, salt=None, header=None
    ):
        """(text, prompt_tokens, cached_tokens) of one greedy chat completion; ``salt`` goes in
        the body's ``cache_salt``, ``header`` in ``X-Cache-Salt``."""
        messages = [user_turn(images, text)]
        return self.send(messages, max_tokens, salt=salt, header=header)

    def send(self, messages: list, max_tokens: int = 8, salt=None, header=None):
        """(text, prompt_tokens, cached_tokens) of one greedy chat completion of ``messages``."""
        body = {
            "model": self.model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0.0,
        }
        body.update({} if salt is None else {"cache_salt": salt})
        headers = {"Content-Type": "application/json"}
        headers.update({} if header is None else {"X-Cache-Salt": header})
        req = urllib.request.Request(
            self.url + "/v1/chat/completions", data=json.dumps(body).encode(), headers=headers
        )
        with urllib.request.urlopen(req, timeout=180) as r:
            out = json.load(r)
        usage = out["usage"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        return out["choices"][0]["message"]["content"], usage["prompt_tokens"], cached

    def get(self, path: str) -> str:
        with urllib.request.urlopen(self.url + path, timeout=30) as r:
            return r.read().decode()
