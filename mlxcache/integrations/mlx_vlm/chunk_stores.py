"""Stores after each prefill chunk of mlx-vlm's server, for sliding-window models (issue 26).

The seam, read in mlx-vlm 0.7.10's wheel: its server prefills through ``BatchGenerator``, which
runs a prompt in chunks of ``--prefill-step-size`` with ``PromptProcessingBatch.prompt_step``
(one chunk per call; its APC checkpoints are stored inside, at their exact lengths). A window
layer (``RotatingKVCache``) drops its old tokens in the next chunk, so a checkpoint at the
prompt's end holds only its last window: a later prompt that shares a passage inside the user
turn found nothing to restore. ``prompt_step`` is wrapped to hand each row's cache, right after
its chunk, to ``SharedAPCManager.store_prefill``, which stores its whole blocks while the window
still holds them (``PrefixCache.store(..., mid_prefill=True)``); the checkpoint lookup then
answers at any block boundary the store can rebuild. It reads the cache and never touches it:
mlx-vlm computes exactly what it computes without it.

One exception, for state layers only: a prompt the manager found a branch point for
(``branches.py``) gets it as one more of its checkpoint lengths (``PromptProcessingBatch``'s
``apc_meta[i]["checkpoint_lengths"]``, where mlx-vlm keeps the prompt less its guard token and
its interval strides), so mlx-vlm's own prefill ends a chunk there and stores it through the
manager. Its answer is then mlx-vlm's resumed at the branch point (what the next request that
hits there runs); a prompt with no branch point, and any model without state layers, runs as
before.
"""

from __future__ import annotations

import logging
from typing import Any

from mlx_vlm import apc as _apc

from mlxcache.integrations.mlx_vlm.apc import Installed, SharedAPCManager
from mlxcache.integrations.resume import stores_mid_prefill

log = logging.getLogger("mlxcache")


def store_rows(batch: Any, manager: SharedAPCManager) -> None:
    """Store the cache of every row of ``batch`` that advanced in its last chunk.

    A row's tokens are its prompt's first ``_row_real_tokens_processed`` (mlx-vlm's own count,
    padding and a restored prefix included); batch-shaped caches give the row's cache with
    mlx-vlm's own extraction, borrowed (the store is written before this returns).
    """
    done: dict[int, int] = batch.__dict__.setdefault("_mlxcache_stored", {})
    for i, meta in enumerate(batch._apc_meta):
        if meta is None or not meta.get("full_input_ids"):
            continue
        n = batch._row_real_tokens_processed(i)
        if n <= max(done.get(i, 0), int(meta.get("prefix_len") or 0)):
            continue  # nothing new in this row (finished, or still in its padding)
        done[i] = n
        row = _apc.snapshot_prompt_cache_row(batch.prompt_cache, i, clone=False)
        if not row:
            continue
        if "_mlxcache_stores" not in batch.__dict__:  # the same layers for the whole prefill
            batch._mlxcache_stores = stores_mid_prefill(row)  # (of a row's class)
        if batch._mlxcache_stores:
            manager.store_prefill(
                meta["full_input_ids"][:n],
                row,
                extra_hash=int(meta.get("extra_hash") or 0),
                step=batch.prefill_step_size,
            )


def add_branch_points(apc_meta: Any, manager: SharedAPCManager) -> None:
    """Add a prompt's branch point (``Branches.take``) to its checkpoint lengths, where it lies
    strictly between its restored prefix and its last checkpoint (mlx-vlm's final one).

    Only when the prompt is prefilled alone: mlx-vlm ends every row's chunk at the nearest
    checkpoint of any row, so a branch point would split the other rows too.
    """
    rows = [m for m in apc_meta or () if m and m.get("full_input_ids")]
    points = [(m, manager.branches.take(m["full_input_ids"], int(m.get("extra_hash") or 0)))
              for m in rows]  # fmt: skip
    if len(points) != 1 or len(apc_meta) != 1:
        return
    ((meta, at),) = points
    ids, lengths = meta["full_input_ids"], list(meta.get("checkpoint_lengths") or ())
    start = int(meta.get("prefix_len") or 0)
    if lengths and start < at < lengths[-1] and at not in lengths:
        meta["checkpoint_lengths"] = sorted([*lengths, at])
        manager.branches.expect(ids[:at], int(meta.get("extra_hash") or 0))
        log.info(
            "mlxcache APC: the prompt branches off a stored one at %d of %d tokens (%d "
            "restored): a chunk ends there and its state is stored", at, len(ids), start,
        )  # fmt: skip


def install(installed: Installed) -> None:
    """Wrap ``PromptProcessingBatch.prompt_step`` and its ``__init__`` (undone with
    ``installed.uninstall()``)."""
    from mlx_vlm.generate import ar

    original_init = ar.PromptProcessingBatch.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        manager = kwargs.get("apc_manager")
        if isinstance(manager, SharedAPCManager) and manager.states and manager.checkpoint_mode:
            add_branch_points(kwargs.get("apc_meta"), manager)
        original_init(self, *args, **kwargs)

    installed.replace(ar.PromptProcessingBatch, "__init__", __init__)
    original = ar.PromptProcessingBatch.prompt_step

    def prompt_step(self: Any) -> int:
        n = original(self)
        manager = getattr(self, "_apc_manager", None)
        if n > 0 and isinstance(manager, SharedAPCManager) and manager.checkpoint_mode:
            if self.__dict__.get("_mlxcache_stores", True) and self._apc_uses_checkpoints():
                store_rows(self, manager)
        return n

    installed.replace(ar.PromptProcessingBatch, "prompt_step", prompt_step)
