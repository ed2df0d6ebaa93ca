"""``usage.prompt_tokens_details.cached_tokens`` in vllm-mlx's responses, as mlx-lm reports it.

vllm-mlx 0.6 knows per request how many prompt tokens came from its prefix cache
(``Request.cached_tokens``, reset to 0 when the scheduler drops a cache and prefills in full)
but its ``Usage`` has no field for it, and the count would have to cross the scheduler's
``RequestOutput``, the engine's ``GenerationOutput`` and the server's handlers, which copy
``prompt_tokens`` from one to the next. So the count rides on ``prompt_tokens`` itself: an
``int`` that also carries ``cached_tokens`` (``PromptCount``, equal to the plain number in
every computation), and ``Usage`` gains an optional ``prompt_tokens_details`` it fills from it
(the Responses API's ``usage.input_tokens_details.cached_tokens`` likewise).
A sum of counts (``/v1/completions`` adds up its choices) keeps the sum of cached tokens.
"""

from __future__ import annotations

from typing import Any

_saved: dict[str, Any] = {}


class PromptCount(int):
    """A prompt's token count that also says how many of them came from a cache."""

    cached_tokens: int

    def __new__(cls, value: int, cached_tokens: int = 0) -> PromptCount:
        out = super().__new__(cls, value)
        out.cached_tokens = max(0, min(int(cached_tokens or 0), int(value)))
        return out

    def __add__(self, other: object) -> int:
        # a sum of counts (the prompts of several choices) keeps the sum of cached tokens
        if isinstance(other, int) and not isinstance(other, bool):
            extra = getattr(other, "cached_tokens", 0)
            return PromptCount(int(self) + int(other), self.cached_tokens + extra)
        return NotImplemented

    __radd__ = __add__


def _count_property() -> property:
    def get(self: Any) -> int:
        n = self.__dict__.get("_mlxcache_prompt_tokens", 0)
        return PromptCount(n, getattr(self, "cached_tokens", 0) or 0)

    def put(self: Any, value: int) -> None:
        self.__dict__["_mlxcache_prompt_tokens"] = int(value)

    return property(get, put)


def install() -> None:
    """Report cached prompt tokens in ``usage`` (idempotent; ``uninstall()`` undoes it)."""
    if _saved:
        return
    from pydantic import BaseModel
    from pydantic.fields import FieldInfo
    from vllm_mlx.api import models
    from vllm_mlx.request import Request

    usage = models.Usage
    _saved.update(
        request_count=Request.__dict__.get("num_prompt_tokens", 0),
        usage_init=usage.__dict__.get("__init__"),
        usage_fields=dict(usage.model_fields),
    )
    Request.num_prompt_tokens = _count_property()
    usage.model_fields["prompt_tokens_details"] = FieldInfo(
        annotation=dict[str, int] | None, default=None
    )
    original_init = usage.__init__

    def __init__(self: Any, /, **data: Any) -> None:  # noqa: N807 - the model's own __init__
        cached = getattr(data.get("prompt_tokens"), "cached_tokens", None)
        original_init(self, **data)
        if cached is not None and getattr(self, "prompt_tokens_details", None) is None:
            self.prompt_tokens_details = {"cached_tokens": int(cached)}

    usage.__init__ = __init__
    _rebuild(models, usage, BaseModel)
    _saved["responses_init"] = _responses_install()


def _responses_install() -> Any:
    """The Responses API's ``usage.input_tokens_details.cached_tokens``, from the count."""
    from vllm_mlx.api.responses_models import ResponsesInputTokenDetails, ResponsesUsage

    saved = ResponsesUsage.__dict__.get("__init__")
    original_init = ResponsesUsage.__init__

    def __init__(self: Any, /, **data: Any) -> None:  # noqa: N807 - the model's own __init__
        cached = getattr(data.get("input_tokens"), "cached_tokens", None)
        if cached is not None and data.get("input_tokens_details") is None:
            data["input_tokens_details"] = ResponsesInputTokenDetails(cached_tokens=int(cached))
        original_init(self, **data)

    ResponsesUsage.__init__ = __init__
    return saved


def _rebuild(models: Any, usage: Any, base: type) -> None:
    """Rebuild ``Usage`` and every response model that embeds it (their schemas copy it)."""
    usage.model_rebuild(force=True)
    for value in vars(models).values():
        if isinstance(value, type) and issubclass(value, base) and value is not usage:
            if value.__module__ == models.__name__:
                model: Any = value
                model.model_rebuild(force=True)


def uninstall() -> None:
    """Undo ``install()``."""
    if not _saved:
        return
    from pydantic import BaseModel
    from vllm_mlx.api import models
    from vllm_mlx.request import Request

    Request.num_prompt_tokens = _saved["request_count"]
    from vllm_mlx.api.responses_models import ResponsesUsage

    if _saved["responses_init"] is None:
        del ResponsesUsage.__init__
    else:
        ResponsesUsage.__init__ = _saved["responses_init"]
    usage = models.Usage
    if _saved["usage_init"] is None:
        del usage.__init__
    else:
        usage.__init__ = _saved["usage_init"]
    usage.model_fields.clear()
    usage.model_fields.update(_saved["usage_fields"])
    _rebuild(models, usage, BaseModel)
    _saved.clear()
