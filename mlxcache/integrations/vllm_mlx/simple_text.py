"""vllm-mlx's default mode for text (no ``--continuous-batching``, no ``--mllm``) on the tier.

vllm-mlx 0.6's ``SimpleEngine`` has an opt-in prompt cache for text: ``--prefix-trie-cache``
puts mlx-lm's ``LRUPromptCache`` under its cache-aware ``stream_chat`` branch (which samples
with mlx-lm's ``make_sampler(temperature, top_p)`` on the restored cache). ``install(config)``:

- turns that cache on, as mlxcache's ``SharedPromptCache`` (the mlx-lm integration's hot LRU
  over a ``PrefixCache`` on the installed backend, stored before the response ends), so a
  repeat, a second server or a restarted one skips the prefill of what was computed;
- sends non-streamed text ``chat`` through ``stream_chat`` (vllm-mlx already does so for
  requests with tools or logits processors), so both reach the cache;
- keys the cache by the request's ``cache_salt`` too (``Salted``: its own hot and shared
  entries; ``engine_salts.py`` carries the salt onto the generation thread), while a request
  without one keeps the model's keys;
- stores after each of the branch's prefill chunks on window and hybrid models
  (``trie_chunks.py``), under the tokens of the request's own lookup;
- answers vllm-mlx's ``_peek_prefix_trie_tokens_saved`` under those keys: with a KV snapshot
  of the request's system prompt, vllm-mlx takes the prompt cache only when the peek says it
  saves more tokens than the snapshot, and the peek read mlx-lm's trie by the model object,
  found nothing and left the snapshot to win. It now reads the hot trie by vllm-mlx's own rule
  and the shared tier's ``longest`` (no record read), and the cache is never "empty" to
  vllm-mlx's fast path while the shared tier is on: the longer of the two wins;
- lets models with window layers (``RotatingKVCache``: gemma3_text, olmo3), which vllm-mlx
  keeps off that branch (``non_kv_cache_class``), reach it on this cache alone, vllm-mlx's
  system-prompt snapshots still off for them (``window_models.py``);
- reports the reused tokens in the prompt count (``usage.PromptCount``): OpenAI's
  ``cached_tokens`` and Anthropic's ``cache_read_input_tokens``, the snapshot's tokens when the
  snapshot wins (vllm-mlx itself reports none of either).

vllm-mlx itself keeps a request off that branch when it has ``stop``, ``top_k``, ``min_p``,
presence or repetition penalties, logits processors, ``--max-kv-size``, MTP, SpecPrefill or
harmony rendering:
those run uncached and report 0 cached tokens. The engine runs one request at a time, which
is what lets the count of the request being answered be kept on the engine.
"""

from __future__ import annotations

import logging
from typing import Any

from mlxcache.integrations.vllm_mlx import salts, trie_chunks, window_models
from mlxcache.integrations.vllm_mlx.shared_tier import TierConfig, identity
from mlxcache.integrations.vllm_mlx.usage import PromptCount

log = logging.getLogger("mlxcache")

_saved: dict[str, Any] = {}


def _trie_class(config: TierConfig) -> type:
    """``SharedPromptCache`` keyed by the model's identity and the request's salt: vllm-mlx
    passes the model object, which (an ``nn.Module``, a dict) cannot key mlx-lm's trie, so its
    own cache never hits."""
    from mlxcache.integrations.mlx_lm.prompt_cache import Salted, SharedPromptCache

    names: dict[int, tuple[Any, str]] = {}

    def name(model: Any) -> Any:
        if id(model) not in names:  # the model is kept so its id is never reused
            names[id(model)] = (model, identity(model, config, revision="simple-text"))
        salt = salts.current()  # the request being served, on the generation thread too
        return Salted(names[id(model)][1], salt) if salt else names[id(model)][1]

    class ModelNamedPromptCache(SharedPromptCache):
        def __bool__(self) -> bool:
            # vllm-mlx skips an "empty" cache when it holds a system-prompt snapshot: the
            # shared tier may hold what this process's hot tier does not
            return self.backend is not None or len(self) > 0

        def tokens_saved(self, model: Any, tokens: list[int], peek: Any) -> int | None:
            """What ``fetch_nearest_cache(model, tokens)`` reuses at most, copying nothing:
            ``peek`` (vllm-mlx's own rule) on the hot trie under this cache's key, or the
            shared tier's ``longest`` when longer (at most all but the last token)."""
            key = name(model)
            hot = peek(self, key, tokens)
            have = hot or 0
            if self.backend is None or have >= len(tokens) - 1:
                return hot
            try:
                pc = self.prefix_cache(key)
                shared = pc.longest(tokens[:-1], have=have) if pc is not None else have
            except Exception as e:  # a failing store is a miss, never an error in the server
                log.warning("mlx-lm prompt cache: peek failed, in memory only: %s", e)
                return hot
            return shared if shared > have else hot

        def fetch_nearest_cache(self, model: Any, tokens: list[int]) -> Any:
            key = name(model)
            trie_chunks.looked_up(self, key, tokens)  # the chunks of this call store under it
            return super().fetch_nearest_cache(key, tokens)

        def insert_cache(self, model: Any, tokens: list[int], prompt_cache: Any,
                         **kwargs: Any) -> Any:  # fmt: skip
            return super().insert_cache(name(model), tokens, prompt_cache, **kwargs)

    return ModelNamedPromptCache


