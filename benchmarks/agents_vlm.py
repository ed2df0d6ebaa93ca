"""The agent workload (benchmarks/agents.py) on mlx-vlm: mlxcache against mlx-vlm's own APC.

The tiny random-weight Gemma 3 of ``mlxcache.tiny_models`` (6 layers, a 64-token sliding
window on 2 of every 3), text prompts, greedy: mlxcache's ``mlx_vlm`` generation on a
``PrefixCache`` (``file://``) against mlx-vlm 0.7's automatic prefix cache, driven through its
own ``stream_generate(..., apc_manager=APCManager(...))`` with its defaults: one manager in one
process, two managers (two servers) each with its own memory, and two managers over one
``DiskBlockStore`` folder (what a second process or a restart finds on its disk tier). The
counts are mlx-vlm's ``cached_tokens`` and mlxcache's ``cached_tokens``.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from benchmarks.common import Row

FAMILY = "gemma3"


class _Ours:
    """A server on mlxcache's mlx-vlm generation over a shared ``PrefixCache``."""

    def __init__(self, model: Any, uri: str, block: int, salt: str) -> None:
        from mlxcache import PrefixCache

        self.model = model
        self.pc = PrefixCache(uri, model="agents-vlm", salt=salt, block_size=block, hot_bytes=0)

    def ask(self, prompt: list[int], answer: int) -> tuple[int, list[int]]:
        import mlx.core as mx

        from mlxcache.integrations.mlx_vlm import generate_tokens

        r = generate_tokens(self.model, mx.array([prompt]), None, cache=self.pc, max_tokens=answer)
        return r.cached_tokens, list(r.tokens)

    def close(self) -> None:
        self.pc.close()


class _APC:
    """A server on mlx-vlm's ``stream_generate`` with its own ``APCManager``."""

    def __init__(self, model: Any, disk: Path | None) -> None:
        from mlx_vlm import apc

        from benchmarks.peers_vlm import _Processor

        store = apc.DiskBlockStore(disk, namespace="agents") if disk is not None else None
        self.manager = apc.APCManager(block_size=apc.DEFAULT_BLOCK_SIZE, disk=store)
        self.model, self.proc = model, _Processor()

    def ask(self, prompt: list[int], answer: int) -> tuple[int, list[int]]:
        import mlx.core as mx
        from mlx_vlm.generate.dispatch import stream_generate

        cached, out = 0, []
        for i, r in enumerate(
            stream_generate(self.model, self.proc, "", input_ids=mx.array([prompt]),
                            pixel_values=None, apc_manager=self.manager, max_tokens=answer)
        ):  # fmt: skip
            cached = int(r.cached_tokens) if i == 0 else cached
            out.append(int(r.token))
        return cached, out[:answer]  # its last result repeats the last token

    def close(self) -> None:
        if self.manager.disk is not None:
            self.manager.disk.flush()


def run(size: dict[str, int], ctx: Any, workload: Any, count_row: Any) -> list[Row]:
    """mlxcache and APC side by side on the chat and document workloads."""
    from mlxcache.tiny_models import build_model

    model, _ = build_model(FAMILY, 0)
    rows = []
    for kind in ("chat", "document"):
        uri, salt = f"file://{ctx.tmpdir / 'agents-vlm'}", uuid.uuid4().hex
        disk = ctx.tmpdir / f"agents-apc-{kind}"
        sides = [
            ("mlxcache, one worker", _maker(_Ours, model, uri, size["block"], salt), 1),
            ("mlxcache, two workers", _maker(_Ours, model, uri, size["block"], salt + "-2"), 2),
            ("mlx-vlm APC, one worker", _maker(_APC, model, None), 1),
            ("mlx-vlm APC, two workers", _maker(_APC, model, None), 2),
            ("mlx-vlm APC, two workers on one disk tier", _maker(_APC, model, disk), 2),
        ]
        for who, make, workers in sides:
            got = workload(make, size, kind, workers)
            rows.append(count_row("sliding, mlx-vlm", FAMILY, kind, who, *got))
    return rows


def _maker(cls: Any, *args: Any) -> Any:
    return lambda: cls(*args)
