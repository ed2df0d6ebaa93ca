"""PrefixCache's in-process hot tier: assembled prefixes kept by chain key within a byte budget.

A lookup that hits here skips the backend read, the per-block concatenation and the checks: the
entry was assembled (and, when it came from the backend, verified) once. Keys are the chained
content hashes of ``PrefixCache`` (tokens, images, model, salt), so an entry stays valid for as
long as it is kept. Entries are our own cache objects, never a caller's; a hit hands out a
``copy.deepcopy`` of them (new cache and array objects over the same buffers, as mlx-lm's
``LRUPromptCache`` does), so a caller's in-place update never reaches the tier or another caller.
"""

from __future__ import annotations

import copy
import functools
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from mlxcache.backends.base import log
from mlxcache.prefix import records as pr
from mlxcache.serializers import adapters

DEFAULT_HOT_BYTES = 1 << 30  # 1 GiB: ~8k tokens of an 8B GQA model (128 KiB per token)
TOUCH_EVERY = 30.0  # seconds between two backend touches of one hot entry's records


@dataclass
class HotEntry:
    """One assembled prefix: ``layers`` (ours, evaluated, never handed out), its ``extras``
    and vision embeddings, whether it ends at a stored length (``stored``: its extras are the
    stored ones) and the backend keys that hold it (touched so the backend keeps them)."""

    num_tokens: int
    layers: list[Any]
    extras: dict[str, mx.array]
    stored: bool
    vision: Any = None
    keys: tuple[str, ...] = ()
    nbytes: int = 0
    touched: float = field(default_factory=time.monotonic)


def _arrays(obj: Any) -> list[mx.array]:
    return [a for _, a in tree_flatten(obj) if isinstance(a, mx.array)]


def _states(layers: Sequence[Any]) -> list[Any]:
    return [c.state for c in layers]


def own_layers(prompt_cache: Sequence[Any]) -> list[Any]:
    """New cache objects holding exactly the state of ``prompt_cache`` (a caller's), evaluated.

    Per-block layers are rebuilt from their state sliced to what they hold (no preallocated
    slack kept); other layers are deep copies. No array object of the caller's is kept.
    """
    out = []
    for c in prompt_cache:
        found = adapters.find(c)
        if found is not None and found[1].per_block:
            (lib, name), _ = found
            keys, values, n, params = adapters.block_state(c)
            out.append(adapters.from_block_state(lib, name, keys, values, n, params))
        else:
            out.append(copy.deepcopy(c))
    mx.eval(_arrays(_states(out)))
    return out


def make_entry(
    num_tokens: int,
    layers: list[Any],
    extras: Mapping[str, Any] | None,
    *,
    stored: bool,
    vision: Any = None,
    keys: Sequence[str] = (),
) -> HotEntry:
    """An entry over ``layers`` (already ours); extras and vision are copied and evaluated."""
    ex = {k: v if isinstance(v, mx.array) else mx.array(v) for k, v in (extras or {}).items()}
    ex, vision = copy.deepcopy(ex), copy.deepcopy(vision)
    held = _arrays([_states(layers), ex, vision])
    mx.eval(held)
    nbytes = sum(a.nbytes for a in held)
    return HotEntry(num_tokens, layers, ex, stored, vision, tuple(keys), nbytes)


