"""A request's salt in vllm-mlx's default mode (``SimpleEngine``, text and ``--mllm``).

``SimpleEngine`` runs each model step on its one generation thread with
``loop.run_in_executor``, which does not carry context variables, so the salt the ASGI
middleware set in the request's task (``salts.current()``) would be "" there. ``install()``:

- submits every step inside a copy of the submitting task's context: the prompt cache
  (``simple_text.py``) and the image prefix cache and manager (``simple_vlm.py``) read the
  request's salt where they run;
- keys vllm-mlx's own in-process system-prompt KV snapshots (``_system_kv_cache``, keyed by
  the system prompt's hash) by the request's salt too, so one user's system prompt is never
  reused for (nor its timing seen by) another salt.
"""

from __future__ import annotations

import contextvars
import hashlib
from collections import OrderedDict
from typing import Any

from mlxcache.integrations.vllm_mlx import salts


def salted_key(key: Any) -> Any:
    """``key`` for the salt of the request being served (itself without a salt)."""
    salt = salts.current()
    if not salt:
        return key
    return hashlib.sha256(f"{key}\0{salt}".encode()).hexdigest()[:16]


class SaltedSnapshots(OrderedDict):
    """vllm-mlx's system-prompt KV LRU whose keys are the serving request's salt's own."""

    def __getitem__(self, key: Any) -> Any:
        return super().__getitem__(salted_key(key))

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(salted_key(key), value)

    def __delitem__(self, key: Any) -> None:
        super().__delitem__(salted_key(key))

    def __contains__(self, key: object) -> bool:
        return super().__contains__(salted_key(key))

    def get(self, key: Any, default: Any = None) -> Any:
        return super().get(salted_key(key), default)

    def pop(self, key: Any, *default: Any) -> Any:
        return super().pop(salted_key(key), *default)

    def move_to_end(self, key: Any, last: bool = True) -> None:
        super().move_to_end(salted_key(key), last)


def install() -> None:
    """Carry the salt onto ``SimpleEngine``'s generation thread (``salts.uninstall()`` undoes)."""
    from vllm_mlx.engine.simple import SimpleEngine

    submit, init = SimpleEngine._submit_to_generation_worker, SimpleEngine.__init__

    async def submit_in_context(self: Any, worker: Any, fn: Any, /, *args: Any,
                                during_shutdown: bool = False) -> Any:  # fmt: skip
        run = contextvars.copy_context().run  # the submitting task's, with its salt
        return await submit(self, worker, run, fn, *args, during_shutdown=during_shutdown)

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807
        init(self, *args, **kwargs)
        self._system_kv_cache = SaltedSnapshots(self._system_kv_cache)

    salts.patch(SimpleEngine, "_submit_to_generation_worker", submit_in_context)
    salts.patch(SimpleEngine, "__init__", __init__)
