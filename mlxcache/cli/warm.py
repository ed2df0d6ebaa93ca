"""``mlxcache warm``: prefill a list of prompts into a cache before traffic arrives.

Each line of the input is one JSON object::

    {"model": "/path/to/mlx-lm-model" or "tiny", "messages": [{"role": "user", ...}], "pin": true}
    {"model": "tiny", "token_ids": [1, 2, 3]}

``messages`` go through the tokenizer's chat template (with the generation prompt, as
``mlx_lm.server`` does); ``token_ids`` are used as they are. Each prompt is prefilled with
:func:`mlxcache.integrations.mlx_lm.prefill` on a :class:`~mlxcache.prefix.PrefixCache`
(identity: :func:`~mlxcache.prefix.model_id.model_identity` of the loaded model), so a later request
with the same prompt and block size restores it instead of computing it. ``"tiny"`` is
:func:`mlxcache.tiny_models.build_tiny_lm`'s model (for tests and demos). Image prompts
(mlx-vlm) are not supported yet.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from mlxcache.cli.progress import Progress
from mlxcache.integrations.mlx_lm.generate import prefill
from mlxcache.prefix.cache import PrefixCache
from mlxcache.prefix.model_id import model_identity
from mlxcache.tiny_models import build_tiny_lm
from mlxcache.uri import open_backend

_FIELDS = {"model", "messages", "token_ids", "pin"}


def load_prompts(path: str | Path) -> list[dict[str, Any]]:
    """The prompts of a JSON-lines file (blank lines skipped); a malformed line is ValueError."""
    out: list[dict[str, Any]] = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n}: not JSON ({exc.msg})") from None
            out.append(check_prompt(item, f"{path}:{n}") | {"line": n})
    return out


def check_prompt(item: Any, where: str) -> dict[str, Any]:
    """``item`` if it is a valid prompt object, else ValueError naming ``where``."""
    if not isinstance(item, dict):
        raise ValueError(f"{where}: expected a JSON object")
    unknown = set(item) - _FIELDS
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
    if not isinstance(item.get("model"), str) or not item["model"]:
        raise ValueError(f"{where}: 'model' must be a model folder path or \"tiny\"")
    if ("messages" in item) == ("token_ids" in item):
        raise ValueError(f"{where}: give exactly one of 'messages' or 'token_ids'")
    if "messages" in item and not (isinstance(item["messages"], list) and item["messages"]):
        raise ValueError(f"{where}: 'messages' must be a non-empty list of chat messages")
    ids = item.get("token_ids")
    if ids is not None and not (
        isinstance(ids, list) and len(ids) >= 2 and all(type(t) is int and t >= 0 for t in ids)
    ):
        raise ValueError(f"{where}: 'token_ids' must be a list of >= 2 ints >= 0")
    if not isinstance(item.get("pin", False), bool):
        raise ValueError(f"{where}: 'pin' must be true or false")
    return dict(item)


class _Models:
    """Models loaded once per path for the whole run."""

    def __init__(self) -> None:
        self._loaded: dict[str, tuple[Any, Any, str]] = {}
        self._tmp: tempfile.TemporaryDirectory | None = None

    def get(self, name: str) -> tuple[Any, Any, str]:
        if name not in self._loaded:
            import mlx_lm  # here: mlx-lm is an optional dependency (the lm extra)

            path = name
            if name == "tiny":
                self._tmp = self._tmp or tempfile.TemporaryDirectory(prefix="mlxcache-warm-")
                path = str(build_tiny_lm(Path(self._tmp.name) / "tiny"))
            elif not Path(path).is_dir():
                raise ValueError(f"model folder {name!r} does not exist")
            model, tokenizer = mlx_lm.load(path)
            self._loaded[name] = (model, tokenizer, model_identity(model))
        return self._loaded[name]

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()


def prompt_ids(item: dict[str, Any], tokenizer: Any) -> list[int]:
    """The token ids of one prompt (through the chat template for ``messages``)."""
    if "token_ids" in item:
        return list(item["token_ids"])
    ids = tokenizer.apply_chat_template(item["messages"], add_generation_prompt=True)
    ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
    if len(ids) < 2:
        raise ValueError("the chat template gave fewer than 2 tokens")
    return ids


def warm(
    uri: str,
    prompts: Sequence[dict[str, Any]],
    *,
    block_size: int = 256,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    stream: TextIO | None = None,
    lines: TextIO | None = None,
) -> dict[str, Any]:
    """Prefill every prompt into the cache at ``uri``; a report of each (never raises for one).

    A prompt fails (``error`` set) when its model cannot be loaded, its messages cannot be
    templated, or the store failed while it was written (``stats()["errors"]`` grew). ``lines``
    gets one progress line per prompt; ``stream`` (a terminal) the progress bar.
    """
    backend = open_backend(uri)
    models = _Models()
    caches: dict[str, PrefixCache] = {}
    report: list[dict[str, Any]] = []
    try:
        with Progress("warm", len(prompts), stream=stream) as bar:
            for i, item in enumerate(prompts, 1):
                row: dict[str, Any] = {
                    "line": item.get("line", i), "model": item["model"], "tokens": 0,
                    "cached": 0, "stored": 0, "pinned": False, "error": None,
                }  # fmt: skip
                before = int(backend.stats().get("errors", 0))
                try:
                    model, tokenizer, identity = models.get(item["model"])
                    cache = caches.get(identity)
                    if cache is None:
                        # no hot tier: each prompt is looked up once, and _pin's lookup must
                        # see what the backend kept
                        cache = caches[identity] = PrefixCache(
                            backend,
                            model=identity,
                            block_size=block_size,
                            kv_bits=kv_bits,
                            kv_group_size=kv_group_size,
                            hot_bytes=0,
                        )
                    ids = prompt_ids(item, tokenizer)
                    done = prefill(model, ids, cache=cache)
                    row.update(
                        tokens=len(ids), cached=done.num_cached_tokens,
                        stored=done.num_stored_tokens,
                    )  # fmt: skip
                    if item.get("pin"):
                        row["pinned"] = _pin(cache, ids[:-1])
                        if not row["pinned"]:
                            row["error"] = "not pinned (pin_max_bytes full, or not stored)"
                except Exception as exc:  # one bad prompt (model, template) fails only itself
                    row["error"] = f"{type(exc).__name__}: {exc}"
                if row["error"] is None and int(backend.stats().get("errors", 0)) > before:
                    row["error"] = getattr(backend, "last_error", None) or "the store failed"
                report.append(row)
                bar.advance()
                if lines is not None:
                    state = "FAILED: " + row["error"] if row["error"] else (
                        f"{row['cached']} cached, {row['stored']} stored"
                        + (", pinned" if row["pinned"] else "")
                    )  # fmt: skip
                    print(
                        f"warm {i}/{len(prompts)} (line {row['line']}): "
                        f"{row['tokens']} tokens, {state}",
                        file=lines,
                        flush=True,
                    )
    finally:
        models.close()
        backend.close()
    failed = sum(1 for r in report if r["error"])
    return {"prompts": report, "ok": len(report) - failed, "failed": failed}


def _pin(cache: Any, tokens: list[int]) -> bool:
    """Pin the stored records of ``tokens`` (what prefill stored: all but the last token)."""
    if not getattr(cache.backend, "pinnable", False):
        raise NotImplementedError(f"{type(cache.backend).__name__} cannot pin entries")
    hit = cache.lookup(tokens)
    if hit is None or hit.num_tokens != len(tokens) or hit.prompt_cache is None:
        return False
    before = cache.stats()["pins_refused"]
    cache.store(tokens, hit.prompt_cache, pin=True)  # nothing is written again: all exist
    return cache.stats()["pins_refused"] == before
