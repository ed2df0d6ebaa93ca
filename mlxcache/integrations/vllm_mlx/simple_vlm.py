"""vllm-mlx's simple-mode VLM path (``--mllm`` without ``--continuous-batching``) on the tier.

vllm-mlx 0.6's ``MLXMultimodalLM.chat`` asks its in-memory ``MLLMPrefixCacheManager``, counts
a hit, and then, when the request has images, throws the cached KV away and prefills from
scratch ("delegating to mlx-vlm"). ``install(config)`` changes two things:

- ``chat`` and ``stream_chat`` run with ``mlx_vlm.generate`` / ``mlx_vlm.stream_generate``
  (imported at call time) answered on a ``PrefixCache`` of the installed backend, keyed by
  model, tokens and images (by content, in order): the longest stored prefix is restored, only
  the rest is prefilled, and the tokens are sampled by mlx-vlm's own sampler and logits
  processors for any sampling settings (``vlm_sampling.py``); greedy answers equal mlx-vlm's
  uncached ones. The request's ``cache_salt`` joins the server's salt in that cache's keys
  (one ``PrefixCache`` per model and salt; ``engine_salts.py`` carries the salt onto the
  generation thread). Requests without images, or with settings a restored prefix cannot serve
  (a draft model, audio, KV quantization) go to mlx-vlm as before. The prompt count carries
  the cached tokens (``usage.PromptCount``), streamed too;
- ``vllm_mlx.models.mllm.MLLMPrefixCacheManager`` is mlxcache's compatible manager on the
  backend (model, server salt and request salt in every key). Inside ``chat``/``stream_chat``
  it answers "miss" and stores nothing (the ``PrefixCache`` holds the KV), and its stats
  count the reuse that happened.
"""

from __future__ import annotations

import contextvars
import logging
import threading
from typing import Any

from mlxcache.integrations.request_salt import join_salt
from mlxcache.integrations.vllm_mlx import salts, vlm_sampling
from mlxcache.integrations.vllm_mlx.mllm_cache import MLLMPrefixCacheManager
from mlxcache.integrations.vllm_mlx.shared_tier import ERRORS, TierConfig, identity
from mlxcache.integrations.vllm_mlx.usage import PromptCount
from mlxcache.integrations.vllm_mlx.vision_seam import namespace
from mlxcache.prefix import PrefixCache

log = logging.getLogger("mlxcache")

_active: contextvars.ContextVar[bool] = contextvars.ContextVar("mlxcache_vllm_chat", default=False)
_saved: dict[str, Any] = {}


class _Prefixes:
    """One ``PrefixCache`` per loaded model and request salt, with the counters the manager
    reports."""

    def __init__(self, config: TierConfig) -> None:
        self.config = config
        self._by_model: dict[tuple[int, str], PrefixCache] = {}
        self._lock = threading.Lock()
        self.counts = dict.fromkeys(("requests", "hits", "tokens_reused", "errors"), 0)

    def of(self, model: Any) -> PrefixCache:
        """The cache of ``model`` for the request being served (its salt joins the server's)."""
        request_salt = salts.current()
        with self._lock:
            pc = self._by_model.get((id(model), request_salt))
            if pc is None:
                cfg = getattr(model, "config", None)
                image_token = getattr(cfg, "image_token_index", None)
                if image_token is None:
                    image_token = getattr(cfg, "image_token_id", None)
                pc = PrefixCache(
                    self.config.backend,
                    model=identity(model, self.config),
                    block_size=self.config.block_size,
                    salt=join_salt(self.config.salt, request_salt),
                    image_token_id=image_token,
                    hot_bytes=0,
                )
                self._by_model[(id(model), request_salt)] = pc
            return pc

    def count(self, **kw: int) -> None:
        with self._lock:
            for k, v in kw.items():
                self.counts[k] += v


def _settings(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in kwargs.items() if k not in ("max_tokens", "temperature")}


