"""Anthropic Messages usage in vllm-mlx's responses: ``cache_read_input_tokens``.

vllm-mlx 0.6 fills ``AnthropicUsage.input_tokens`` with the prompt's whole length and never
sets ``cache_read_input_tokens``; its stream sends ``input_tokens: 0`` in ``message_start``
(sent before generation starts) and only ``output_tokens`` in the final ``message_delta``.
With ``install()``, as the Messages API counts: ``input_tokens`` is what was computed and
``cache_read_input_tokens`` what came from the cache (``usage.PromptCount`` carries both),
non-streamed, in ``message_start`` (held back until the engine's first output, when the
count is known) and in the final ``message_delta``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

_saved: dict[str, Any] = {}


def split(prompt_tokens: Any) -> dict[str, int]:
    """``input_tokens`` (computed) and ``cache_read_input_tokens`` of a prompt count."""
    cached = int(getattr(prompt_tokens, "cached_tokens", 0) or 0)
    return {"input_tokens": int(prompt_tokens) - cached, "cache_read_input_tokens": cached}


class _Watched:
    """An engine whose ``stream_chat`` outputs' prompt count is kept in ``prompt``."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.prompt: int | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def stream_chat(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        async for output in self._engine.stream_chat(*args, **kwargs):
            if getattr(output, "prompt_tokens", 0):
                self.prompt = output.prompt_tokens
            yield output


def _with_usage(event: str, prompt: int) -> str:
    """An SSE event with the prompt's usage in ``message_start`` and ``message_delta``."""
    head, sep, data = event.partition("data: ")
    kind = head.strip().removeprefix("event: ")
    if not sep or kind not in ("message_start", "message_delta"):
        return event
    body = json.loads(data)
    usage = body["message"]["usage"] if kind == "message_start" else body.setdefault("usage", {})
    usage.update(split(prompt))
    return f"{head}data: {json.dumps(body)}\n\n"


def _stream(original: Any) -> Any:
    async def stream(engine: Any, *args: Any, **kwargs: Any) -> AsyncIterator[str]:
        watched = _Watched(engine)
        held: list[str] | None = []  # events before the engine's first output
        try:
            async for event in original(watched, *args, **kwargs):
                if held is not None and watched.prompt is None:
                    held.append(event)
                    continue
                if held is not None:
                    for early in held:
                        yield _with_usage(early, watched.prompt or 0)
                    held = None
                yield _with_usage(event, watched.prompt or 0)
        except Exception:
            for early in held or []:  # the client still gets what was sent before the error
                yield early
            raise
        for early in held or []:  # the engine gave no output: vllm-mlx's events, unchanged
            yield early

    return stream


def install() -> None:
    """Report cache reads in Anthropic usage (idempotent; ``uninstall()`` undoes it)."""
    if _saved:
        return
    from vllm_mlx import server
    from vllm_mlx.api.anthropic_models import AnthropicUsage

    original_init = AnthropicUsage.__init__
    _saved.update(init=AnthropicUsage.__dict__.get("__init__"), stream=server.__dict__.get(
        "_stream_anthropic_messages"))  # fmt: skip

    def __init__(self: Any, /, **data: Any) -> None:  # noqa: N807 - the model's own __init__
        count = data.get("input_tokens")
        if hasattr(count, "cached_tokens") and data.get("cache_read_input_tokens") is None:
            data.update(split(count))
        original_init(self, **data)

    AnthropicUsage.__init__ = __init__
    if _saved["stream"] is not None:
        server._stream_anthropic_messages = _stream(_saved["stream"])


def uninstall() -> None:
    """Undo ``install()``."""
    if not _saved:
        return
    from vllm_mlx import server
    from vllm_mlx.api.anthropic_models import AnthropicUsage

    if _saved["init"] is None:
        del AnthropicUsage.__init__
    else:
        AnthropicUsage.__init__ = _saved["init"]
    if _saved["stream"] is not None:
        server._stream_anthropic_messages = _saved["stream"]
    _saved.clear()
