"""The plan of one PrefixCache request: its chained block hashes, and where a match can end.

``Plan`` hashes each whole block once and the stored lengths inside a block on demand;
``Match`` is what a lookup learned from the backend. ``prefix.py``, ``prefix_walk.py`` and
``prefix_hot.py`` read them; they know tokens and image digests, nothing of backends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from mlxcache import hashing


def as_tokens(token_ids: Any) -> np.ndarray:
    """Token ids (list, NumPy or MLX array, 1-D or one row) as a flat int64 array."""
    if isinstance(token_ids, mx.array):
        token_ids = np.array(token_ids)
    t = np.asarray(token_ids)
    if t.ndim == 2 and t.shape[0] == 1:
        t = t[0]
    if t.ndim != 1 or (t.size and t.dtype.kind not in "iu"):
        raise TypeError("token_ids must be a 1-D sequence of ints")
    return t.astype(np.int64, copy=False)


def check_positions(tokens: np.ndarray, positions: list[int], image_token_id: int) -> None:
    """Explicit positions may not start an image after its first placeholder token.

    An image keys only the blocks from its position on; a later position would let the
    placeholders before it (whose KV depends on the image) be shared with another image.
    """
    runs = hashing.image_runs(tokens, image_token_id)
    if not runs:
        return
    late = positions[0] > runs[0]  # the first placeholder belongs to the first image
    if len(runs) == len(positions):
        late = late or any(p > r for p, r in zip(positions, runs, strict=True))
    if late:
        raise ValueError(
            f"image_positions {positions} start an image after its placeholder tokens "
            f"(runs of image_token_id start at {runs})"
        )


class Plan:
    """The hashes of one request: its tokens, its images and where the images start."""

    def __init__(self, seed: bytes, tokens: np.ndarray, bs: int, digests, positions) -> None:
        self.seed, self.tokens, self.bs = seed, tokens, bs
        self.digests, self.positions = digests, positions
        self._full: list[bytes] | None = None

    def extra(self, start: int, end: int) -> bytes:
        if not self.digests:
            return b""
        if self.positions is None:  # unknown positions: every image keys block 0
            return hashing.all_images_extra(self.digests) if start == 0 else b""
        return hashing.placed_images_extra(self.digests, self.positions, start, end)

    def parent(self, i: int) -> bytes:
        return self.full(i)[i - 1] if i else self.seed

    def full(self, n: int) -> list[bytes]:
        """Hashes of the first ``n`` whole blocks (every whole block hashed once, in one pass)."""
        if self._full is None:
            bs = self.bs
            extras = [self.extra(a, a + bs) for a in range(0, len(self.tokens) - bs + 1, bs)]
            self._full = hashing.block_hashes(self.seed, self.tokens, bs, extras)
        return self._full[:n]

    def partial(self, i: int, r: int) -> bytes:
        """Hash of the first ``r`` tokens of block ``i`` (the key of a stored length)."""
        a = i * self.bs
        return hashing.chain(self.parent(i), self.tokens[a : a + r], self.extra(a, a + r))

    def block_tokens(self, i: int, r: int | None = None) -> bytes:
        a = i * self.bs
        return hashing.tokens_bytes(self.tokens[a : a + (self.bs if r is None else r)])


@dataclass
class Match:
    """Where a lookup's prefix can end: ``k`` leading whole blocks found, ``pm`` the longest
    stored length inside block ``k`` (0: none), ``aligned`` the longest run of whole blocks
    with a tail, and whether the vision entry exists."""

    k: int
    pm: int
    aligned: int
    vision: bool
