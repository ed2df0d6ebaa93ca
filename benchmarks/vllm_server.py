"""TTFT of a repeated prompt: ``vllm-mlx serve`` as shipped vs ``mlxcache serve --engine vllm-mlx``.

vllm-mlx 0.6 pins mlx-lm < 0.32 and hard-requires torchvision, so its servers run as
subprocesses in a venv of their own (``.venv-vllm``, built by ``scripts/vllm_venv.sh``;
``$MLXCACHE_VLLM_PYTHON`` names another one); without it the rows are left out with one note.
Timed with real HTTP requests: the time to a one-token chat answer (prefill plus one step).

Two cases, each on a local random-weight model: a text prompt on a tiny llama with
``--continuous-batching`` (vllm-mlx's ``MemoryAwarePrefixCache``), and an image request (base64
PNG) on a tiny Qwen2-VL with ``--mllm`` in simple mode (its ``MLLMPrefixCacheManager``).
For each, as shipped (its defaults, prefix cache on, one ``$HOME`` for all its servers so its
own disk cache would be found) and on mlxcache (``--cache file://...``):

- ``cold``: the first request (reference);
- ``warm, same process``: the same request again;
- ``warm, second live server``: a second server, running since before the first stored;
- ``after a restart (SIGKILL)``: both killed, a new server answers first thing (after an
  untimed warm-up on another prompt).
Ratios are shipped / ours in the same run (> 1 = mlxcache is faster). Left out of ``--smoke``:
its twelve server starts take about 90 s.
"""

from __future__ import annotations

import json
import os
import signal
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks.common import Row, Stats
from benchmarks.http_server import launch, timed_chat
from benchmarks.vlm_server import _image

SECTION = "server"
ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = os.environ.get("MLXCACHE_VLLM_PYTHON", str(ROOT / ".venv-vllm" / "bin" / "python"))
NAME = "tiny"  # the served model name (vllm-mlx requires "model" in every request)
LM = {"num_layers": 4, "hidden_size": 256, "num_heads": 4, "num_kv_heads": 4,
      "intermediate_size": 512}  # fmt: skip
VLM = {"hidden_size": 256, "num_hidden_layers": 4, "intermediate_size": 512,
       "num_attention_heads": 8, "num_key_value_heads": 2}  # fmt: skip
WORDS = "the cache keeps what the model has already computed so a repeated prompt skips it".split()
LABELS = ("cold", "warm, same process", "warm, second live server", "after a restart (SIGKILL)")


def _text(seed: int, words: int) -> str:
    return f"Request {seed}. " + " ".join(WORDS[(j * 7 + seed) % len(WORDS)] for j in range(words))


