"""file:// keeps the block files a restore read open for the next one (``descriptors.py``): a
kept descriptor never serves a block that was deleted, replaced or quarantined since."""

from __future__ import annotations

import os

import mlx.core as mx
import pytest
from test_prefix_restore import BS, flip, kv_cache, pair

from mlxcache.backends.disk import DiskBackend
from mlxcache.backends.disk.descriptors import Descriptors
from mlxcache.records import reader


def block_keys(backend: DiskBackend) -> dict[int, tuple[str, str]]:
    """Block index -> (key, file name) of every stored block record."""
    out = {}
    for key in backend.keys(""):
        name = backend._lookup([key])[key]
        meta = reader.read_header(backend._data / name).meta
        if meta.get("kind") == "block":
            out[meta["start"] // BS] = (key, name)
    return out


def keys_bits(cache: list, n: int) -> list[bytes]:
    return [bytes(memoryview(mx.contiguous(c.keys[..., :n, :]))) for c in cache]


N = 4 * BS  # four whole blocks
TOKENS = list(range(1, N + 1))


def test_a_restore_keeps_its_files_open_and_reads_none_again(tmp_path, monkeypatch):
    w, r = pair(tmp_path)
    with w, r:
        w.store(TOKENS, kv_cache(N))
        assert r.lookup(TOKENS).num_tokens == N
        kept = len(r.backend._fds)
        assert kept == 4  # one a block
        opened = []
        real_open = os.open
        monkeypatch.setattr(os, "open", lambda *a, **k: opened.append(a[0]) or real_open(*a, **k))
        assert r.lookup(TOKENS).num_tokens == N
        assert not [p for p in opened if str(p).endswith(".safetensors")]


def test_a_block_deleted_and_stored_again_by_another_worker_is_read_anew(tmp_path):
    old, new = kv_cache(N, seed=1), kv_cache(N, seed=2)
    w, r = pair(tmp_path)
    with w, r:
        w.store(TOKENS, old)
        assert keys_bits(r.lookup(TOKENS).prompt_cache, N) == keys_bits(old, N)
        key, name = block_keys(w.backend)[2]
        assert name in r.backend._fds._open  # the reader keeps the old file open
        assert w.backend.delete(key)  # another worker: the reader's descriptor stays open
        hit = r.lookup(TOKENS)
        assert hit.num_tokens == 2 * BS  # the prefix ends before the deleted block
        for k in list(w.backend.keys("")):
            w.backend.delete(k)
        w.store(TOKENS, new)  # the same keys, other bytes, new files
        assert keys_bits(r.lookup(TOKENS).prompt_cache, N) == keys_bits(new, N)


@pytest.mark.parametrize("where", ["data", "header"])
def test_a_quarantined_block_is_closed_and_never_served(tmp_path, where):
    cache = kv_cache(N)
    w, r = pair(tmp_path)
    with w, r:
        w.store(TOKENS, cache)
        assert r.lookup(TOKENS).num_tokens == N
        key, name = block_keys(r.backend)[1]
        assert name in r.backend._fds._open
        flip(str(r.backend._data / name), where)  # seen through the kept descriptor too
        assert r.lookup(TOKENS).num_tokens == BS
        assert name not in r.backend._fds._open  # quarantined here: its descriptor closed
        assert os.listdir(tmp_path / "c" / "quarantine")
        assert r.lookup(TOKENS).num_tokens == BS  # and never read again
        w.store(TOKENS, cache)  # stored again: a new file, read in full
        assert keys_bits(r.lookup(TOKENS).prompt_cache, N) == keys_bits(cache, N)


def test_a_block_another_worker_quarantined_is_never_served_through_a_kept_descriptor(tmp_path):
    """Another worker found a block corrupt and quarantined it; this reader still holds the
    file open, and the bytes it would read through that descriptor verify again (mended in
    quarantine): the block is still never served, because the index no longer names it."""
    cache = kv_cache(N)
    w, r = pair(tmp_path)
    with w, r:
        w.store(TOKENS, cache)
        assert r.lookup(TOKENS).num_tokens == N
        key, name = block_keys(r.backend)[2]
        fd = r.backend._fds._open[name][0]
        path = r.backend._data / name
        good = path.read_bytes()
        flip(str(path), "data")
        assert w.lookup(TOKENS).num_tokens == 2 * BS  # the other worker quarantines block 2
        moved = tmp_path / "c" / "quarantine" / path.name
        assert moved.exists() and not path.exists()
        moved.write_bytes(good)  # the same inode: what the kept descriptor reads is whole again
        assert os.pread(fd, len(good), 0) == good
        assert name in r.backend._fds._open  # still kept here (another process quarantined it)
        hit = r.lookup(TOKENS)
        assert hit.num_tokens == 2 * BS  # the prefix ends before the quarantined block
        assert keys_bits(hit.prompt_cache, 2 * BS) == keys_bits(cache, 2 * BS)
        w.store(TOKENS, cache)  # stored again under a new file name: read in full
        assert keys_bits(r.lookup(TOKENS).prompt_cache, N) == keys_bits(cache, N)


def test_deleting_or_clearing_here_closes_the_descriptors(tmp_path):
    w, r = pair(tmp_path)
    with w, r:
        w.store(TOKENS, kv_cache(N))
        r.lookup(TOKENS)
        key, name = block_keys(r.backend)[3]
        fd = r.backend._fds._open[name][0]
        assert r.backend.delete(key)
        assert name not in r.backend._fds._open
        with pytest.raises(OSError):
            os.fstat(fd)  # closed (or reused by a later open: then not our file)
        r.backend.clear()
        assert len(r.backend._fds) == 0


def test_descriptors_are_bounded_and_never_closed_under_a_reader(tmp_path):
    paths = []
    for i in range(3):
        p = tmp_path / f"f{i}"
        p.write_bytes(b"x" * 10)
        paths.append(p)
    fds = Descriptors(keep=2)
    with fds.borrow("f0", paths[0]) as fd0:
        fds.forget(["f0"])  # deleted while a reader uses it: closed when returned
        assert os.pread(fd0, 1, 0) == b"x"
    with pytest.raises(OSError):
        os.fstat(fd0)
    for i, p in enumerate(paths):
        with fds.borrow(f"f{i}", p):
            pass
    assert len(fds) == 2  # the oldest idle one closed
    fds.clear()
    assert len(fds) == 0


def test_a_dropped_backend_closes_its_descriptors(tmp_path):
    w, r = pair(tmp_path)
    w.store(TOKENS, kv_cache(N))
    r.lookup(TOKENS)
    fds = [fd for fd, _ in r.backend._fds._open.values()]
    assert fds
    w.close()
    del r  # never closed
    import gc

    gc.collect()
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)
