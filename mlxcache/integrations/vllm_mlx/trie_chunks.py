"""Stores after each prefill chunk of vllm-mlx's default mode, for window and state layers.

vllm-mlx 0.6's ``SimpleEngine.stream_chat`` (its cache-aware branch, on mlxcache's
``SharedPromptCache``: ``simple_text.py``) looks a prompt up, then calls
``mlx_lm.stream_generate`` on the restored cache and the rest, with mlx-lm's default prefill
step (2,048 tokens), and inserts the cache when the response ends: by then a state layer
(``ArraysCache``) holds its state at that one length. ``install()`` runs that call through the
mlx-lm integration's ``stream_generate_with_stores``: after each prefill chunk a copy of the
cache goes to ``SharedPromptCache.store_prefill`` (a state checkpoint at chunk ends on the
stride, window blocks), keyed as the branch's own lookup (model identity and the request's salt).

The tokens stored under are those of the lookup made in the same call on vllm-mlx's generation
worker (``_run_blocking_serialized``), taken once: a call without a lookup (vllm-mlx restoring
its system-prompt KV snapshot, the peek having found nothing longer) or a lookup that does not
end in the prompt being prefilled stores nothing, so a store never goes under another request's
tokens. (A lookup that then loses to the snapshot still ends in the prompt prefilled after it.)
The stores read copies: vllm-mlx computes exactly what it computes without them.
"""

from __future__ import annotations

import threading
from typing import Any

_saved: dict[str, Any] = {}
_slot = threading.local()  # on the generation worker: (key, tokens, prompt cache) or None


def looked_up(prompt_cache: Any, key: Any, tokens: list[int]) -> None:
    """Note the lookup the next ``stream_generate`` of this worker call prefills the rest of."""
    _slot.lookup = (key, list(tokens), prompt_cache)


class _Lookup:
    """The prompt cache as ``stream_generate_with_stores`` reads it: this call's own lookup."""

    def last_lookup(self) -> list[int] | None:
        """The tokens of this worker call's lookup, taken (None without one)."""
        _slot.taken, _slot.lookup = getattr(_slot, "lookup", None), None
        return _slot.taken[1] if _slot.taken else None

    def key(self) -> Any:
        """The model key of the lookup taken."""
        return _slot.taken[0]

    def prefill_store_due(self, num_tokens: int, prompt_cache: Any) -> bool:
        """As ``SharedPromptCache.prefill_store_due`` of the lookup's cache."""
        return _slot.taken[2].prefill_store_due(num_tokens, prompt_cache)

    def store_prefill(self, key: Any, tokens: list[int], prompt_cache: list[Any]) -> None:
        """As ``SharedPromptCache.store_prefill`` of the lookup's cache."""
        _slot.taken[2].store_prefill(key, tokens, prompt_cache)


def _one_call(run: Any) -> Any:
    """``SimpleEngine._run_blocking_serialized`` whose worker call starts and ends with no
    lookup noted: a lookup is used by the call that made it only."""

    async def serialized(self: Any, func: Any, /, *args: Any, **kwargs: Any) -> Any:
        def call(*a: Any, **k: Any) -> Any:
            _slot.lookup = _slot.taken = None
            try:
                return func(*a, **k)
            finally:
                _slot.lookup = _slot.taken = None

        return await run(self, call, *args, **kwargs)

    return serialized


def install() -> None:
    """Store vllm-mlx's default-mode prefill chunks (``uninstall()`` undoes it)."""
    if _saved:
        return
    import mlx_lm
    from vllm_mlx.engine.simple import SimpleEngine

    from mlxcache.integrations.mlx_lm.chunk_stores import stream_generate_with_stores

    _saved.update(run=SimpleEngine._run_blocking_serialized, generate=mlx_lm.stream_generate)
    lookup = _Lookup()
    SimpleEngine._run_blocking_serialized = _one_call(_saved["run"])
    # the branch imports it from mlx_lm at each call; without a lookup it runs as it is
    mlx_lm.stream_generate = stream_generate_with_stores(_saved["generate"], lookup, lookup.key)


def uninstall() -> None:
    """Undo ``install()``."""
    if not _saved:
        return
    import mlx_lm
    from vllm_mlx.engine.simple import SimpleEngine

    SimpleEngine._run_blocking_serialized = _saved["run"]
    mlx_lm.stream_generate = _saved["generate"]
    _saved.clear()
