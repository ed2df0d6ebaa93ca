"""``mlxcache demo --model-kind lm``: ``mlxcache serve`` warm after a restart, over real HTTP.

Builds a tiny llama with seeded random weights and a locally trained tokenizer (nothing
downloaded), starts ``mlxcache serve`` on a free loopback port, sends a chat request cold,
kills the server (SIGKILL), starts a new one on the same cache and sends the same request and a
follow-up turn; a third server with an empty in-memory cache answers the follow-up uncached
for reference. Prints time to first token, tokens reused and whether the answers match. Each
run uses a fresh salt and deletes its entries at the end.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Sequence
from typing import Any, TextIO

from mlxcache.cli.progress import Progress
from mlxcache.integrations.mlx_lm.server import key_name, lm_identity
from mlxcache.prefix.cache import PrefixCache
from mlxcache.tiny_models import build_tiny_lm
from mlxcache.uri import default_uri

LM_SIZE = {"num_layers": 4, "hidden_size": 256, "num_heads": 4, "num_kv_heads": 4}
WORDS = "a cat a dog and a bird travel over the hills to the sea and back home".split()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Server:
    """One ``mlxcache serve`` subprocess on a free loopback port."""

    def __init__(self, model: str, cache: str, salt: str, log: str) -> None:
        self.port = _port()
        args = [sys.executable, "-m", "mlxcache", "serve", "--model", model, "--cache", cache,
                "--cache-salt", salt, "--host", "127.0.0.1", "--port", str(self.port)]  # fmt: skip
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        self._log = open(log, "ab")
        self.proc = subprocess.Popen(args, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2):
                    return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.kill()
                    raise RuntimeError(f"mlxcache serve did not start (log: {log})") from None
                time.sleep(0.2)

    def chat(self, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
        """Stream one chat completion: text, time to the first token and the usage."""
        body = {"messages": messages, "max_tokens": max_tokens, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        text, usage, first = [], None, None
        t0 = time.perf_counter()
        with urllib.request.urlopen(req, timeout=600) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                for choice in chunk.get("choices", []):
                    piece = choice.get("delta", {}).get("content")
                    if piece is not None:
                        first = first or time.perf_counter() - t0
                        text.append(piece)
                usage = chunk.get("usage") or usage
        usage = usage or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        return {"text": "".join(text), "ttft": first or 0.0, "cached": cached,
                "prompt": usage.get("prompt_tokens", 0)}  # fmt: skip

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        self._log.close()


def _table(rows: Sequence[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _clear(model_dir: str, uri: str, salt: str) -> None:
    """Delete this run's entries (the namespace ``mlxcache serve`` used for this model)."""
    import mlx_lm

    model, _ = mlx_lm.load(model_dir)
    name = lm_identity(model, key_name((model_dir, None, None), None))
    with PrefixCache(uri, model=name, salt=salt) as pc:
        pc.clear()


def run_lm_demo(
    cache_uri: str | None = None,
    *,
    prompt_tokens: int = 1536,
    max_tokens: int = 16,
    out: TextIO | None = None,
) -> int:
    """Run the demo on ``cache_uri``; 0 when the restarted server reused the prompt and matched."""
    out = out or sys.stdout
    uri = cache_uri or default_uri()
    if uri.lower().startswith("memory:"):
        print("mlxcache demo: a memory:// cache dies with the server; use file:// or redis://",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        import mlx_lm  # noqa: F401
    except ImportError:
        print("mlxcache demo --model-kind lm needs mlx-lm: pip install 'mlxcache[lm]'",
              file=sys.stderr)  # fmt: skip
        return 1

    salt = f"mlxcache-demo-{uuid.uuid4().hex[:16]}"
    work = tempfile.mkdtemp(prefix="mlxcache-demo-lm-")
    words = max(4, prompt_tokens * 3 // 4)
    ask = [{"role": "user", "content": " ".join(WORDS[i % len(WORDS)] for i in range(words))}]
    log = os.path.join(work, "serve.log")
    try:
        model = str(build_tiny_lm(os.path.join(work, "tiny-lm"), **LM_SIZE))
        with Progress("demo", total=3) as bar:
            bar.phase("mlxcache serve (tiny llama): a cold chat request, then SIGKILL")
            first = _Server(model, uri, salt, log)
            try:
                cold = first.chat(ask, max_tokens)
            finally:
                first.kill()  # no shutdown, no flush: what it answered is already stored
            bar.advance()
            bar.phase("a restarted server: the same request warm and a follow-up turn")
            follow = ask + [
                {"role": "assistant", "content": cold["text"]},
                {"role": "user", "content": "And then, what happened next?"},
            ]
            second = _Server(model, uri, salt, log)
            try:
                same = second.chat(ask, max_tokens)
                warm = second.chat(follow, max_tokens)
            finally:
                second.kill()
            bar.advance()
            bar.phase("a server without the shared cache: the follow-up uncached, for comparison")
            third = _Server(model, "memory://", salt, log)
            try:
                ref = third.chat(follow, max_tokens)
            finally:
                third.kill()
            bar.advance()
        try:
            _clear(model, uri, salt)
        except Exception as e:  # leaving entries behind is not worth failing the demo
            print(f"mlxcache demo: could not delete this run's entries: {e}", file=sys.stderr)
    except (RuntimeError, OSError, urllib.error.URLError) as e:
        print(f"mlxcache demo: {e}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(work, ignore_errors=True)

    same_ok, follow_ok = same["text"] == cold["text"], warm["text"] == ref["text"]

    def reused(r: dict[str, Any]) -> str:
        return f"{r['cached']} / {r['prompt']}"

    rows = [
        ("request", "server process", "time to first token", "tokens reused", "output"),
        ("cold", "1", f"{cold['ttft'] * 1000:.0f} ms", reused(cold), "(reference)"),
        ("same again", "2 (after SIGKILL of 1)", f"{same['ttft'] * 1000:.0f} ms", reused(same),
         "matches cold" if same_ok else "DIFFERS from cold"),
        ("follow-up turn", "2", f"{warm['ttft'] * 1000:.0f} ms", reused(warm),
         "matches uncached" if follow_ok else "DIFFERS from uncached"),
    ]  # fmt: skip
    print(f"mlxcache demo: mlxcache serve with a tiny llama (random weights), "
          f"{cold['prompt']}-token chat prompt, {max_tokens} greedy tokens, cache {uri}",
          file=out)  # fmt: skip
    print(_table(rows), file=out)
    ratio = cold["ttft"] / same["ttft"] if same["ttft"] > 0 else float("inf")
    print(f"warm time to first token after a restart: {ratio:.1f}x lower than cold", file=out)
    ok = same_ok and follow_ok and same["cached"] > 0 and warm["cached"] > 0
    if not ok and not (same["cached"] and warm["cached"]):
        print("the restarted server reused nothing: is the cache reachable and writable?", file=out)
    return 0 if ok else 1
