"""A request's salt on vllm-mlx's batched MLLM path (``--mllm --continuous-batching``).

``MLLMScheduler.add_request`` runs in the HTTP request's task (where ``salts.current()`` is
its salt); the batch generator works on a background task with the ``MLLMBatchRequest`` that
``_schedule_waiting`` builds from it. ``install()``:

- keeps the salt on vllm-mlx's ``MLLMRequest`` and copies it to its ``MLLMBatchRequest``
  (``mlxcache_salt``) when the scheduler hands it to the generator;
- runs ``MLLMBatchGenerator._preprocess_request`` (the pixel cache's lookup and store) as
  serving that request, so the vision cache keys it under its salt (``vision_seam.py``);
- makes the request that vllm-mlx's ``is_text_only_prefix_cache_request`` is asked about
  (the generator asks right before each prefix-cache lookup and store of text-only
  requests) the one the prefix cache admits, as ``Scheduler.add_request`` does for text
  (``salts.py``): its entries are keyed by its salt in the in-process LRU and the shared tier;
- forgets a request's prompt (``salts.retire``) when the scheduler drops it.
"""

from __future__ import annotations

import importlib
from typing import Any

from mlxcache.integrations.vllm_mlx import salts


def salt_of(request: Any) -> str:
    """The salt of a request on the MLLM path ("" for none)."""
    return getattr(request, "mlxcache_salt", "")


def install() -> None:
    """Carry each request's salt to the batched MLLM path (``salts.uninstall()`` undoes it)."""
    scheduler = importlib.import_module("vllm_mlx.mllm_scheduler")
    generator = importlib.import_module("vllm_mlx.mllm_batch_generator")
    cls, gen = scheduler.MLLMScheduler, generator.MLLMBatchGenerator
    add, schedule, cleanup, remove, step = (
        cls.add_request,
        cls._schedule_waiting,
        cls._cleanup_finished,
        cls.remove_finished_request,
        cls.step,
    )
    preprocess, text_only = gen._preprocess_request, generator.is_text_only_prefix_cache_request

    def add_request(self: Any, *args: Any, **kwargs: Any) -> str:
        request_id = add(self, *args, **kwargs)
        salt = salts.current()
        if salt:
            self.requests[request_id].mlxcache_salt = salt
        return request_id

    def schedule_waiting(self: Any) -> Any:
        scheduled = schedule(self)
        salted = {r.request_id: salt_of(r) for r in scheduled if salt_of(r)}
        for request in getattr(self.batch_generator, "unprocessed_requests", ()) if salted else ():
            if request.request_id in salted:
                request.mlxcache_salt = salted[request.request_id]
        return scheduled

    def cleanup_finished(self: Any, finished_ids: Any) -> Any:
        try:
            return cleanup(self, finished_ids)
        finally:
            salts.retire(list(finished_ids))

    def remove_finished_request(self: Any, request_id: str) -> Any:
        salts.retire([request_id])
        return remove(self, request_id)

    def scheduler_step(self: Any) -> Any:
        try:
            return step(self)
        finally:
            salts.admit("", None)

    def preprocess_request(self: Any, request: Any) -> None:
        with salts.serving(salt_of(request)):
            return preprocess(self, request)

    def is_text_only_prefix_cache_request(request: Any) -> bool:
        salts.admit(salt_of(request), getattr(request, "request_id", None))
        return bool(text_only(request))

    salts.patch(cls, "add_request", add_request)
    salts.patch(cls, "_schedule_waiting", schedule_waiting)
    salts.patch(cls, "_cleanup_finished", cleanup_finished)
    salts.patch(cls, "remove_finished_request", remove_finished_request)
    salts.patch(cls, "step", scheduler_step)
    salts.patch(gen, "_preprocess_request", preprocess_request)
    salts.patch(generator, "is_text_only_prefix_cache_request", is_text_only_prefix_cache_request)
