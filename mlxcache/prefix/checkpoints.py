"""Where a prompt with state layers (ArraysCache: conv and SSM / gated-delta state) is
checkpointed, and where its prefill is split to get there (docs/prefix.md, "Checkpoints").

A state layer cannot be cut back to a block boundary: its state is stored whole, in the tail
record of a length, and restored only there. So a prefill through mlxcache leaves such tails at

- a **stride**: every ``stride`` tokens, a multiple of ``lcm(block size, prefill step)``, the
  smallest one at which the state stored per stride stays within ``share`` of the KV bytes of
  the same tokens (block and window layers); a model without KV layers (Mamba) uses the lcm;
- a **branch point**: the last block boundary at or before where a request stopped matching a
  stored prompt, so the next request that branches there resumes there;
- the stored length itself (the prompt's end, as every model).

The prefill runs in chunks of the prefill step that also end on these points. A stride multiple
is a block boundary and one of the engine's own chunk ends, so a prefill with nothing restored
and no branch point splits exactly where the engine's uncached prefill does (never a different
answer, even for a model whose numerics change at any split), and a hit at a stride checkpoint
continues on the engine's own chunks. The state's size is unknown until the model ran: the
stride is learnt after the first chunk (which ends where the engine's does) or from a restored
state.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from mlxcache.prefix import records as pr

DEFAULT_SHARE = 0.25  # state bytes per stride at most 25% of the KV bytes of its tokens


def _arrays(x: Any) -> list[mx.array]:
    if isinstance(x, mx.array):
        return [x]
    if isinstance(x, list | tuple):
        return [a for y in x for a in _arrays(y)]
    if isinstance(x, dict):
        return [a for y in x.values() for a in _arrays(y)]
    return []


def state_bytes(prompt_cache: Sequence[Any]) -> int:
    """Bytes of the layers a tail stores whole (checkpoint layers): one checkpoint's size."""
    lay = pr.layout(prompt_cache)
    return sum(
        a.nbytes
        for c, tag in zip(prompt_cache, lay, strict=True)
        if tag.startswith("c:")
        for a in _arrays(c.state)
    )


def kv_bytes_per_token(prompt_cache: Sequence[Any]) -> float:
    """Bytes per token of the block and window layers (what a block record stores per token)."""
    lay = pr.layout(prompt_cache)
    total = 0.0
    for c, tag in zip(prompt_cache, lay, strict=True):
        if tag.startswith(("b:", "w:")):
            state = c.state if getattr(c, "keys", None) is not None else ()
            total += sum(
                a.nbytes / a.shape[-2] for a in _arrays(state) if a.ndim >= 2 and a.shape[-2]
            )
    return total


def stride(prompt_cache: Sequence[Any], block_size: int, share: float, step: int) -> int | None:
    """The checkpoint stride of this cache, or None while its state is not known (no run yet).

    The smallest multiple of ``lcm(block_size, step)`` at which ``state_bytes <= share * KV
    bytes of the stride`` (a block boundary the engine's chunked prefill also splits at);
    without KV layers, the lcm itself.
    """
    state = state_bytes(prompt_cache)
    if not state:
        return None
    unit = _unit(block_size, step)
    kv = kv_bytes_per_token(prompt_cache)
    if kv <= 0:
        return unit
    return unit * max(1, math.ceil(state / (share * kv * unit)))


def _unit(block_size: int, step: int) -> int:
    """The shortest stride: a whole number of blocks and of prefill steps (their lcm)."""
    return math.lcm(block_size, step)


@dataclass
class Checkpoints:
    """The chunk ends and checkpoints of one prefill of a cache with state layers.

    ``branch``: a block boundary past the restored prefix to checkpoint at (0: none).
    ``stride`` is learnt from the cache (:meth:`learn`) once its state exists.
    """

    block_size: int
    share: float
    step: int
    branch: int = 0
    stride: int | None = None

    def learn(self, prompt_cache: Sequence[Any], ran: bool = False) -> None:
        """Measure the stride once the cache holds a state (a restored prefix, a first chunk);
        a state still empty after a run (nothing to weigh) takes the shortest stride."""
        if self.stride is None:
            self.stride = stride(prompt_cache, self.block_size, self.share, self.step)
            if self.stride is None and ran:
                self.stride = _unit(self.block_size, self.step)

    def next_end(self, s: int, end: int) -> int:
        """Where the chunk from ``s`` ends: ``step`` on (the engine's own chunk), or earlier at
        the next stride multiple (only when resumed off the engine's grid) or branch point."""
        e = min(s + self.step, end)
        if self.stride is not None:  # unknown yet: the engine's own first chunk
            e = min(e, (s // self.stride + 1) * self.stride)
        return self.branch if s < self.branch < e else e

    def keeps(self, e: int) -> bool:
        """Whether a chunk end is a checkpoint (a stride multiple or the branch point)."""
        return e == self.branch or (self.stride is not None and e % self.stride == 0)


def validate_share(share: float) -> float:
    """A share is a positive number (``PrefixCache(checkpoint_share=...)``)."""
    if isinstance(share, bool) or not isinstance(share, int | float) or not share > 0:
        raise ValueError(f"checkpoint_share must be a positive number, got {share!r}")
    return float(share)
