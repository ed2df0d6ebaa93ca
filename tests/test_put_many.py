"""``put_many`` through the layers above the backends: PrefixCache and tiered write-through.

A prompt's blocks are stored with one ``put_many``, so on ``file://?sync=batch`` a prompt pays
one sync, not one per block; a third-party backend of the bare protocol (no ``put_many``) still
works through ``put``.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from helpers import bits
from mlx_lm.models.cache import KVCache

from mlxcache import PrefixCache, Record
from mlxcache.backends.disk import DiskBackend
from mlxcache.backends.disk import writes as disk_writes
from mlxcache.backends.memory import MemoryBackend
from mlxcache.backends.tiered import TieredBackend

BS = 16


def kv_cache(tokens: int, layers: int = 2, seed: int = 0) -> list[KVCache]:
    """Real mlx-lm KVCache layers holding random keys and values."""
    out = []
    for i in range(layers):
        k = mx.random.normal((1, 2, tokens, 8), key=mx.random.key(seed + 2 * i))
        v = mx.random.normal((1, 2, tokens, 8), key=mx.random.key(seed + 2 * i + 1))
        c = KVCache()
        c.update_and_fetch(k, v)
        out.append(c)
    mx.eval([c.state for c in out])
    return out


def state_bits(cache) -> list[tuple]:
    """Bits of each layer's keys and values up to its offset (mlx-lm pads its buffers)."""
    return [bits(a[..., : c.offset, :]) for c in cache for a in (c.keys, c.values)]


class BatchSyncs:
    """Counts batch syncs of the disk backend; the real sync still runs (a spy)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        real = disk_writes.sync_all

        def sync_all(*args: object) -> None:
            self.calls += 1
            real(*args)

        monkeypatch.setattr(disk_writes, "sync_all", sync_all)


def test_a_prompt_is_stored_with_one_sync(tmp_path, monkeypatch):
    ids = np.random.default_rng(0).integers(1, 900, 5 * BS).tolist()
    cache = kv_cache(len(ids))
    with PrefixCache(DiskBackend(tmp_path, sync="batch"), model="m", block_size=BS) as pc:
        syncs = BatchSyncs(monkeypatch)
        assert pc.store(ids, cache) == len(ids)
        assert syncs.calls == 1 and len(pc.backend) == 6  # 5 blocks and the tail record
        hit = pc.lookup(ids)
        assert hit is not None and hit.num_tokens == len(ids)
        assert state_bits(hit.prompt_cache) == state_bits(cache)


class BareBackend:
    """A third-party backend of the bare CacheBackend protocol: no BackendBase, no put_many."""

    def __init__(self) -> None:
        self.inner = MemoryBackend()
        self.puts = 0

    def put(self, key: str, record: Record) -> None:
        self.puts += 1
        self.inner.put(key, record)

    def __getattr__(self, name: str):  # get, get_many, contains_many, stats, ...
        if name == "put_many":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __contains__(self, key: object) -> bool:
        return key in self.inner

    def __len__(self) -> int:
        return len(self.inner)

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def test_a_bare_protocol_backend_is_stored_to_with_put(tmp_path):
    ids = np.random.default_rng(1).integers(1, 900, 3 * BS).tolist()
    cache = kv_cache(len(ids), seed=7)
    bare = BareBackend()
    assert not hasattr(bare, "put_many")
    pc = PrefixCache(bare, model="m", block_size=BS)
    assert pc.store(ids, cache) == len(ids) and bare.puts == 4  # 3 blocks, the tail
    hit = pc.lookup(ids)
    assert hit is not None and state_bits(hit.prompt_cache) == state_bits(cache)


def test_tiered_write_through_batches_its_lower_tier(tmp_path, monkeypatch):
    b = TieredBackend(MemoryBackend(), DiskBackend(tmp_path / "l2", sync="batch"))
    syncs = BatchSyncs(monkeypatch)
    recs = [(f"k{i}", Record({"x": mx.full((50,), i, mx.float32)}, {"i": i})) for i in range(6)]
    b.put_many(recs)
    assert syncs.calls == 1
    assert all(k in b.l1 and k in b.l2 for k, _ in recs)
    b.l1.clear()
    got = b.get_many([k for k, _ in recs])
    assert [bits(r.arrays["x"]) for r in got] == [bits(r.arrays["x"]) for _, r in recs]