def _taken(image: Any, args: tuple, kwargs: dict[str, Any]) -> bool:
    """Whether a generate call inside ``chat``/``stream_chat`` runs on the ``PrefixCache``:
    it has images and settings a restored prefix serves exactly (any sampling)."""
    if not _active.get() or not image or args:
        return False
    bad = vlm_sampling.unsupported(kwargs.get("temperature", 0.0), _settings(kwargs))
    if bad:
        log.info("vllm-mlx simple VLM: %s not reproduced from a cached prefix: mlx-vlm's own "
                 "path, uncached", bad)  # fmt: skip
    return not bad


def _generate(original: Any, prefixes: _Prefixes) -> Any:
    """``mlx_vlm.generate`` that, inside a taken-over ``chat``, runs on the ``PrefixCache``."""

    def generate(model: Any, processor: Any, prompt: Any = None, image: Any = None, *args: Any,
                 **kwargs: Any) -> Any:  # fmt: skip
        if not _taken(image, args, kwargs):
            return original(model, processor, prompt, image, *args, **kwargs)
        try:
            pc = prefixes.of(model)
            out = vlm_sampling.generate(model, processor, prompt, image, cache=pc,
                                        max_tokens=kwargs.get("max_tokens", 256),
                                        temperature=kwargs.get("temperature", 0.0),
                                        settings=_settings(kwargs))  # fmt: skip
        except Exception as e:  # mlxcache cannot run it: mlx-vlm does, uncached
            log.warning("vllm-mlx simple VLM: cached generation failed, running uncached: %s", e)
            prefixes.count(errors=1)
            ERRORS.add("lookup")
            return original(model, processor, prompt, image, *args, **kwargs)
        cached = int(getattr(out, "cached_tokens", 0) or 0)
        prefixes.count(requests=1, hits=int(cached > 0), tokens_reused=cached)
        out.prompt_tokens = PromptCount(out.prompt_tokens, cached)
        out.generation_tokens = len(getattr(out, "tokens", []) or [])
        return out

    return generate


class _Chunk:
    """One streamed chunk as vllm-mlx reads mlx-vlm's: ``text`` and ``prompt_tokens``."""

    def __init__(self, text: str, prompt_tokens: int, token: int) -> None:
        self.text, self.prompt_tokens, self.token = text, prompt_tokens, token


def _stream_generate(original: Any, prefixes: _Prefixes) -> Any:
    """``mlx_vlm.stream_generate`` that, inside a taken-over ``stream_chat``, runs on the
    ``PrefixCache`` (a failure before the first token runs mlx-vlm's own, uncached)."""

    def stream_generate(model: Any, processor: Any, prompt: Any = None, image: Any = None,
                        *args: Any, **kwargs: Any) -> Any:  # fmt: skip
        if not _taken(image, args, kwargs):
            yield from original(model, processor, prompt, image, *args, **kwargs)
            return
        try:
            steps = vlm_sampling.stream_generate(
                model, processor, prompt, image, cache=prefixes.of(model),
                max_tokens=kwargs.get("max_tokens", 256),
                temperature=kwargs.get("temperature", 0.0), settings=_settings(kwargs),
            )  # fmt: skip
            first = next(steps, None)
        except Exception as e:
            log.warning("vllm-mlx simple VLM: cached generation failed, running uncached: %s", e)
            prefixes.count(errors=1)
            ERRORS.add("lookup")
            yield from original(model, processor, prompt, image, *args, **kwargs)
            return
        if first is None:
            return
        cached = first.result.cached_tokens
        prefixes.count(requests=1, hits=int(cached > 0), tokens_reused=cached)
        prompt_tokens = PromptCount(first.result.prompt_tokens, cached)
        yield _Chunk(first.text, prompt_tokens, first.token)
        for step in steps:
            yield _Chunk(step.text, prompt_tokens, step.token)

    return stream_generate