def _messages(text: str, image: str | None) -> list[dict[str, Any]]:
    if image is None:
        return [{"role": "user", "content": text}]
    content = [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": text}]
    return [{"role": "user", "content": content}]


class _Server:
    """One vllm-mlx server subprocess on a free loopback port; its log goes to a file."""

    def __init__(self, args: list[str], log: Path, home: Path) -> None:
        home.mkdir(parents=True, exist_ok=True)  # vllm-mlx's own disk cache lives under ~
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HOME=str(home))
        self.proc, self.port, self._log = launch(args, env, log, cwd=ROOT)

    def ask(self, messages: list[dict[str, Any]]) -> tuple[float, int, str]:
        """(seconds to a one-token answer, prompt tokens, its ``cached_tokens`` as text)."""
        body = {"model": NAME, "messages": messages, "max_tokens": 1, "temperature": 0.0}
        dt, usage = timed_chat(self.port, body)
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        return dt, int(usage["prompt_tokens"]), "not reported" if cached is None else str(cached)

    def saved(self) -> tuple[int, int]:
        """(hits, tokens_saved) as vllm-mlx's own ``GET /v1/cache/stats`` counts them so far."""
        with urllib.request.urlopen(
            f"http://127.0.0.1:{self.port}/v1/cache/stats", timeout=30
        ) as r:
            stats = json.load(r).get("engine_cache") or {}
        stats = stats.get("mllm_cache", stats)
        return int(stats.get("hits") or 0), int(stats.get("tokens_saved") or 0)

    def timed(self, messages: list[dict[str, Any]]) -> tuple[float, int, str]:
        """(seconds, prompt tokens, what the server says it reused) of one request."""
        h0, s0 = self.saved()
        dt, n, cached = self.ask(messages)
        h1, s1 = self.saved()
        return dt, n, f"cached_tokens {cached}; its stats: {h1 - h0} hit(s), {s1 - s0} tokens saved"

    def stop(self) -> None:
        """SIGKILL: nothing flushes, nothing is saved at shutdown."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        self._log.close()


def _measure(
    cmd: list[str], home: Path, logs: Path, image: bool, words: int
) -> tuple[list[float], int, list[str]]:
    """Seconds of the four LABELS, the prompt's tokens and what was reused in each."""
    prompt = _messages(_text(1, words), _image(1) if image else None)
    warm_up = [_messages(_text(100 + k, 20), _image(100 + k) if image else None) for k in (0, 1, 2)]
    first = _Server(cmd, logs / "first.log", home)
    second = None
    try:
        second = _Server(cmd, logs / "second.log", home)  # both live before anything is stored
        first.ask(warm_up[0])  # load and warm the kernels, untimed
        second.ask(warm_up[1])
        cold, n, c0 = first.timed(prompt)
        warm, _, c1 = first.timed(prompt)
        peer, _, c2 = second.timed(prompt)
    finally:
        first.stop()
        if second is not None:
            second.stop()
    third = _Server(cmd, logs / "restart.log", home)
    try:
        third.ask(warm_up[2])
        restart, _, c3 = third.timed(prompt)
    finally:
        third.stop()
    return [cold, warm, peer, restart], n, [c0, c1, c2, c3]


def run(ctx: Any) -> list[Row]:
    if ctx.smoke:
        ctx.note("vllm-mlx server TTFT rows are left out of --smoke (twelve server starts).")
        return []
    if not os.access(VLLM_PYTHON, os.X_OK):
        ctx.note(
            f"no vllm-mlx venv at {VLLM_PYTHON} (scripts/vllm_venv.sh builds it): the vllm-mlx "
            "server TTFT rows are left out."
        )
        return []
    from mlxcache.tiny_models import build_tiny_lm, build_tiny_vlm

    cases = (
        ("text", str(build_tiny_lm(ctx.tmpdir / "vllm-lm", **LM)), "--continuous-batching", 600),
        ("image", str(build_tiny_vlm(ctx.tmpdir / "vllm-vlm", **VLM)), "--mllm", 300),
    )
    rows: list[Row] = []
    for kind, model, flag, words in cases:
        base = ctx.tmpdir / f"vllm-{kind}"
        for d in ("shipped", "ours"):
            (base / d).mkdir(parents=True, exist_ok=True)
        py = VLLM_PYTHON
        shipped_cmd = [py, "-m", "vllm_mlx.cli", "serve", model, flag, "--served-model-name", NAME]
        ours_cmd = [py, "-m", "mlxcache", "serve", "--engine", "vllm-mlx", "--model", model, flag,
                    "--cache", f"file://{base / 'store'}", "--served-model-name", NAME]  # fmt: skip
        shipped, tokens, c_shipped = _measure(
            shipped_cmd, base / "home-shipped", base / "shipped", kind == "image", words
        )
        ours, _, c_ours = _measure(
            ours_cmd, base / "home-ours", base / "ours", kind == "image", words
        )
        what = "text, --continuous-batching" if kind == "text" else "image, --mllm simple mode"
        for k, label in enumerate(LABELS):
            name = f"vllm-mlx serve ({what}) {label}"
            note = f"reference; {c_shipped[k]}" if k == 0 else c_shipped[k]
            rows.append(Row(SECTION, name, tokens, None, "s", Stats.of([shipped[k]]), note=note))
            rows.append(
                Row(
                    SECTION,
                    f"mlxcache serve --engine vllm-mlx ({what}) {label}",
                    tokens,
                    None,
                    "s",
                    Stats.of([ours[k]]),
                    baseline=name,
                    ratio=shipped[k] / ours[k],
                    ratio_kind="shipped / ours (>1 = faster)",
                    note=c_ours[k],
                )
            )
    return rows
