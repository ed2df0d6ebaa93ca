"""Stores after each prefill chunk of vllm-mlx's scheduler, for window and state layers.

vllm-mlx's scheduler (text with ``--continuous-batching``) runs mlx-lm's ``BatchGenerator``,
which prefills a prompt in chunks of ``--prefill-step-size`` tokens, and stores a request's
cache only when it finishes (prompt and output). By then a window layer
(``RotatingKVCache``) has dropped all but its last window and a state layer (``ArraysCache``)
holds its state at that one length, so a later prompt sharing only a passage inside the user
turn found nothing to restore on these models. ``install()`` wraps the ``next()`` of every
generator the scheduler makes (``Scheduler._create_batch_generator``): after each prefill chunk
the request's cache (mlx-lm's own ``extract_cache``) goes to the request's shared tier:

- window layers: the chunk's whole blocks, while the window still holds them;
- state layers: a checkpoint at a chunk end on the checkpoint stride (``prefix/checkpoints.py``:
  a multiple of the block and the prefill step, so a hit resumes on vllm-mlx's own splits);
- the chunk that ends one token short of the prompt (vllm-mlx runs the last token alone): the
  whole prefix, as vllm-mlx's in-memory cache cannot trim these layers back to it.

Only a request whose chunks all ran alone in the prompt batch is stored: vllm-mlx 0.6 (mlx-lm
0.31) prefills prompts added together in one padded batch, and a hybrid model's state from that
batch answers otherwise than the prompt run alone (``test_vllm_mlx_windows.py``). Models with
neither layer kind keep vllm-mlx's own stores. The stores read the cache and never
touch it: vllm-mlx computes exactly what it computes without them.

One exception, for state layers only (``branches.py``): a request prefilled alone that branches
off a stored prompt (its blocks match up to ``m``, it resumed before the last block boundary
``b <= m``) ends one more prefill chunk at ``b`` and is checkpointed there, so the next request
that branches there, on any server, resumes at ``b``; its answer is vllm-mlx's resumed at ``b``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from mlxcache.integrations.resume import chunk_store_due, holds_state, stores_mid_prefill
from mlxcache.integrations.vllm_mlx.branches import Branches
from mlxcache.integrations.vllm_mlx.shared_tier import ERRORS, held_tokens

log = logging.getLogger("mlxcache")

_saved: dict[str, Any] = {}


def store_chunks(
    scheduler: Any,
    generator: Any,
    prompt_responses: Sequence[Any],
    batched: set[int],
    branches: Branches | None = None,
) -> None:
    """Store the cache of each request whose prefill chunk has just run alone, and has always
    (``batched``: the uids of requests whose chunks ran with another's, updated here), and a
    checkpoint at a branch point (``branches``); a failure is a log line, never an error in
    the scheduler's step."""
    cache = getattr(scheduler, "memory_aware_cache", None)
    tier_of = getattr(cache, "_tier", None)
    batched.difference_update(r.uid for r in prompt_responses if r.end_of_prompt)
    chunks = {r.uid: r for r in prompt_responses if not r.end_of_prompt}
    if len(chunks) > 1:  # prefilled together: vllm-mlx's batch differs from one request's run
        batched.update(chunks)
    chunks = {uid: r for uid, r in chunks.items() if uid not in batched}
    at = branches.reached(prompt_responses) if branches is not None else {}
    if tier_of is None or not chunks:
        return
    try:
        for uid, (layers, _) in generator.extract_cache(list(chunks)).items():
            _store_chunk(scheduler, generator, tier_of, chunks[uid], list(layers), at.get(uid))
    except Exception as e:  # never into the server: the request's own stores still run
        log.warning("vllm-mlx shared tier: a prefill chunk's store failed: %s", e)
        ERRORS.add("store")


def _store_chunk(
    scheduler: Any, generator: Any, tier_of: Any, chunk: Any, layers: list[Any], at: int | None
) -> None:
    """Store one request's cache after its chunk ``chunk`` (mlx-lm's prompt response); ``at``:
    the branch point this chunk ended at (None: none)."""
    request = scheduler.requests.get(scheduler.uid_to_request_id.get(chunk.uid))
    if request is None:
        return
    prompt = list(request.prompt_token_ids or [])
    n = (request.cached_tokens or 0) + chunk.progress[0]  # restored + prefilled so far
    held = held_tokens(layers)  # None: state layers only (no offset to check)
    if not 0 < n < len(prompt) or held not in (None, n):
        return  # not what the scheduler's own count says: never stored under these tokens
    tier = tier_of(getattr(request, "mlxcache_salt", ""))
    if at == n:  # a branch point: its blocks and a checkpoint there
        tier.store_prefill(prompt[:n], layers)
    elif chunk.end_of_segment:  # the prompt minus its last token: stored whole
        tier.store(prompt[:n], layers)
    elif chunk_store_due(layers, n, tier.config.block_size, generator.prefill_step_size):
        tier.store_prefill(prompt[:n], layers)


def install() -> None:
    """Wrap the ``next()`` of the batch generators vllm-mlx's scheduler makes (idempotent)."""
    if _saved:
        return
    from mlx_lm.models.cache import make_prompt_cache
    from vllm_mlx import scheduler

    cls = scheduler.Scheduler
    original = cls._create_batch_generator

    def create_batch_generator(self: Any, sampling_params: Any) -> Any:
        generator = original(self, sampling_params)
        fresh = make_prompt_cache(self.model)
        if not stores_mid_prefill(fresh):
            return generator
        step, batched = generator.next, set[int]()
        branches = Branches(self, generator, batched) if holds_state(fresh) else None

        def next_storing() -> Any:
            if branches is not None:
                branches.cut()
            result = step()
            if isinstance(result, tuple):  # mlx-lm >= 0.31: (prompt, generation) responses
                store_chunks(self, generator, result[0], batched, branches)
            return result

        generator.next = next_storing
        return generator

    _saved["create"] = (cls, original)
    cls._create_batch_generator = create_batch_generator


def uninstall() -> None:
    """Put back the scheduler's own ``_create_batch_generator``."""
    if "create" in _saved:
        cls, original = _saved.pop("create")
        cls._create_batch_generator = original
