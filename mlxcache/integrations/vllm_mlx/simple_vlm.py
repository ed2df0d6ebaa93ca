"""vllm-mlx's simple-mode VLM path (``--mllm`` without ``--continuous-batching``) on the tier.

vllm-mlx 0.6's ``MLXMultimodalLM.chat`` asks its in-memory ``MLLMPrefixCacheManager``, counts
a hit, and then, when the request has images, throws the cached KV away and prefills from
scratch ("delegating to mlx-vlm"). ``install(config)`` changes two things:

- ``chat`` runs with ``mlx_vlm.generate`` (which it imports at call time) answered by
  mlxcache's ``cached_generate`` on a ``PrefixCache`` of the installed backend, keyed by
  model, tokens and images (by content, in order): the longest stored prefix is restored and
  only the rest is prefilled; greedy answers equal mlx-vlm's uncached ones. Only requests with
  images and a sampling mlxcache reproduces exactly (greedy, or plain temperature) are taken
  over; any other goes to mlx-vlm as before;
- ``vllm_mlx.models.mllm.MLLMPrefixCacheManager`` is mlxcache's compatible manager on the
  backend (model in every key). For a request taken over it answers "miss" and stores
  nothing (the ``PrefixCache`` holds the KV), and its stats count the reuse that happened.

``stream_chat`` and ``generate`` keep vllm-mlx's own code, on the shared manager.
"""

from __future__ import annotations

import contextvars
import hashlib
import logging
import threading
from typing import Any

from mlxcache.integrations.vllm_mlx.mllm_cache import MLLMPrefixCacheManager
from mlxcache.integrations.vllm_mlx.shared_tier import ERRORS, TIER_FORMAT, TierConfig, identity
from mlxcache.integrations.vllm_mlx.usage import PromptCount
from mlxcache.prefix import PrefixCache

log = logging.getLogger("mlxcache")

_active: contextvars.ContextVar[bool] = contextvars.ContextVar("mlxcache_vllm_chat", default=False)
_saved: dict[str, Any] = {}
# sampling settings that leave mlx-vlm's sampling what mlxcache's sampler does
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "top_p": (None, 1.0), "top_k": (None, 0, -1), "min_p": (None, 0.0),
    "repetition_penalty": (None, 1.0), "presence_penalty": (None, 0.0),
    "frequency_penalty": (None, 0.0), "logits_processors": (None, [], ()),
    "audio": (None, [], ()), "tools": (None, [], ()),
}  # fmt: skip
_SAMPLER = {"top_p", "top_k", "min_p"}  # no effect on a greedy (temperature 0) choice
_IGNORED = {"verbose", "prompt_cache", "skip_prompt_processing", "stop", "chat_template_kwargs"}


def _plain(temperature: Any, kwargs: dict[str, Any]) -> bool:
    """Whether mlxcache's sampler gives exactly what mlx-vlm would for these settings."""
    if not isinstance(temperature, int | float) or temperature < 0:
        return False
    for k, v in kwargs.items():
        if k in _IGNORED or (k in _SAMPLER and temperature == 0):
            continue
        if k not in _NEUTRAL or not any(v == ok for ok in _NEUTRAL[k]):
            return False
    return True


class _Prefixes:
    """One ``PrefixCache`` per loaded model, with the counters the manager reports."""

    def __init__(self, config: TierConfig) -> None:
        self.config = config
        self._by_model: dict[int, PrefixCache] = {}
        self._lock = threading.Lock()
        self.counts = dict.fromkeys(("requests", "hits", "tokens_reused", "errors"), 0)

    def of(self, model: Any) -> PrefixCache:
        with self._lock:
            pc = self._by_model.get(id(model))
            if pc is None:
                cfg = getattr(model, "config", None)
                image_token = getattr(cfg, "image_token_index", None)
                if image_token is None:
                    image_token = getattr(cfg, "image_token_id", None)
                pc = PrefixCache(
                    self.config.backend,
                    model=identity(model, self.config),
                    block_size=self.config.block_size,
                    salt=self.config.salt,
                    image_token_id=image_token,
                    hot_bytes=0,
                )
                self._by_model[id(model)] = pc
            return pc

    def count(self, **kw: int) -> None:
        with self._lock:
            for k, v in kw.items():
                self.counts[k] += v