def _shared_trie(config: TierConfig) -> Any:
    """``SimpleEngine._ensure_prefix_trie_cache`` building mlxcache's ``SharedPromptCache``."""
    original = _saved["ensure"]

    def ensure(self: Any) -> Any:
        if self._is_mllm:
            return original(self)
        with self._prefix_trie_cache_lock:
            if self._prefix_trie_cache is None:
                mb = self._prefix_trie_cache_memory_mb
                self._prefix_trie_cache = _trie_class(config)(
                    self._prefix_trie_cache_size,
                    mb * 1024 * 1024 if mb is not None else 1 << 63,
                    backend=config.backend,
                    identity=str,  # the key already is the identity
                    block_size=config.block_size,
                    salt=config.salt,
                    background=False,  # stored before the response ends
                )
        return self._prefix_trie_cache

    return ensure


def _counted_fetch(fetch: Any) -> Any:
    """``_fetch_prefix_trie_cache`` that keeps the tokens the request reuses on the engine:
    the prompt cache's, or, when it does not beat the system-prompt snapshot vllm-mlx holds
    (``minimum_tokens_saved``, the snapshot's tokens), the snapshot's, which vllm-mlx restores."""

    def counted(self: Any, model: Any, tokens: list[int], *,
                minimum_tokens_saved: int = 0) -> Any:  # fmt: skip
        out = fetch(self, model, tokens, minimum_tokens_saved=minimum_tokens_saved)
        reused = out[2] if out[0] is not None else minimum_tokens_saved
        self._mlxcache_reused = (getattr(self, "_mlxcache_reused", (0, 0))[0] + 1, reused)
        return out

    return counted


def _peek(original: Any) -> Any:
    """``SimpleEngine._peek_prefix_trie_tokens_saved`` asking mlxcache's cache, under its keys."""

    def peek(prefix_trie: Any, model: Any, tokens: list[int]) -> int | None:
        own = getattr(prefix_trie, "tokens_saved", None)
        return original(prefix_trie, model, tokens) if own is None else own(model, tokens, original)

    return staticmethod(peek)


def _reported(stream_chat: Any) -> Any:
    """``SimpleEngine._stream_chat_impl`` whose text outputs carry the reused tokens."""

    async def stream(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self._is_mllm:
            async for output in stream_chat(self, *args, **kwargs):
                yield output
            return
        before = getattr(self, "_mlxcache_reused", (0, 0))[0]
        cached: int | None = None
        async for output in stream_chat(self, *args, **kwargs):
            n = getattr(output, "prompt_tokens", 0)
            if n and not hasattr(n, "cached_tokens"):
                if cached is None:  # this request's lookup ran before its first output
                    fetches, reused = getattr(self, "_mlxcache_reused", (0, 0))
                    cached = reused if fetches > before else 0
                output.prompt_tokens = PromptCount(n, cached)
            yield output

    return stream


def _chat_via_stream(chat: Any) -> Any:
    """``SimpleEngine.chat`` for text through ``stream_chat`` (vllm-mlx's own aggregation)."""

    async def cached_chat(self: Any, messages: list, *args: Any, **kwargs: Any) -> Any:
        if self._is_mllm or kwargs.get("tools") or kwargs.get("logits_processors"):
            return await chat(self, messages, *args, **kwargs)  # media, or already streamed
        from vllm_mlx.api.utils import clean_output_text
        from vllm_mlx.engine.base import GenerationOutput

        final = GenerationOutput(text="")
        async for output in self.stream_chat(messages, *args, **kwargs):
            final = output
        return GenerationOutput(
            text=clean_output_text(final.text),
            tokens=list(final.tokens),
            prompt_tokens=final.prompt_tokens,
            completion_tokens=final.completion_tokens,
            finish_reason=final.finish_reason,
        )

    return cached_chat


def install(config: TierConfig) -> None:
    """Put simple-mode text requests on the shared tier (``uninstall()`` undoes it)."""
    if _saved:
        return
    from vllm_mlx.engine.simple import SimpleEngine

    _saved.update(
        init=SimpleEngine.__init__,
        ensure=SimpleEngine._ensure_prefix_trie_cache,
        fetch=SimpleEngine._fetch_prefix_trie_cache,
        peek=SimpleEngine.__dict__["_peek_prefix_trie_tokens_saved"],
        stream=SimpleEngine._stream_chat_impl,
        chat=SimpleEngine.chat,
    )
    init = _saved["init"]

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807
        init(self, *args, **kwargs)
        self._prefix_trie_cache_enabled = True

    SimpleEngine.__init__ = __init__
    SimpleEngine._ensure_prefix_trie_cache = _shared_trie(config)
    SimpleEngine._fetch_prefix_trie_cache = _counted_fetch(_saved["fetch"])
    SimpleEngine._peek_prefix_trie_tokens_saved = _peek(SimpleEngine._peek_prefix_trie_tokens_saved)
    SimpleEngine._stream_chat_impl = _reported(_saved["stream"])
    SimpleEngine.chat = _chat_via_stream(_saved["chat"])
    trie_chunks.install()
    window_models.install()  # after the names above: it wraps _stream_chat_impl


def uninstall() -> None:
    """Undo ``install()``."""
    if not _saved:
        return
    from vllm_mlx.engine.simple import SimpleEngine

    window_models.uninstall()  # first: it restores the _stream_chat_impl installed here
    SimpleEngine.__init__ = _saved["init"]
    SimpleEngine._ensure_prefix_trie_cache = _saved["ensure"]
    SimpleEngine._fetch_prefix_trie_cache = _saved["fetch"]
    SimpleEngine._peek_prefix_trie_tokens_saved = _saved["peek"]
    SimpleEngine._stream_chat_impl = _saved["stream"]
    SimpleEngine.chat = _saved["chat"]
    trie_chunks.uninstall()
    _saved.clear()
