"""``install(backend=URI)``: vllm-mlx's own server and engines on mlxcache's shared cache.

vllm-mlx's modules import the cache classes by name (``from .memory_cache import
MemoryAwarePrefixCache``), so ``install()`` replaces those names in the modules that use them,
before a server or engine is built (``vllm_mlx.cli.main()`` builds them after):

- ``vllm_mlx.scheduler.MemoryAwarePrefixCache`` and
  ``vllm_mlx.mllm_batch_generator.MemoryAwarePrefixCache``: a subclass with the shared tier
  underneath (``shared_tier.py``; vllm-mlx's callers read its private fields);
- ``vllm_mlx.mllm_batch_generator.VisionEmbeddingCache`` (the batched MLLM path): mlxcache's
  compatible cache on the backend, images in order in every key (``vision_seam.py``);
- ``vllm_mlx.models.mllm``'s simple-mode ``chat`` with images runs on an image-aware
  ``PrefixCache`` and its ``MLLMPrefixCacheManager`` is mlxcache's (``simple_vlm.py``);
- ``vllm_mlx.engine.simple.SimpleEngine``'s text requests (vllm-mlx's default mode) get its
  prompt cache, as mlxcache's ``SharedPromptCache`` on the backend (``simple_text.py``);
- ``vllm_mlx.scheduler.Scheduler._create_batch_generator``: on a model with window or state
  layers, the generator's cache goes to the shared tier after each prefill chunk
  (``chunk_stores.py``);
- responses report ``usage.prompt_tokens_details.cached_tokens`` (``usage.py``) and, on the
  Anthropic Messages API, ``cache_read_input_tokens`` (``anthropic_usage.py``).

``uninstall()`` puts every name back. The seam is read in vllm-mlx 0.6.0's wheel;
``check_version()`` refuses any other minor version in one line, before a model loads.
"""

from __future__ import annotations

import importlib
import logging
from importlib import metadata
from typing import Any

from mlxcache.backends.base import CacheBackend
from mlxcache.integrations.vllm_mlx import (
    anthropic_usage,
    chunk_stores,
    simple_text,
    simple_vlm,
    usage,
)
from mlxcache.integrations.vllm_mlx.shared_tier import TierConfig, shared_prefix_cache_class
from mlxcache.uri import open_backend

log = logging.getLogger("mlxcache")

TESTED = ((0, 6, 0), (0, 7, 0))  # vllm-mlx versions whose seam this module knows: [lo, hi)
INSTALL_HINT = (
    "pip install --no-deps 'vllm-mlx>=0.6,<0.7' plus its requirements (see docs/integrations.md)"
)
# (module, name) pairs install() replaces: the prefix caches, the batched path's vision cache
PREFIX_SEAMS = (
    ("vllm_mlx.scheduler", "MemoryAwarePrefixCache"),
    ("vllm_mlx.mllm_batch_generator", "MemoryAwarePrefixCache"),
)
VISION_SEAMS = (("vllm_mlx.mllm_batch_generator", "VisionEmbeddingCache"),)

_state: dict[str, Any] = {}


class VllmMlxVersionError(RuntimeError):
    """vllm-mlx is not installed, or its version is outside the tested range."""


def _parse(version: str) -> tuple[int, ...]:
    parts = []
    for p in version.split(".")[:3]:
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts + [0] * (3 - len(parts)))


def check_version() -> str:
    """vllm-mlx's installed version; raises ``VllmMlxVersionError`` (one line) otherwise."""
    try:
        version = metadata.version("vllm-mlx")
    except metadata.PackageNotFoundError:
        raise VllmMlxVersionError(f"vllm-mlx is not installed: {INSTALL_HINT}") from None
    lo, hi = TESTED
    if not lo <= _parse(version) < hi:
        raise VllmMlxVersionError(
            f"vllm-mlx {version} is outside the tested range "
            f">={'.'.join(map(str, lo))},<{'.'.join(map(str, hi))}: {INSTALL_HINT}"
        )
    return version


def installed() -> bool:
    """Whether ``install()`` is in effect."""
    return bool(_state)


def install(
    backend: CacheBackend | str | None = None,
    *,
    block_size: int = 256,
    salt: str = "",
    model_name: str | None = None,
) -> CacheBackend:
    """Put vllm-mlx's prefix caches on the shared tier of ``backend``; returns the backend.

    ``backend`` is a URI or a ``CacheBackend`` (None: ``$MLXCACHE_URL``, else the default
    folder). ``block_size`` is tokens per stored block; ``salt`` isolates tenants;
    ``model_name`` names the model in the keys (default: none, so the same weights under two
    folder names share). Call before vllm-mlx builds its engine. A second call replaces the
    first (``uninstall()`` first, closing a backend the first call opened).
    """
    version = check_version()
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if _state:
        uninstall()
    owns = not isinstance(backend, CacheBackend)
    opened = backend if isinstance(backend, CacheBackend) else open_backend(backend)
    config = TierConfig(opened, block_size, salt, model_name, engine_version=version)
    from mlxcache.integrations.vllm_mlx.vision_seam import shared_vision_cache_class

    saved: list[tuple[Any, str, Any]] = []
    seams: list[tuple[str, str, Any]] = [
        (m, n, lambda base: shared_prefix_cache_class(base, config)) for m, n in PREFIX_SEAMS
    ]
    seams += [(m, n, lambda _base: shared_vision_cache_class(config)) for m, n in VISION_SEAMS]
    for module_name, name, make in seams:
        module = importlib.import_module(module_name)
        original = getattr(module, name)
        saved.append((module, name, original))
        setattr(module, name, make(original))
    usage.install()
    anthropic_usage.install()
    chunk_stores.install()
    simple_vlm.install(config)
    simple_text.install(config)
    _state.update(saved=saved, backend=opened, owns=owns, config=config)
    log.info("mlxcache: vllm-mlx %s prefix caches on %r", version, opened)
    return opened


def uninstall() -> None:
    """Put vllm-mlx's own classes back; close the backend ``install()`` opened."""
    if not _state:
        return
    for module, name, original in reversed(_state["saved"]):
        setattr(module, name, original)
    usage.uninstall()
    anthropic_usage.uninstall()
    chunk_stores.uninstall()
    simple_vlm.uninstall()
    simple_text.uninstall()
    if _state["owns"]:
        try:
            _state["backend"].close()
        except Exception as e:  # closing a dead backend is not an error of the caller
            log.warning("mlxcache: closing the vllm-mlx backend failed: %s", e)
    _state.clear()


def current_config() -> TierConfig | None:
    """The shared tier's settings while installed (None otherwise)."""
    return _state.get("config")
