"""Branch points of mlx-vlm's checkpoint-mode APC on state-layer models (issue 26).

A prompt whose whole blocks match a stored one's up to ``m`` tokens but whose hit is an earlier
checkpoint (a stride multiple, a stored length, or none) is checkpointed at its branch point, the
last block boundary ``b <= m`` (``resume.branch_point``: one ``PrefixCache.longest``), so the next
request that branches there, on any server, resumes at ``b``. ``SharedAPCManager`` finds ``b`` at
its lookup and keeps it here, by the prompt and its salt; ``chunk_stores.py`` hands it to
mlx-vlm as one more of the row's checkpoint lengths, so mlx-vlm's own prefill ends a chunk there
and asks the manager to store it (``store_exact_cache``), which stores it in the shared store only.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from mlxcache.integrations.resume import branch_point
from mlxcache.prefix import PrefixCache


def _key(token_ids: Sequence[int], extra_hash: int) -> tuple[bytes, int]:
    """A prompt (or prefix) and its salt, in a few bytes."""
    data = np.asarray([int(t) for t in token_ids], dtype=np.int64).tobytes()
    return hashlib.blake2b(data, digest_size=16).digest(), int(extra_hash)


class Branches:
    """Branch points found at lookups, until the prefill takes them; their stores, until done.

    Bounded (the oldest go first): a lookup whose prompt is never prefilled leaves a few bytes.
    """

    def __init__(self, size: int = 256) -> None:
        self._found: OrderedDict[tuple[bytes, int], int] = OrderedDict()
        self._stores: OrderedDict[tuple[bytes, int], None] = OrderedDict()
        self._lock = threading.Lock()
        self._size = size
        self.taken = 0  # branch points handed to a prefill
        self.stored = 0  # of those, stored

    def find(
        self,
        prefix: PrefixCache,
        token_ids: Sequence[int],
        images: list[bytes],
        extra_hash: int,
        have: int,
    ) -> int:
        """Remember (and return) the branch point of the prompt ``token_ids`` (0: none): past
        ``have`` tokens (the hit, and no shorter than a hit mlx-vlm accepts), before the prompt's
        last token. A failing backend is no branch point (``cache_call`` logs it)."""
        tokens = [int(t) for t in token_ids[: len(token_ids) - 1]]
        at = branch_point(prefix, tokens, images, have) if tokens else 0
        if at:
            with self._lock:
                self._found[_key(token_ids, extra_hash)] = at
                self._found.move_to_end(_key(token_ids, extra_hash))
                while len(self._found) > self._size:
                    self._found.popitem(last=False)
        return at

    def take(self, token_ids: Sequence[int], extra_hash: int) -> int:
        """The branch point found for this prompt (0: none), once."""
        with self._lock:
            return self._found.pop(_key(token_ids, extra_hash), 0)

    def expect(self, token_ids: Sequence[int], extra_hash: int) -> None:
        """A prefill checkpoints the prefix ``token_ids`` at its branch point: its store is a
        branch point's."""
        with self._lock:
            self.taken += 1
            self._stores[_key(token_ids, extra_hash)] = None
            while len(self._stores) > self._size:
                self._stores.popitem(last=False)

    def is_store(self, token_ids: Sequence[int], extra_hash: int) -> bool:
        """Whether a checkpoint of exactly ``token_ids`` is a branch point's (then no longer
        expected)."""
        with self._lock:
            try:
                del self._stores[_key(token_ids, extra_hash)]
            except KeyError:
                return False
            self.stored += 1
            return True
