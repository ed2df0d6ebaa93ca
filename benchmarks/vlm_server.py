"""TTFT of a repeated image request: ``mlx_vlm.server`` with APC as shipped vs on mlxcache.

Both servers run as subprocesses on a local random-weight Qwen2-VL (``build_tiny_vlm``, widened
so a prefill of about a thousand tokens takes a noticeable time on a CPU), timed with real HTTP
requests carrying a base64 image: the time to a one-token answer (prefill plus one step).

- ``mlx_vlm.server APC cold``: the first request (reference); ``APC_ENABLED=1`` with a disk
  tier in a folder shared by both of its servers.
- ``... warm, same process``: the same request again. As shipped, mlx-vlm's APC drops a
  memory hit that holds image tokens, so this is cold again.
- ``... warm, second live server``: a second server on the same folder, running since before
  the first stored. As shipped, a server indexes the folder at start only.
- ``mlxcache serve --engine mlx-vlm`` rows: the same three on ``file://``.
Ratios are against the same run's shipped rows (> 1 = mlxcache serve is faster).
"""

from __future__ import annotations

import base64
import io
import os
import signal
import sys
from pathlib import Path
from typing import Any

from benchmarks.common import Row, Stats, have
from benchmarks.http_server import launch, timed_chat

SECTION = "server"
BENCH_MODEL = {
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "intermediate_size": 512,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
}
WORDS = "the cache keeps what the model has already computed so a repeated prompt skips it".split()


def _image(seed: int) -> str:
    """A 112x112 PNG data URL, a rectangle on a background, both colors from ``seed``."""
    from PIL import Image, ImageDraw

    im = Image.new("RGB", (112, 112), ((seed * 53) % 256, 90, 200))
    ImageDraw.Draw(im).rectangle([10 + seed % 40, 20, 80, 90], fill=(250, 10, (seed * 31) % 256))
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


class _Server:
    def __init__(self, args: list[str], log: Path, env: dict[str, str]) -> None:
        full = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", **env)
        self.proc, self.port, self._log = launch([sys.executable, "-m", *args], full, log)

    def ask(self, model: str, text: str, image: str) -> tuple[float, int, int]:
        """(seconds to a one-token answer, prompt tokens, cached tokens)."""
        content = [
            {"type": "image_url", "image_url": {"url": image}},
            {"type": "text", "text": text},
        ]
        body = {"model": model, "messages": [{"role": "user", "content": content}],
                "max_tokens": 1, "temperature": 0.0}  # fmt: skip
        dt, usage = timed_chat(self.port, body)
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        return dt, usage["prompt_tokens"], cached

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        self._log.close()


def _measure(cmd: list[str], env: dict[str, str], model: str, logs: Path, i: int) -> list[float]:
    """Seconds of [cold, warm same process, warm second server], prompt tokens, cached counts."""
    text = f"Request {i}. " + " ".join(WORDS[(j * 7 + i) % len(WORDS)] for j in range(700))
    image = _image(i)
    first = _Server(cmd, logs / "first.log", env)
    second = None
    try:
        second = _Server(cmd, logs / "second.log", env)  # both live before anything is stored
        first.ask(model, "Warm up.", _image(1000 + i))  # load and warm the kernels, untimed
        second.ask(model, "Warm up.", _image(2000 + i))
        cold, n, _ = first.ask(model, text, image)
        warm, _, c_warm = first.ask(model, text, image)
        peer, _, c_peer = second.ask(model, text, image)
    finally:
        first.stop()
        if second is not None:
            second.stop()
    return [cold, warm, peer, n, c_warm, c_peer]


def run(ctx: Any) -> list[Row]:
    if not have("mlx_vlm") or not have("mlxcache.integrations.mlx_vlm.server"):
        ctx.note("mlx-vlm is not installed: the mlx-vlm server TTFT rows are left out.")
        return []
    from mlxcache.tiny_models import build_tiny_vlm

    model = str(build_tiny_vlm(ctx.tmpdir / "server-vlm", **({} if ctx.smoke else BENCH_MODEL)))
    logs = ctx.tmpdir / "vlm-server-logs"
    logs.mkdir(exist_ok=True)
    runs = 1 if ctx.smoke else max(1, min(ctx.repeat, 2))
    shipped: list[list[float]] = []
    ours: list[list[float]] = []
    for i in range(runs):
        apc = {"APC_ENABLED": "1", "APC_DISK_PATH": str(ctx.tmpdir / f"apc-{i}")}
        shipped.append(_measure(["mlx_vlm.server", "--model", model], apc, model, logs, i))
        uri = f"file://{ctx.tmpdir / f'vlm-store-{i}'}"
        cmd = ["mlxcache", "serve", "--engine", "mlx-vlm", "--model", model, "--cache", uri]
        ours.append(_measure(cmd, {}, model, logs, i))
    tokens = int(shipped[0][3])
    labels = ("cold", "warm, same process", "warm, second live server")
    rows: list[Row] = []
    for k, label in enumerate(labels):
        base = Stats.of([m[k] for m in shipped])
        mine = Stats.of([m[k] for m in ours])
        name = f"mlx_vlm.server APC {label}"
        note = f"reference; cached_tokens {int(shipped[0][3 + k])}" if k else "reference"
        rows.append(Row(SECTION, name, tokens, None, "s", base, note=note))
        cached_ours = f"cached_tokens {int(ours[0][3 + k])}" if k else ""
        rows.append(
            Row(
                SECTION,
                f"mlxcache serve --engine mlx-vlm {label}",
                tokens,
                None,
                "s",
                mine,
                baseline=name,
                ratio=base.median / mine.median,
                ratio_kind="shipped APC / ours (>1 = faster)",
                note=cached_ours,
            )
        )
    return rows
