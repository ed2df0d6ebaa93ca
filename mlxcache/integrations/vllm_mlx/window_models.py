"""vllm-mlx's default mode on sliding-window models: mlxcache's prompt cache, no KV snapshots.

vllm-mlx 0.6's ``SimpleEngine`` keeps every ``stream_chat`` request of a model whose prompt
cache has a class other than ``KVCache`` / ``ArraysCache`` (gemma3_text, gpt_oss, olmo3: their
``RotatingKVCache`` layers) off its cache-aware branch: ``_probe_system_kv_cache_support``
answers False at start, ``_supports_system_kv_cache`` stays False and each request's
``cache_blocking_controls`` gets ``non_kv_cache_class``, which turns off both caches of that
branch, the prompt cache (``--prefix-trie-cache``, on mlxcache's ``SharedPromptCache`` under
``simple_text.py``) and vllm-mlx's own system-prompt KV snapshots. vllm-mlx's reason is the
snapshots': they alias the layers' buffers, and ``.state`` does not hold a rotating layer's
cursor. mlxcache's prompt cache restores fresh cache objects through its serializers.
``install()``:

- answers that probe True for route ``stream_chat`` when vllm-mlx's own answer is False and
  every class of the model's cache is ``KVCache``, ``RotatingKVCache`` or ``ArraysCache``, which
  mlxcache stores and resumes (``resume``'s adapter table; tested over HTTP: gemma3_text,
  olmo3 and gpt_oss), so ``non_kv_cache_class`` is no longer among the
  request's controls. Other classes stay uncached: llama4's ``ChunkedKVCache``, which the
  mlx-lm 0.31 vllm-mlx pins trims on its buffer's padded width (``adapters.unsafe``: a restored
  one would keep other tokens than vllm-mlx's; a repeat on tiny llama4 answered otherwise).
  Every other control (``stop``, ``top_k``,
  ``min_p``, penalties, logits processors, ``--max-kv-size``, MTP, SpecPrefill, harmony
  rendering, which gpt_oss has with ``--tool-call-parser harmony --enable-auto-tool-choice``)
  keeps the request off as before;
- keeps the snapshots off for those models: the branch takes a snapshot only when
  ``build_system_prompt_cache_prefix`` (the one name that decides it, looked up in
  ``vllm_mlx.engine.simple`` at each call) renders a system prefix, and it renders none while
  such an engine's ``_stream_chat_impl`` runs its gate (a context variable in the request's
  task, naming the engine).
  A request then goes through the prompt cache alone, as one without a system message does.

``uninstall()`` puts back every name replaced.
"""

from __future__ import annotations

import contextvars
import logging
from typing import Any

from mlxcache.integrations.resume import unsupported_cache_reason

log = logging.getLogger("mlxcache")

# the classes a lifted model's cache may have (ChunkedKVCache: see the module's docstring)
_CLASSES = {"KVCache", "RotatingKVCache", "ArraysCache"}
_saved: dict[str, Any] = {}
_lifted: dict[int, Any] = {}  # id: model whose probe was lifted (kept so its id is not reused)
# the engine whose request is in its first step (the gate), in that request's task only
_GATING: contextvars.ContextVar[Any] = contextvars.ContextVar("mlxcache_gating", default=None)


def _resumable(model: Any) -> list[str] | None:
    """The cache classes of ``model`` when mlxcache stores and resumes every one, else None."""
    try:
        from mlx_lm.models.cache import make_prompt_cache

        fresh = make_prompt_cache(model)
    except Exception as e:  # vllm-mlx's probe fails the same way: the model stays uncached
        log.debug("mlxcache: no prompt cache to probe (%s)", e)
        return None
    classes = {type(c).__name__ for c in fresh}
    if not fresh or not classes <= _CLASSES or unsupported_cache_reason(fresh) is not None:
        return None
    return sorted(classes)


def _probe(original: Any) -> Any:
    """``SimpleEngine._probe_system_kv_cache_support``, True for a ``stream_chat`` model whose
    cache mlxcache resumes (the model noted: its snapshots stay off)."""

    def probe(cls: Any, model: Any, route: str) -> bool:
        supported = bool(original(cls, model, route))
        if supported or route != "stream_chat" or (classes := _resumable(model)) is None:
            return supported
        _lifted[id(model)] = model
        log.info(
            "mlxcache: vllm-mlx's cache-aware stream_chat on for %s (mlxcache's prompt cache); "
            "vllm-mlx's system-prompt KV snapshots stay off for it",
            classes,
        )
        return True

    return classmethod(probe)


def _system_prefix(original: Any) -> Any:
    """``build_system_prompt_cache_prefix``: no system prefix (so no snapshot) for a request of
    a lifted model."""

    def build(*args: Any, **kwargs: Any) -> str | None:
        engine = _GATING.get()
        model = None if engine is None else getattr(engine._model, "model", None)
        lifted = model is not None and id(model) in _lifted
        return None if lifted else original(*args, **kwargs)

    return build


def _gated(stream_chat: Any) -> Any:
    """``SimpleEngine._stream_chat_impl`` whose first step (the gate, before any output; it
    starts the engine first if need be) sees no system prefix when the engine's model was
    lifted."""

    async def stream(self: Any, *args: Any, **kwargs: Any) -> Any:
        outputs = stream_chat(self, *args, **kwargs)
        token = _GATING.set(self)
        try:
            first = await outputs.__anext__()
        except StopAsyncIteration:
            return
        finally:
            _GATING.reset(token)
        yield first
        async for output in outputs:
            yield output

    return stream


def install() -> None:
    """Put window models' default-mode requests on mlxcache's prompt cache (``uninstall()``)."""
    if _saved:
        return
    from vllm_mlx.engine import simple
    from vllm_mlx.engine.simple import SimpleEngine

    _saved.update(
        probe=SimpleEngine.__dict__["_probe_system_kv_cache_support"],
        prefix=simple.build_system_prompt_cache_prefix,
        stream=SimpleEngine._stream_chat_impl,
    )
    SimpleEngine._probe_system_kv_cache_support = _probe(_saved["probe"].__func__)
    simple.build_system_prompt_cache_prefix = _system_prefix(_saved["prefix"])
    SimpleEngine._stream_chat_impl = _gated(_saved["stream"])


def uninstall() -> None:
    """Undo ``install()``."""
    if not _saved:
        return
    from vllm_mlx.engine import simple
    from vllm_mlx.engine.simple import SimpleEngine

    SimpleEngine._probe_system_kv_cache_support = _saved["probe"]
    simple.build_system_prompt_cache_prefix = _saved["prefix"]
    SimpleEngine._stream_chat_impl = _saved["stream"]
    _lifted.clear()
    _saved.clear()
