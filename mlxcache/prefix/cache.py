"""PrefixCache: block-hashed reuse of prompt caches on any backend, across processes.

Keys are chained SHA-256 block hashes seeded by the model identity and a tenant salt, so a
second request, a second worker or a restarted server finds the longest cached prefix of a
prompt (images included, by content and in order) and never anyone else's. See docs/prefix.md.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import mlx.core as mx
import numpy as np

from mlxcache import hashing
from mlxcache.backends.base import CacheBackend, log, put_all
from mlxcache.backends.chains import add_sibling, walk_chain, walks_chains
from mlxcache.backends.counters import Counters, Latency
from mlxcache.backends.writer import BackgroundWriter
from mlxcache.prefix import checkpoints, counts, gaps, heal
from mlxcache.prefix import probe as prefix_probe
from mlxcache.prefix import records as pr
from mlxcache.prefix import walk as prefix_walk
from mlxcache.prefix.hot import DEFAULT_HOT_BYTES, HotEntry, HotPrefixes
from mlxcache.prefix.plan import Match, Plan, as_tokens, check_positions
from mlxcache.prefix.restore import fetch as fetch_records
from mlxcache.prefix.restore import restore
from mlxcache.prefix.writes import Writes, plan_writes
from mlxcache.protocol import PinnableBackend
from mlxcache.records.record import Record
from mlxcache.serializers import kv_quant
from mlxcache.serializers.prompt_cache import load_prompt_cache
from mlxcache.uri import open_backend

KEY_ROOT = "mlxcache/prefix/v1"


@dataclass
class PrefixHit:
    """The longest cached prefix of a request.

    ``prompt_cache`` holds exactly ``num_tokens`` tokens in new cache objects (``None`` when
    only the vision embeddings were found); ``extras`` are the arrays stored with a prompt that
    ended exactly at ``num_tokens`` (else empty).
    """

    num_tokens: int
    prompt_cache: list[Any] | None
    extras: dict[str, mx.array] = field(default_factory=dict)
    vision_embeddings: Any = None


class PrefixCache:
    """Stores prompt caches by block and finds the longest cached prefix of a new prompt.

    ``backend`` is a CacheBackend, a URI for ``open_backend`` or None (``$MLXCACHE_URL`` or
    the default folder). ``model`` is the model identity (see ``model_identity``); ``salt``
    isolates tenants. With ``image_token_id``, each image keys the block where its placeholder
    run starts, so text before an image is shared across images (see docs/prefix.md).
    ``kv_bits`` (8, 4, ...; None = exact, the default) stores block KV quantized in groups of
    ``kv_group_size``: lossy, fewer bytes moved; its own namespace (docs/prefix.md).
    ``hot_bytes`` bounds the in-process hot tier of assembled prefixes (0: none; see
    ``prefix_hot.py``); with ``hot_probe=False`` a hot entry answers without asking the backend
    for a longer prefix (another worker's is then not used). ``checkpoint_share`` bounds the
    state-layer checkpoints mlxcache's generation stores (``prefix/checkpoints.py``).
    """

    def __init__(
        self,
        backend: CacheBackend | str | None = None,
        *,
        model: str,
        block_size: int = 256,
        salt: str = "",
        image_token_id: int | None = None,
        kv_bits: int | None = None,
        kv_group_size: int = 64,
        hot_bytes: int = DEFAULT_HOT_BYTES,
        hot_probe: bool = True,
        checkpoint_share: float = checkpoints.DEFAULT_SHARE,
    ) -> None:
        self.checkpoint_share = checkpoints.validate_share(checkpoint_share)
        self.kv_quant = kv_quant.make(kv_bits, kv_group_size)  # ValueError before opening
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        if backend is None or isinstance(backend, str):
            self.backend: CacheBackend = open_backend(backend)
            self._owns_backend = True
        elif isinstance(backend, CacheBackend):
            self.backend, self._owns_backend = backend, False
        else:
            raise TypeError(f"backend must be a CacheBackend or a URI, got {type(backend)}")
        self.model, self.salt, self.block_size = model, salt, block_size
        self.image_token_id = image_token_id
        self._seed = hashing.namespace_seed(
            model, salt, kv=self.kv_quant.tag if self.kv_quant else ""
        )
        self.key_prefix = f"{KEY_ROOT}/{self._seed[:8].hex()}/"
        self._lock = threading.Lock()
        self.writer: BackgroundWriter | None = None  # made by the first background store
        hot = HotPrefixes(hot_bytes, block_size, self._key)  # validates hot_bytes
        self._hot = hot if hot_bytes else None
        self.hot_probe = bool(hot_probe)
        self._counts = Counters(counts.NAMES)
        self.latency = Latency()  # lookup/store durations, for metrics

    # ------------------------------------------------------------ keys

    def _key(self, kind: str, digest: bytes) -> str:
        return f"{self.key_prefix}{kind}/{digest.hex()}"

    def _plan(self, tokens: np.ndarray, images: Sequence[Any], positions: Any) -> Plan:
        digests = [hashing.image_digest(im) for im in images]
        if positions is not None:
            positions = [int(p) for p in positions]
            if len(positions) != len(digests) or positions != sorted(positions):
                raise ValueError("image_positions must give one ascending start per image")
            if positions and not 0 <= positions[0] <= positions[-1] < max(len(tokens), 1):
                raise ValueError("image_positions must lie inside token_ids")
            if self.image_token_id is not None:
                check_positions(tokens, positions, self.image_token_id)
        elif digests and self.image_token_id is not None:
            runs = hashing.image_runs(tokens, self.image_token_id)
            positions = runs if len(runs) == len(digests) else None
        return Plan(self._seed, tokens, self.block_size, digests, positions)

    def _vision_key(self, plan: Plan) -> str | None:
        if not plan.digests:
            return None
        return self._key("v", hashing.vision_digest(self._seed, plan.digests))

    def _count(self, **kw: int) -> None:
        self._counts.add_all(**kw)

    # ------------------------------------------------------------ store

    @counts.timed("store")
    def store(
        self,
        token_ids: Any,
        prompt_cache: Sequence[Any],
        *,
        images: Sequence[Any] = (),
        extras: Mapping[str, Any] | None = None,
        vision_embeddings: Any = None,
        image_positions: Sequence[int] | None = None,
        background: bool = False,
        pin: bool = False,
        mid_prefill: bool = False,
    ) -> int:
        """Store the cache of exactly ``token_ids``; returns how many new tokens the store kept.

        ``mid_prefill=True`` is a long prefill's store after a chunk: the whole blocks (so a
        window layer's are written while it holds them) and, only with checkpoint layers at a
        block-aligned length, a tail holding their state (no extras); no partial block, vision
        entry nor hot entry. The store at the prompt's end writes the rest.
        ``pin=True`` pins every record of this prompt (those already stored too), so LRU
        eviction and expiry never take them (a backend with ``pinnable`` only; see
        docs/backends.md).

        Only blocks not yet stored are written (one ``contains_many`` first, one after the
        puts to count what the backend kept: a refused or failed put counts 0; a prompt that
        ends inside a block then registers it with ``add_sibling`` for one-trip lookups). ``extras``
        (e.g. ``{"rope_deltas": ...}``) are kept with this exact length. With ``background``
        the records are built and evaluated here, the puts run on this cache's writer thread
        (see ``flush()``) and the return value is the number of new tokens queued.
        """
        if pin and not getattr(self.backend, "pinnable", False):
            raise NotImplementedError(f"{type(self.backend).__name__} cannot pin entries")
        tokens = as_tokens(token_ids)
        images = list(images)
        if vision_embeddings is not None and not images:
            raise ValueError("vision_embeddings are keyed by their images: pass images=")
        plan = self._plan(tokens, images, image_positions)
        n = len(tokens)
        layers = list(prompt_cache) if n else []
        if n and not layers:
            raise ValueError("prompt_cache is empty: store the cache objects of the prompt")
        if n:
            pr.check_lengths(layers, n)
        vkey = self._vision_key(plan) if vision_embeddings is not None else None
        writes = plan_writes(
            plan, layers, self._key, self.backend.contains_many, quant=self.kv_quant,
            vision_key=vkey, extras=extras, vision_embeddings=vision_embeddings,
            mid_prefill=mid_prefill,
        )  # fmt: skip
        todo, keys = writes.todo, writes.keys
        if not keys:
            return 0
        if self._hot is not None and n and self.kv_quant is None and not mid_prefill:
            # quantized: only backend hits (dequantized) go hot: a prefix decodes the same
            self._hot.keep_store(plan, layers, extras, vision_embeddings, keys)
        if not background:
            written = self._write(writes)
            if pin:
                self._pin(keys)
            return written
        writer = self._writer()
        # MLX arrays must be evaluated on the thread that built them, before the writer's
        mx.eval([a for _, rec, _ in todo for a in rec.arrays.values()])
        nbytes = sum(rec.nbytes for _, rec, _ in todo)

        def write() -> int:
            written = self._write(writes)
            if pin:
                self._pin(keys)
            return written

        queued = writer.submit(write, nbytes) if todo or pin else True
        return sum(m for _, _, m in todo) if queued else 0

    def _write(self, writes: Writes) -> int:
        todo, sibling = writes.todo, writes.sibling
        errors = gaps.errors(self.backend)
        put_all(self.backend, [(key, rec) for key, rec, _ in todo])  # file://: one sync
        # what the backend kept: a put it refused (over its budget) or lost (a dead server)
        # does not count. One more contains_many, only when something was written.
        kept = self.backend.contains_many([k for k, _, _ in todo]) if todo else []
        if sibling is not None:  # once its tail is stored: an entry names kept keys only
            new = {k: ok for (k, _, _), ok in zip(todo, kept, strict=True)}
            if new.get(sibling[2][0], True):
                add_sibling(self.backend, *sibling)
        completed = writes.completed if gaps.clear(self.backend, writes.cleared, errors) else 0
        written = sum(m for (_, _, m), ok in zip(todo, kept, strict=True) if ok)
        self._count(
            stores=1, tokens_written=written, records_written=sum(kept), blocks_completed=completed
        )
        return written

    def _pin(self, keys: list[str]) -> None:
        """Pin the records of one prompt; one the backend refuses (budget full) is logged."""
        backend = cast(PinnableBackend, self.backend)  # store() checked that it is pinnable
        refused = [k for k in keys if not backend.pin(k)]
        self._count(records_pinned=len(keys) - len(refused), pins_refused=len(refused))
        if refused:
            log.warning("prefix cache: %d of %d records not pinned", len(refused), len(keys))

    def _writer(self) -> BackgroundWriter:
        """This cache's writer thread (background stores, LRU touches), made on first use."""
        with self._lock:
            if self.writer is None:
                self.writer = BackgroundWriter(name="mlxcache-prefix-writer")
            return self.writer

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every ``store(..., background=True)`` so far is written (or dropped)."""
        return True if self.writer is None else self.writer.flush(timeout)

    # ------------------------------------------------------------ lookup

    @counts.timed("lookup")
    def lookup(
        self,
        token_ids: Any,
        *,
        images: Sequence[Any] = (),
        image_positions: Sequence[int] | None = None,
        require_extras: bool = False,
    ) -> PrefixHit | None:
        """The longest cached prefix of ``token_ids`` with these images, or None.

        One ``walk_chain`` where the backend has it (one round trip on Redis); else one
        ``contains_many`` (a second, of at most ``block_size - 1`` keys, when the match ends
        inside the request's whole blocks) and one ``get_many``. With ``require_extras`` a
        hit must end at a stored length (where extras were kept).
        """
        tokens = as_tokens(token_ids)
        plan = self._plan(tokens, list(images), image_positions)
        hot = self._hot.find(plan, require_extras) if self._hot is not None else None
        need_vision = hot is not None and bool(plan.digests) and hot.vision is None
        if hot is not None and (
            not self.hot_probe
            or self._beyond(plan, hot.num_tokens, need_vision) == (hot.num_tokens, False)
        ):  # nothing longer in the backend (nor vision embeddings the entry lacks): no read
            return self._counted(len(tokens), self._hot_serve(hot, plan))
        walked = self._walk(plan)
        if walked is not None:
            match, recs = walked
        else:
            match = self._probe(plan)
            fetch = prefix_probe.fetch_keys(plan, self._key, match, self._vision_key(plan))
            recs = fetch_records(self.backend, plan, match, fetch)
        hit = self._assemble(plan, match, recs, require_extras)
        if hot is not None and (hit is None or hit.num_tokens < hot.num_tokens):
            hit = self._hot_serve(hot, plan)  # the longer records did not verify
        elif self._hot is not None and hit is not None:
            self._hot.keep_hit(plan, hit, require_extras, self._vision_key(plan))
        return self._counted(len(tokens), hit)

    def _counted(self, requested: int, hit: PrefixHit | None) -> PrefixHit | None:
        self._count(lookups=1, tokens_requested=requested)
        if hit is None or not hit.num_tokens:
            self._count(misses=1)
        else:
            self._count(hits=1, tokens_reused=hit.num_tokens)
        return hit

    def _walk(self, plan: Plan) -> tuple[Match, list] | None:
        """The match and the records of ``prefix_probe.fetch_keys`` from one ``walk_chain``;
        None where the backend cannot walk or its answer does not fit the request."""
        vkey = self._vision_key(plan)
        if not walks_chains(self.backend) or not (len(plan.tokens) or vkey):
            return None
        found = walk_chain(self.backend, prefix_walk.chain_walk(plan, self._key, vkey))
        read = None if found is None else prefix_walk.read_walk(plan, self._key, found)
        return None if read is None else (Match(*read[:4]), read[4])

    def _assemble(
        self, plan: Plan, match: Match, recs: list, require_extras: bool
    ) -> PrefixHit | None:
        """The hit the fetched records make: the restored prefix and the vision embeddings."""
        got = restore(plan, match, recs, require_extras, self.kv_quant, self._reject)
        hit = None if got is None else PrefixHit(got.num_tokens, got.cache, got.extras)
        if match.vision:
            vision = self._vision(recs[-1])
            if vision is not None:
                self._count(vision_hits=1)
                hit = hit or PrefixHit(0, None)
                hit.vision_embeddings = vision
        return hit

    def _vision(self, rec: Record | None) -> Any:
        if rec is None:
            return None
        try:
            value, meta = load_prompt_cache(rec, return_metadata=True)
        except ValueError as e:
            self._reject(e)
            return None
        if (meta or {}).get("kind") != "vision":
            self._reject(ValueError("not a vision-embeddings record"))
            return None
        return value

    def _reject(self, err: Exception) -> None:
        log.warning("prefix cache: ignoring a stored record: %s", err)
        self._count(rejected=1)

    def longest(
        self,
        token_ids: Any,
        *,
        images: Sequence[Any] = (),
        image_positions: Sequence[int] | None = None,
        have: int = 0,
    ) -> int:
        """At most how many leading tokens ``lookup`` could restore, reading no record.

        At most the ``contains_many`` of ``lookup``: a caller that already has ``have`` tokens
        (an in-process tier) gets ``have`` back when nothing longer is stored, and calls
        ``lookup`` only when this is longer.
        """
        plan = self._plan(as_tokens(token_ids), list(images), image_positions)
        hot = self._hot.find(plan, False) if self._hot is not None else None
        return self._beyond(plan, max(have, hot.num_tokens if hot else 0))[0]

    def _probe(self, plan: Plan) -> Match:
        """The default path's match: one ``contains_many`` (two when the match ends inside
        the request's whole blocks; see prefix_probe)."""
        return prefix_probe.probe(plan, self._key, self._vision_key(plan), self.backend)

    def _beyond(self, plan: Plan, n: int, vision: bool = False) -> tuple[int, bool]:
        """How long a backend hit could be, given ``n`` tokens at hand (``n`` when nothing is
        longer), and (with ``vision``) whether the request's vision entry is stored.

        When ``n`` lies in the request's last partial block, only a stored length past ``n``
        can be longer: the tails at those lengths (and the vision key) are the one question
        (none when ``n`` is the whole request); the full probe follows only when one exists.
        """
        bs = self.block_size
        n_full, r = divmod(len(plan.tokens), bs)
        a, p = divmod(n, bs)
        vkey = self._vision_key(plan) if vision else None
        if a >= n_full:
            keys = [self._key("t", plan.partial(a, q)) for q in range(p + 1, r + 1)]
            keys += [vkey] if vkey else []
            found = self.backend.contains_many(keys) if keys else []
            if not any(found[: r - p]):
                return n, bool(vkey) and bool(found) and found[-1]
        match = self._probe(plan)  # a hit never ends past k blocks and pm tokens
        return max(n, match.k * bs + match.pm), bool(vkey) and match.vision

    # ------------------------------------------------------------ the hot tier

    def _hot_serve(self, entry: HotEntry, plan: Plan) -> PrefixHit:
        assert self._hot is not None
        layers, extras, vision = self._hot.serve(entry)
        if vision is not None:
            self._count(vision_hits=1)
        if entry.keys and self._hot.due_touch(entry):
            self._heal(plan, entry)
        return PrefixHit(entry.num_tokens, layers, extras, vision)

    def _heal(self, plan: Plan, entry: HotEntry) -> None:
        """Write back the records of a hot entry the backend lost, touch the rest (see
        prefix/heal.py; quantized: never, a hot entry holds the dequantized values)."""
        keys = list(entry.keys)
        gone = heal.lost(self.backend, keys) if self.kv_quant is None else []
        if gone:
            todo, sibling = heal.rebuild(plan, entry, self._key, set(gone), self._vision_key(plan))
            mx.eval([a for _, rec in todo for a in rec.arrays.values()])
            if todo:
                nbytes = sum(rec.nbytes for _, rec in todo)

                def write() -> None:
                    self._count(records_healed=heal.write_back(self.backend, todo, sibling))

                self._writer().submit(write, nbytes)
        if rest := [k for k in keys if k not in gone]:
            self._touch(rest)

    def _touch(self, keys: list[str]) -> None:
        """Refresh the backend's LRU order of a hot entry's records, off the caller's thread."""
        touch = getattr(self.backend, "touch_many", None)
        if touch is None:
            return
        self._writer().submit(lambda: touch(keys))

    # ------------------------------------------------------------ the rest

    def stats(self) -> dict[str, Any]:
        """Counters of this object (hits, misses, tokens reused...) and the backend's stats."""
        out: dict[str, Any] = self._counts.snapshot()
        out["hit_rate"] = out["hits"] / out["lookups"] if out["lookups"] else 0.0
        out["backend"] = self.backend.stats()
        out["hot"] = self._hot.stats() if self._hot is not None else None
        if self.writer is not None:
            out["writer"] = self.writer.stats()
        return out

    def clear(self) -> int:
        """Delete every entry of this model and salt (a key scan: an admin operation), the hot
        tier's too."""
        if self._hot is not None:
            self._hot.clear()
        keys = list(self.backend.keys(self.key_prefix))
        return sum(self.backend.delete(k) for k in keys)

    def close(self) -> None:
        """Write what ``store(..., background=True)`` queued; close the backend if this object
        opened it (from a URI); drop the hot tier."""
        if self.writer is not None:
            self.writer.close()
        if self._hot is not None:
            self._hot.clear()
        if self._owns_backend:
            self.backend.close()

    def __enter__(self) -> PrefixCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        kv = f", kv_bits={self.kv_quant.bits}" if self.kv_quant else ""
        return (
            f"PrefixCache(model={self.model!r}, block_size={self.block_size}{kv}, {self.backend!r})"
        )
