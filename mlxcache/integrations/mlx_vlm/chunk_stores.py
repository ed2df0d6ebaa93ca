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
"""

from __future__ import annotations

from typing import Any

from mlx_vlm import apc as _apc

from mlxcache.integrations.mlx_vlm.apc import Installed, SharedAPCManager
from mlxcache.integrations.resume import stores_mid_prefill


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


def install(installed: Installed) -> None:
    """Wrap ``PromptProcessingBatch.prompt_step`` (undone with ``installed.uninstall()``)."""
    from mlx_vlm.generate import ar

    original = ar.PromptProcessingBatch.prompt_step

    def prompt_step(self: Any) -> int:
        n = original(self)
        manager = getattr(self, "_apc_manager", None)
        if n > 0 and isinstance(manager, SharedAPCManager) and manager.checkpoint_mode:
            if self.__dict__.get("_mlxcache_stores", True) and self._apc_uses_checkpoints():
                store_rows(self, manager)
        return n

    installed.replace(ar.PromptProcessingBatch, "prompt_step", prompt_step)