class HotTier:
    """An LRU of ``HotEntry`` by chain digest, at most ``max_bytes`` in total (thread-safe)."""

    def __init__(self, max_bytes: int = DEFAULT_HOT_BYTES) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"hot_bytes must be an int >= 0, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._entries: OrderedDict[bytes, HotEntry] = OrderedDict()
        self._lengths: Counter[int] = Counter()  # how many entries end at each length
        self._bytes = 0
        self.counts = dict.fromkeys(("hits", "inserts", "evictions", "too_big"), 0)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def longest(self, n: int, digest: Callable[[int], bytes], *, stored: bool) -> HotEntry | None:
        """The longest entry of at most ``n`` tokens whose key is ``digest(length)`` (a prefix
        of the request); with ``stored`` one at a stored length. It becomes the most recently
        used."""
        with self._lock:
            lengths = sorted((m for m in self._lengths if m <= n), reverse=True)
        for m in lengths:
            d = digest(m)
            with self._lock:
                e = self._entries.get(d)
                if e is None or e.num_tokens != m:
                    continue
                if e.stored or not stored:
                    self._entries.move_to_end(d)
                    return e
        return None

    def put(self, digest: bytes, entry: HotEntry) -> bool:
        """Keep ``entry`` (replacing one of the same key), evicting the least recently used
        down to the budget; False (nothing kept) when it alone exceeds the budget."""
        with self._lock:
            if entry.nbytes > self.max_bytes:
                self.counts["too_big"] += 1
                return False
            self._drop(digest)
            self._entries[digest] = entry
            self._lengths[entry.num_tokens] += 1
            self._bytes += entry.nbytes
            self.counts["inserts"] += 1
            while self._bytes > self.max_bytes:
                self._drop(next(iter(self._entries)))
                self.counts["evictions"] += 1
            return True

    def _drop(self, digest: bytes) -> None:
        e = self._entries.pop(digest, None)
        if e is not None:
            self._bytes -= e.nbytes
            self._lengths[e.num_tokens] -= 1
            if not self._lengths[e.num_tokens]:
                del self._lengths[e.num_tokens]

    def serve(self, entry: HotEntry) -> tuple[list[Any], dict[str, mx.array], Any]:
        """New cache objects, extras and vision embeddings of ``entry`` for one caller."""
        with self._lock:
            self.counts["hits"] += 1
        return (
            copy.deepcopy(entry.layers),
            copy.deepcopy(entry.extras),
            copy.deepcopy(entry.vision),
        )

    def due_touch(self, entry: HotEntry) -> bool:
        """True at most once per ``TOUCH_EVERY`` seconds per entry (to refresh backend LRU)."""
        now = time.monotonic()
        with self._lock:
            if now - entry.touched < TOUCH_EVERY:
                return False
            entry.touched = now
            return True

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._lengths.clear()
            self._bytes = 0

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "entries": len(self._entries),
                "bytes": self._bytes,
                "max_bytes": self.max_bytes,
                **self.counts,
            }


class HotPrefixes(HotTier):
    """A ``HotTier`` that speaks ``PrefixCache``'s plans: an entry's key is the chain digest of
    its length (the digest of that length's ``t/`` record); ``key(kind, digest)`` names the
    backend records an entry touches."""

    def __init__(self, max_bytes: int, block_size: int, key: Callable[[str, bytes], str]) -> None:
        super().__init__(max_bytes)
        self.block_size, self.key = block_size, key

    def digest(self, plan: Any, n: int) -> bytes:
        """The chain digest of the request's first ``n`` tokens."""
        a, p = divmod(n, self.block_size)
        return plan.partial(a, p) if p else plan.full(a)[-1]

    def find(self, plan: Any, require_extras: bool) -> HotEntry | None:
        """The longest entry that is a prefix of the request and can answer it."""
        if not len(plan.tokens):
            return None
        digest = functools.partial(self.digest, plan)
        return self.longest(len(plan.tokens), digest, stored=require_extras)

    def keep_store(
        self, plan: Any, layers: list[Any], extras: Any, vision: Any, keys: Sequence[str]
    ) -> None:
        """Keep what ``store`` was given (our own objects over its state, evaluated here)."""
        n = len(plan.tokens)
        entry = make_entry(n, own_layers(layers), extras, stored=True, vision=vision, keys=keys)
        self.put(self.digest(plan, n), entry)

    def keep_hit(self, plan: Any, hit: Any, require_extras: bool, vision_key: str | None) -> None:
        """Keep a copy of a verified backend hit, with the keys of its records.

        It ends at a stored length (its extras are the stored ones) when the lookup required
        extras, or when it has extras or checkpoint layers (those always come from a tail).
        """
        n = hit.num_tokens
        if not n or hit.prompt_cache is None:
            return
        a, p = divmod(n, self.block_size)
        keys = [self.key("b", h) for h in plan.full(a)]
        keys += [self.key("b", plan.partial(a, p))] if p else []
        keys.append(self.key("t", self.digest(plan, n)))
        if hit.vision_embeddings is not None and vision_key is not None:
            keys.append(vision_key)
        try:
            layers = copy.deepcopy(hit.prompt_cache)
            stored = require_extras or bool(hit.extras) or pr.has_checkpoint(pr.layout(layers))
            entry = make_entry(
                n, layers, hit.extras, stored=stored, vision=hit.vision_embeddings, keys=keys
            )
        except Exception as e:  # a class that does not copy: served from the backend only
            log.warning("prefix cache: not keeping a hit in the hot tier: %s", e)
            return
        self.put(self.digest(plan, n), entry)