def _generate(original: Any, prefixes: _Prefixes) -> Any:
    """``mlx_vlm.generate`` that, inside a taken-over ``chat``, runs on the ``PrefixCache``."""

    def generate(model: Any, processor: Any, prompt: Any = None, image: Any = None, *args: Any,
                 **kwargs: Any) -> Any:  # fmt: skip
        if not _active.get() or not image or args:
            return original(model, processor, prompt, image, *args, **kwargs)
        from mlxcache.integrations.mlx_vlm import cached_generate

        temperature = kwargs.get("temperature", 0.0)
        try:
            pc = prefixes.of(model)
            out = cached_generate(model, processor, prompt, image, cache=pc,
                                  max_tokens=kwargs.get("max_tokens", 256),
                                  temperature=temperature)  # fmt: skip
        except Exception as e:  # mlxcache cannot run it: mlx-vlm does, uncached
            log.warning("vllm-mlx simple VLM: cached generation failed, running uncached: %s", e)
            prefixes.count(errors=1)
            ERRORS.add("lookup")
            return original(model, processor, prompt, image, *args, **kwargs)
        cached = int(getattr(out, "cached_tokens", 0) or 0)
        prefixes.count(requests=1, hits=int(cached > 0), tokens_reused=cached)
        out.prompt_tokens = PromptCount(out.prompt_tokens, cached)
        out.generation_tokens = len(getattr(out, "tokens", []) or [])  # type: ignore[attr-defined]
        return out

    return generate


def manager_class(config: TierConfig, prefixes: _Prefixes) -> type:
    """vllm-mlx's ``MLLMPrefixCacheManager`` signature over mlxcache's on the backend."""
    name = f"vllm-mlx-{config.engine_version}/{TIER_FORMAT}/{config.model_name or ''}"
    space = hashlib.sha256(f"{name}\0{config.salt}".encode()).hexdigest()[:16]

    class SharedMLLMPrefixCacheManager(MLLMPrefixCacheManager):
        """mlxcache's ``MLLMPrefixCacheManager`` on the installed backend."""

        def __init__(self, max_entries: int = 50, max_memory_mb: int = 2048, **kwargs: Any):
            kwargs.setdefault("backend", config.backend)  # given, so never closed here
            super().__init__(max_entries, max_memory_mb, **kwargs)

        def _keys(self, images: Any, prompt: str) -> tuple[str, str]:
            group, key = super()._keys(images, prompt)
            return f"{space}.{group}", key.replace(group, f"{space}.{group}", 1)

        def fetch(self, *args: Any, **kwargs: Any) -> Any:
            if _active.get():  # the PrefixCache answers this request
                return None, 0
            return super().fetch(*args, **kwargs)

        def store(self, *args: Any, **kwargs: Any) -> Any:
            if _active.get():
                return None
            return super().store(*args, **kwargs)

        def get_stats(self) -> dict[str, Any]:
            out = super().get_stats()
            with prefixes._lock:
                counts = dict(prefixes.counts)
            out["mlxcache"] = counts
            out["hits"] = out.get("hits", 0) + counts["hits"]
            out["tokens_saved"] = out.get("tokens_saved", 0) + counts["tokens_reused"]
            asked = out["hits"] + out.get("misses", 0) + counts["requests"] - counts["hits"]
            out["hit_rate"] = out["hits"] / asked if asked else 0.0
            return out

    return SharedMLLMPrefixCacheManager


def install(config: TierConfig) -> None:
    """Take over simple-mode ``chat`` requests with images (``uninstall()`` undoes it)."""
    if _saved:
        return
    import mlx_vlm
    from vllm_mlx.models import mllm

    prefixes = _Prefixes(config)
    chat = mllm.MLXMultimodalLM.chat
    _saved.update(generate=mlx_vlm.generate, chat=chat, manager=mllm.MLLMPrefixCacheManager)

    def cached_chat(self: Any, messages: list[dict], max_tokens: int = 256,
                    temperature: float = 0.7, **kwargs: Any) -> Any:  # fmt: skip
        plain = _plain(temperature, kwargs)
        if not plain:
            log.info("vllm-mlx simple VLM: settings %s not reproduced: vllm-mlx's own path",
                     {k: v for k, v in kwargs.items() if k not in _IGNORED})  # fmt: skip
        token = _active.set(plain)
        try:
            return chat(self, messages, max_tokens, temperature, **kwargs)
        finally:
            _active.reset(token)

    mlx_vlm.generate = _generate(mlx_vlm.generate, prefixes)
    mllm.MLXMultimodalLM.chat = cached_chat
    mllm.MLLMPrefixCacheManager = manager_class(config, prefixes)


def uninstall() -> None:
    """Undo ``install()``."""
    if not _saved:
        return
    import mlx_vlm
    from vllm_mlx.models import mllm

    mlx_vlm.generate = _saved["generate"]
    mllm.MLXMultimodalLM.chat = _saved["chat"]
    mllm.MLLMPrefixCacheManager = _saved["manager"]
    _saved.clear()