def manager_class(config: TierConfig, prefixes: _Prefixes) -> type:
    """vllm-mlx's ``MLLMPrefixCacheManager`` signature over mlxcache's on the backend (its keys
    in the namespace of the server's salt and the served request's)."""

    class SharedMLLMPrefixCacheManager(MLLMPrefixCacheManager):
        """mlxcache's ``MLLMPrefixCacheManager`` on the installed backend."""

        def __init__(self, max_entries: int = 50, max_memory_mb: int = 2048, **kwargs: Any):
            kwargs.setdefault("backend", config.backend)  # given, so never closed here
            super().__init__(max_entries, max_memory_mb, **kwargs)

        def _keys(self, images: Any, prompt: str) -> tuple[str, str]:
            group, key = super()._keys(images, prompt)
            space = namespace(config, salts.current())
            return f"{space}.{group}", key.replace(group, f"{space}.{group}", 1)

        def fetch(self, *args: Any, **kwargs: Any) -> Any:
            if _active.get():  # the PrefixCache answers this request
                return None, 0
            return super().fetch(*args, **kwargs)

        def fetch_cache(self, *args: Any, **kwargs: Any) -> Any:
            if _active.get():
                return None, False
            return super().fetch_cache(*args, **kwargs)

        def store(self, *args: Any, **kwargs: Any) -> Any:
            if _active.get():
                return None
            return super().store(*args, **kwargs)

        def store_cache(self, *args: Any, **kwargs: Any) -> Any:
            if _active.get():
                return None
            return super().store_cache(*args, **kwargs)

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


def _chat(chat: Any) -> Any:
    """``MLXMultimodalLM.chat`` with its ``mlx_vlm.generate`` call on the ``PrefixCache``."""

    def cached_chat(self: Any, messages: list[dict], max_tokens: int = 256,
                    temperature: float = 0.7, **kwargs: Any) -> Any:  # fmt: skip
        token = _active.set(True)
        try:
            return chat(self, messages, max_tokens, temperature, **kwargs)
        finally:
            _active.reset(token)

    return cached_chat


def _stream_chat(stream_chat: Any) -> Any:
    """``MLXMultimodalLM.stream_chat`` with its ``mlx_vlm.stream_generate`` on the cache (the
    flag is set around each step: the generator's body runs inside ``next``)."""

    def cached_stream_chat(self: Any, messages: list[dict], max_tokens: int = 256,
                           temperature: float = 0.7, **kwargs: Any) -> Any:  # fmt: skip
        chunks = stream_chat(self, messages, max_tokens, temperature, **kwargs)
        while True:
            token = _active.set(True)
            try:
                chunk = next(chunks)
            except StopIteration:
                return
            finally:
                _active.reset(token)
            yield chunk

    return cached_stream_chat


def install(config: TierConfig) -> None:
    """Take over simple-mode ``chat`` and ``stream_chat`` requests with images
    (``uninstall()`` undoes it)."""
    if _saved:
        return
    import mlx_vlm
    from vllm_mlx.models import mllm

    prefixes = _Prefixes(config)
    _saved.update(generate=mlx_vlm.generate, stream_generate=mlx_vlm.stream_generate,
                  chat=mllm.MLXMultimodalLM.chat, stream_chat=mllm.MLXMultimodalLM.stream_chat,
                  manager=mllm.MLLMPrefixCacheManager)  # fmt: skip
    mlx_vlm.generate = _generate(mlx_vlm.generate, prefixes)
    mlx_vlm.stream_generate = _stream_generate(mlx_vlm.stream_generate, prefixes)
    mllm.MLXMultimodalLM.chat = _chat(_saved["chat"])
    mllm.MLXMultimodalLM.stream_chat = _stream_chat(_saved["stream_chat"])
    mllm.MLLMPrefixCacheManager = manager_class(config, prefixes)


def uninstall() -> None:
    """Undo ``install()``."""
    if not _saved:
        return
    import mlx_vlm
    from vllm_mlx.models import mllm

    mlx_vlm.generate = _saved["generate"]
    mlx_vlm.stream_generate = _saved["stream_generate"]
    mllm.MLXMultimodalLM.chat = _saved["chat"]
    mllm.MLXMultimodalLM.stream_chat = _saved["stream_chat"]
    mllm.MLLMPrefixCacheManager = _saved["manager"]
    _saved.clear()
