"""A request's salt on vllm-mlx's batched MLLM path (``--mllm --continuous-batching``).

``MLLMScheduler.add_request`` runs in the HTTP request's task (where ``salts.current()`` is
its salt); the batch generator works on a background task with ``MLLMBatchRequest`` objects
that carry only the request id. ``install()``:

- remembers each salted request's salt by its id until the scheduler drops the request;
- runs ``MLLMBatchGenerator._preprocess_request`` (the pixel cache's lookup and store) as
  serving that request, so the vision cache keys it under its salt (``vision_seam.py``);
- makes the request that vllm-mlx's ``is_text_only_prefix_cache_request`` is asked about
  (the generator asks right before each prefix-cache lookup and store of text-only
  requests) the one the prefix cache admits, as ``Scheduler.add_request`` does for text
  (``salts.py``): its entries are keyed by its salt in the in-process LRU and the shared tier.
"""

from __future__ import annotations

import importlib
import threading
from collections import OrderedDict
from typing import Any

from mlxcache.integrations.vllm_mlx import salts

_SALTS: OrderedDict[str, str] = OrderedDict()  # request id: salt (salted requests only)
_MAX = 4096
_LOCK = threading.Lock()


def salt_of(request_id: str) -> str:
    """The salt of a request the MLLM scheduler holds ("" for none)."""
    with _LOCK:
        return _SALTS.get(request_id, "")


def _forget(request_ids: Any) -> None:
    ids = list(request_ids)
    with _LOCK:
        for request_id in ids:
            _SALTS.pop(request_id, None)
    salts.retire(ids)


def install() -> None:
    """Carry each request's salt to the batched MLLM path (``salts.uninstall()`` undoes it)."""
    scheduler = importlib.import_module("vllm_mlx.mllm_scheduler")
    generator = importlib.import_module("vllm_mlx.mllm_batch_generator")
    cls, gen = scheduler.MLLMScheduler, generator.MLLMBatchGenerator
    add, cleanup, remove, step = (
        cls.add_request,
        cls._cleanup_finished,
        cls.remove_finished_request,
        cls.step,
    )
    preprocess, text_only = gen._preprocess_request, generator.is_text_only_prefix_cache_request

    def add_request(self: Any, *args: Any, **kwargs: Any) -> str:
        request_id = add(self, *args, **kwargs)
        salt = salts.current()
        if salt:
            with _LOCK:
                _SALTS[request_id] = salt
                while len(_SALTS) > _MAX:
                    _SALTS.popitem(last=False)
        return request_id

    def cleanup_finished(self: Any, finished_ids: Any) -> Any:
        try:
            return cleanup(self, finished_ids)
        finally:
            _forget(finished_ids)

    def remove_finished_request(self: Any, request_id: str) -> Any:
        _forget([request_id])
        return remove(self, request_id)

    def scheduler_step(self: Any) -> Any:
        try:
            return step(self)
        finally:
            salts.admit("", None)

    def preprocess_request(self: Any, request: Any) -> None:
        with salts.serving(salt_of(request.request_id)):
            return preprocess(self, request)

    def is_text_only_prefix_cache_request(request: Any) -> bool:
        request_id = getattr(request, "request_id", None)
        salts.admit(salt_of(request_id) if request_id else "", request_id)
        return bool(text_only(request))

    salts.patch(cls, "add_request", add_request)
    salts.patch(cls, "_cleanup_finished", cleanup_finished)
    salts.patch(cls, "remove_finished_request", remove_finished_request)
    salts.patch(cls, "step", scheduler_step)
    salts.patch(gen, "_preprocess_request", preprocess_request)
    salts.patch(generator, "is_text_only_prefix_cache_request", is_text_only_prefix_cache_request)
